"""``gpushare ctl``: its parser (an action each) and its command, over the admin socket."""

from __future__ import annotations

import argparse
from typing import cast

from gpushare.errors import GpushareError
from gpushare.settings import (
    END_GRACE_MAX_S,
    END_GRACE_S,
    ESCALATIONS,
    MODES,
    POLICIES,
    Change,
    SettingsError,
    check_end_grace,
)
from gpushare.tools.cli.args import DURATIONS, Subparsers, _admin, _admin_socket, _seconds, _setting
from gpushare.units import parse_duration


def _grace(text: str) -> float:
    try:
        return check_end_grace(parse_duration(text))
    except (ValueError, SettingsError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_parser(sub: Subparsers) -> None:
    c = sub.add_parser(
        "ctl",
        help="administer a running node",
        description="Administer a running node over its admin socket. --socket goes before"
        " or after the action.",
    )
    _admin_socket(c)
    cs = c.add_subparsers(dest="ctl_cmd", required=True, metavar="ACTION")
    st = cs.add_parser("status", help="GPUs, holders, queues and sessions")
    st.add_argument(
        "--json", action="store_true", help="one JSON object (docs/contract.md: Status JSON)"
    )
    _admin_socket(st)
    tq = cs.add_parser(
        "tq",
        help="show the time quantum, or set it live",
        description="Without SECONDS: the TQ in force on each GPU. With it: the new TQ, live"
        " (a shorter one also cuts the quantum running now). SECONDS is a number of seconds"
        f" or a duration ({DURATIONS}), from 0.05 s to 1 d.",
    )
    tq.add_argument(
        "tq_s",
        type=_setting("tq"),
        nargs="?",
        metavar="SECONDS",
        help=f"the new TQ: {DURATIONS} (none: show the TQ in force)",
    )
    tq.add_argument("--gpu", type=int, metavar="INDEX", help="only this GPU (default all)")
    tq.add_argument(
        "--persist",
        action="store_true",
        help="also write it to the node's state file (--state) or config file: a restart keeps it",
    )
    tq.add_argument("--json", action="store_true", help="each GPU's settings as JSON")
    _admin_socket(tq)
    for name, choices, what in [
        ("mode", MODES, "how sessions share a GPU"),
        ("policy", POLICIES, "how quanta are sized"),
        ("escalation", ESCALATIONS, "what happens to a holder that ignores a revoke"),
    ]:
        sp = cs.add_parser(name, help=f"set the {name}: {what}, live")
        sp.add_argument("value", choices=choices)
        sp.add_argument("--gpu", type=int, metavar="INDEX", help="only this GPU (default all)")
        sp.add_argument(
            "--persist", action="store_true", help="also write it down (state or config file)"
        )
        _admin_socket(sp)
    end = cs.add_parser(
        "end",
        help="end a session (its lease and memory are freed)",
        description="End a session. It is told at once (gpushare run sends its program"
        " SIGTERM) and keeps its turns for --grace, so a server's shutdown answers what is"
        " in flight; then the node ends it (gpushare run: SIGKILL) and frees its memory.",
    )
    end.add_argument("session", type=int, metavar="ID")
    end.add_argument("--reason", default="ended by an administrator")
    end.add_argument(
        "--grace",
        type=_grace,
        default=END_GRACE_S,
        metavar="DURATION",
        help=f"how long it keeps its turns first (default {END_GRACE_S:g}s; 0: at once;"
        f" at most {END_GRACE_MAX_S:g}s)",
    )
    _admin_socket(end)
    ev = cs.add_parser("events", help="the event stream as JSON lines")
    ev.add_argument("--follow", "-f", action="store_true", help="keep printing new events")
    ev.add_argument("--since", type=_seconds, metavar="DURATION", help="only the last 5m, 1h...")
    ev.add_argument("--session", type=int, metavar="ID", help="only this session's events")
    _admin_socket(ev)


def command(args: argparse.Namespace) -> int:
    from gpushare.tools import ctl

    path = _admin(args)
    if args.ctl_cmd == "status":
        return ctl.status(path, args.json)
    if args.ctl_cmd == "tq":
        if args.tq_s is None:
            if args.persist:
                raise GpushareError("--persist needs a value to write: ctl tq SECONDS --persist")
            return ctl.show_settings(path, args.gpu, args.json)
        return ctl.set_config(path, args.gpu, args.persist, {"tq_s": args.tq_s}, args.json)
    if args.ctl_cmd in ("mode", "policy", "escalation"):  # the node checks the value
        change = cast(Change, {args.ctl_cmd: args.value})
        return ctl.set_config(path, args.gpu, args.persist, change)
    if args.ctl_cmd == "end":
        return ctl.end_session(path, args.session, args.reason, args.grace)
    return ctl.events(path, args.follow, args.since, args.session)

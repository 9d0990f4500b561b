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
from gpushare.tools.cli.args import (
    DURATIONS,
    Subparsers,
    _admin,
    _admin_socket,
    _seconds,
    _setting,
    _size,
)
from gpushare.units import is_fraction, parse_duration, parse_weight


def _grace(text: str) -> float:
    try:
        return check_end_grace(parse_duration(text))
    except (ValueError, SettingsError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _fraction(text: str) -> float:
    try:
        f = float(text)
    except ValueError:
        f = float("nan")
    if not is_fraction(f):
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction of the GPU's time in (0, 1]")
    return f


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
    _add_claim(cs)
    ev = cs.add_parser("events", help="the event stream as JSON lines")
    ev.add_argument("--follow", "-f", action="store_true", help="keep printing new events")
    ev.add_argument("--since", type=_seconds, metavar="DURATION", help="only the last 5m, 1h...")
    ev.add_argument("--session", type=int, metavar="ID", help="only this session's events")
    _admin_socket(ev)


def _add_claim(cs: Subparsers) -> None:
    claim = cs.add_parser(
        "claim",
        help="DRA ResourceClaims prepared on this node (gpushare-dra calls these)",
        description="The DRA plugin (gpushare-dra) tells the node each ResourceClaim it"
        " prepares and unprepares; sessions that name the claim (GPUSHARE_CLAIM) or come from"
        " its pods attach only within its figures. By hand: to look at or mend a node.",
    )
    _admin_socket(claim)
    ccs = claim.add_subparsers(dest="claim_cmd", required=True, metavar="ACTION")
    prep = ccs.add_parser("prepare", help="a claim allocated on this node: bind its sessions")
    prep.add_argument("uid", metavar="UID", help="the ResourceClaim's metadata.uid")
    prep.add_argument("--gpu", type=int, required=True, metavar="INDEX", help="its GPU")
    prep.add_argument("--namespace", default="", help="the claim's namespace")
    prep.add_argument("--name", default="", help="the claim's name")
    prep.add_argument(
        "--pod",
        action="append",
        default=[],
        metavar="UID",
        help="a pod UID it is reserved for (status.reservedFor; repeat for several)",
    )
    prep.add_argument(
        "--memory-request", type=_size, default=0, metavar="SIZE", help="its allocated memory"
    )
    prep.add_argument(
        "--memory-limit", type=_size, default=0, metavar="SIZE", help="its limit (0: the request)"
    )
    prep.add_argument(
        "--weight", type=parse_weight, default=0.0, help="its weight (default: the workload's)"
    )
    prep.add_argument(
        "--compute-limit",
        type=_fraction,
        default=0.0,
        metavar="F",
        help="its compute limit, a fraction in (0, 1] (default: none)",
    )
    _admin_socket(prep)
    un = ccs.add_parser("unprepare", help="a claim done with: its sessions are ended")
    un.add_argument("uid", metavar="UID")
    un.add_argument("--reason", default="its ResourceClaim was unprepared")
    un.add_argument(
        "--grace",
        type=_grace,
        default=0.0,
        metavar="DURATION",
        help="how long its sessions keep their turns first (default 0: at once)",
    )
    _admin_socket(un)


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
    if args.ctl_cmd == "claim" and args.claim_cmd == "prepare":
        return ctl.prepare_claim(
            path, args.uid, args.gpu, args.namespace, args.name, args.pod,
            args.memory_request, args.memory_limit, args.weight, args.compute_limit,
        )  # fmt: skip
    if args.ctl_cmd == "claim":
        return ctl.unprepare_claim(path, args.uid, args.reason, args.grace)
    return ctl.events(path, args.follow, args.since, args.session)

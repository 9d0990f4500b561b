"""``gpushare top``: its parser and its command (the live view)."""

from __future__ import annotations

import argparse

from gpushare.tools.cli.args import Subparsers, _admin, _admin_socket, _seconds


def add_parser(sub: Subparsers) -> None:
    t = sub.add_parser(
        "top",
        help="live view of GPUs and sessions (q quits)",
        description="A live view over the admin socket, refreshed twice a second."
        " SHARE is each session's share of GPU time over the last minute (since it"
        " attached, when younger). Keys: arrows/PgUp/PgDn scroll, Enter a session's"
        " details, s (or 1-6) sort, r reverse, h help, q quits. Needs a terminal: with"
        " stdin or stdout not one it prints one frame, as --once.",
    )
    _admin_socket(t)
    t.add_argument("--once", action="store_true", help="print one frame and exit (scripts)")
    t.add_argument("--json", action="store_true", help="with --once: the frame as JSON")
    t.add_argument(
        "--interval", type=_seconds, default=0.5, metavar="SECONDS", help="seconds between frames"
    )


def command(args: argparse.Namespace) -> int:
    from gpushare.tools.top import run_top

    return run_top(_admin(args), args.once, args.interval, as_json=args.json)

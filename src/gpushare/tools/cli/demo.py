"""``gpushare demo``: its parser and its command (a node, three workloads, a report)."""

from __future__ import annotations

import argparse

from gpushare.settings import MODES
from gpushare.tools.cli.args import Subparsers, _seconds


def add_parser(sub: Subparsers) -> None:
    d = sub.add_parser(
        "demo",
        help="a node on a simulated GPU, three workloads, a report",
        description="Start a node on a simulated 80 GiB GPU and three 30 GiB "
        "workloads (two batch jobs, one interactive), show progress, then a "
        "table per workload.",
    )
    d.add_argument("--seconds", type=_seconds, default=20.0, help="how long (default 20)")
    d.add_argument("--tq", type=_seconds, default=2.0, help="time quantum (default 2)")
    d.add_argument("--workdir", metavar="DIR", help="keep sockets, logs and events here")
    d.add_argument(
        "--mode",
        choices=MODES,
        default="exclusive",
        help="exclusive (default: one workload at a time, round-robin) or auto (those that"
        " fit together share)",
    )


def command(args: argparse.Namespace) -> int:
    from gpushare.tools.demo import run_demo

    return run_demo(args.seconds, args.tq, args.workdir, args.mode)

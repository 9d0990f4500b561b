"""``gpushare simulate``: its parser and its command (a policy study on model workloads)."""

from __future__ import annotations

import argparse
import sys

from gpushare.settings import MODES, POLICIES
from gpushare.tools.cli.args import Subparsers, _positive_size, _seconds, _setting


def add_parser(sub: Subparsers) -> None:
    sim = sub.add_parser(
        "simulate",
        help="a policy study: goodput, waits and batch loss against TQ (no GPU needed)",
        description="Run model workloads against the real arbiter under a virtual clock, "
        "for each TQ: print a table (goodput against the one-switch-per-quantum ideal, "
        "waits, batch loss) and draw it as a PNG. See docs/scheduling.md.",
    )
    sim.add_argument(
        "--mix",
        choices=["batch", "short", "interactive", "mixed"],
        default="mixed",
        help="three sessions: batch jobs, short bursts, two batch jobs and a notebook, or "
        "one of each (default mixed)",
    )
    sim.add_argument(
        "--fitting",
        action="store_true",
        help="sessions of 1/4 of the GPU each, fitting together (default: 3/8 each, over it)",
    )
    sim.add_argument(
        "--workload",
        action="append",
        metavar="KIND:SIZE[@WEIGHT]",
        help="a session of your own mix instead (repeat): batch, short, interactive or "
        "server; SIZE is its memory request, ',limit=SIZE' a limit above it (packed by"
        " the request in mode auto); a server takes rate=R,service=SECONDS,discard=SIZE",
    )
    sim.add_argument(
        "--gpu-memory",
        type=_positive_size,
        default=80 * 2**30,
        metavar="SIZE",
        help="the modelled GPU's memory (default 80GiB)",
    )
    sim.add_argument(
        "--bandwidth",
        type=_setting("sim_bandwidth"),
        default=55e9,
        metavar="BYTES_PER_S",
        help="the modelled swap bandwidth, each way (default 55e9)",
    )
    sim.add_argument(
        "--tq",
        type=_seconds,
        nargs="+",
        default=[1.0, 5.0, 30.0],
        metavar="SECONDS",
        help="the TQs to compare, a row each (default 1 5 30)",
    )
    sim.add_argument(
        "--seconds",
        type=_seconds,
        default=120.0,
        help="simulated seconds per run (default 120; longer where a long TQ needs it)",
    )
    sim.add_argument(
        "--mode", choices=MODES, default="exclusive", help="as the node's (default exclusive)"
    )
    sim.add_argument(
        "--policy", choices=POLICIES, default="equal", help="as the node's (default equal)"
    )
    sim.add_argument(
        "--no-prefetch",
        dest="prefetch",
        action="store_false",
        help="as the node's flag: no swap-in of the next holder during the quantum",
    )
    sim.add_argument(
        "--turn",
        type=_setting("turn"),
        default=1.0,
        metavar="SECONDS",
        help="the longest interactive turn, 0 for none (default 1; docs/scheduling.md)",
    )
    sim.add_argument(
        "--idle-release",
        type=_setting("idle_release"),
        default=0.5,
        metavar="SECONDS",
        help="the longest a quantum waits for its holder to ask again (default 0.5)",
    )
    sim.add_argument(
        "--seed",
        type=int,
        default=1,
        help="the notebook's think times and bursts (default 1): the same seed, the same table",
    )
    sim.add_argument(
        "-o",
        "--output",
        default="simulate.png",
        metavar="FILE.png",
        help="where the plot goes (default simulate.png)",
    )
    sim.add_argument("--no-plot", action="store_true", help="print the table only")


def command(args: argparse.Namespace) -> int:
    from gpushare.settings import GpuSettings
    from gpushare.tools import simulate as sim
    from gpushare.tools import simulate_study as study
    from gpushare.units import format_size

    try:
        if args.workload:
            workloads = [sim.Workload.parse(w) for w in args.workload]
        else:
            workloads = sim.preset(args.mix, not args.fitting, args.gpu_memory)
    except ValueError as e:
        print(f"gpushare simulate: error: {e}", file=sys.stderr)
        return 2
    for w in workloads:  # each must fit on the GPU alone (the arbiter refuses it)
        if not 0 < w.memory <= args.gpu_memory:
            what = "has no memory" if not w.memory else "does not fit on"
            print(
                f"gpushare simulate: error: a {w.kind} workload of {format_size(w.memory)}"
                f" {what} the GPU of {format_size(args.gpu_memory)}: give it from 1 byte to"
                f" {format_size(args.gpu_memory)}, or a larger --gpu-memory",
                file=sys.stderr,
            )
            return 2
    settings = GpuSettings(
        mode=args.mode,
        policy=args.policy,
        prefetch=args.prefetch,
        turn_s=args.turn,
        anticipate_s=args.idle_release,
    )
    title = study.describe(workloads, args.gpu_memory, settings)
    print(
        f"gpushare simulate: {title}; {args.seconds:g} s per run, or {study.ROUNDS} rounds of"
        " every session's quantum where longer (run s)"
    )
    sys.stdout.flush()

    def progress(what: str) -> None:  # seconds a run: said on stderr, the table stays clean
        print(f"gpushare simulate: {what}", file=sys.stderr, flush=True)

    rows = study.study(
        workloads,
        args.tq,
        args.gpu_memory,
        settings,
        args.seconds,
        args.bandwidth,
        args.seed,
        progress=progress,
    )
    print(study.table(rows))
    print()
    print(study.FOOTER)
    if args.no_plot:
        return 0
    try:
        study.plot(rows, args.output, title)
    except ImportError as e:
        print(f"gpushare simulate: error: {e} (or --no-plot)", file=sys.stderr)
        return 1
    print(f"wrote {args.output}")
    return 0

"""``gpushare run``: its parser and its command (a program run as a session)."""

from __future__ import annotations

import argparse
import os
import sys

from gpushare.settings import RESIDENT_MODELS
from gpushare.tools.cli.args import Subparsers, _weight
from gpushare.units import format_size, parse_size


def add_parser(sub: Subparsers) -> None:
    r = sub.add_parser(
        "run",
        help="run an unmodified PyTorch program as a session",
        description="Run COMMAND with its Python attached as a session: GPU work is gated "
        "on the lease at PyTorch's module-forward and optimizer-step hooks, which are also "
        "its safe points; the lease is released after idle_release without GPU work. "
        "See docs/run.md for what is gated and what is not.",
    )
    r.add_argument(
        "--memory",
        metavar="SIZE",
        help="memory request: what the node guarantees and packs by, and the limit unless"
        " --memory-limit says more (default GPUSHARE_MEMORY, else KAI's gpu-memory or"
        " GPU_PORTION of the GPU)",
    )
    r.add_argument(
        "--memory-limit",
        metavar="SIZE",
        help="the most memory the program may use: above the request it is lent while"
        " free and given back when needed, never a reason to end it (default"
        " GPUSHARE_MEMORY_LIMIT, else KAI's limit annotations, else the request)",
    )
    r.add_argument(
        "--compute-limit",
        metavar="F",
        help="the most of the GPU's time the program may take, a fraction in (0, 1], even"
        " when the GPU would otherwise idle (default GPUSHARE_COMPUTE_LIMIT, else none)",
    )
    r.add_argument(
        "--weight",
        type=_weight,
        metavar="W",
        help="weight under policy weighted, from 0.001 to 1000 (default 1, or KAI's GPU_PORTION)",
    )
    r.add_argument("--name", help="the session's name (default the program's)")
    r.add_argument(
        "--socket",
        metavar="PATH",
        default=argparse.SUPPRESS,
        help="the node's workload socket (default $GPUSHARE_SOCKET, else"
        " /run/gpushare/gpushare.sock)",
    )
    r.add_argument("--gpu", type=int, metavar="INDEX")
    r.add_argument(
        "--sim-resident",
        choices=("none", *RESIDENT_MODELS),
        help="on a simulated GPU (where PyTorch runs on the CPU), model the program's GPU"
        " memory in the session: its modules' parameters and buffers (weights), or its"
        " memory request (declared); swapped and checked like any (default"
        " GPUSHARE_SIM_RESIDENT, else none)",
    )
    r.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND ...")


def command(args: argparse.Namespace) -> int:
    from gpushare.client.runner import run

    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    for flag, value in (("--memory", args.memory), ("--memory-limit", args.memory_limit)):
        if value is None:
            continue
        try:
            if parse_size(value) == 0:  # a clear error before anything starts
                raise ValueError(f"a memory limit must be more than 0: like {flag} 10GiB")
        except ValueError as e:
            print(f"gpushare run: error: {flag}: {e}", file=sys.stderr)
            return 2
    if args.memory is not None and args.memory_limit is not None:
        request, limit = parse_size(args.memory), parse_size(args.memory_limit)
        if limit < request:  # said in the flags' words, before anything starts
            print(
                f"gpushare run: error: --memory-limit {format_size(limit)} is below"
                f" --memory {format_size(request)}: give a limit at least as large as"
                " the request",
                file=sys.stderr,
            )
            return 2
    socket = getattr(args, "socket", None)
    if args.sim_resident:  # (the program's Python reads it: client/modelled.py)
        os.environ["GPUSHARE_SIM_RESIDENT"] = args.sim_resident
    return run(
        cmd,
        args.memory,
        args.weight,
        args.name,
        socket,
        args.gpu,
        args.memory_limit,
        args.compute_limit,
    )

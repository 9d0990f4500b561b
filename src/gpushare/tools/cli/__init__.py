"""The ``gpushare`` command line: the top parser, and each command's parser and command
in a module of its own here (``node``, ``ctl``, ``run``, ``top``, ``timeline``,
``simulate``, ``demo``, ``completion``), in the order ``--help`` lists them."""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

from gpushare._version import __version__
from gpushare.errors import GpushareError
from gpushare.tools.cli import completion, ctl, demo, node, run, simulate, timeline, top

# name -> its module, in the order of --help
COMMANDS = {
    "node": node,
    "ctl": ctl,
    "run": run,
    "top": top,
    "timeline": timeline,
    "simulate": simulate,
    "demo": demo,
    "completion": completion,
}


def _parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


class Parser(argparse.ArgumentParser):
    """argparse, with a usage mistake said in one line (the usage is one --help away), and
    no abbreviated options: ``node --sim-gpu 1`` must not pass for ``--sim-gpus`` (a typo
    would start a real node on the default paths)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(
        prog="gpushare",
        description="Share one GPU safely and fairly: exclusive time quanta, swap to host "
        "memory, fraction-weighted shares, per-session figures.",
    )
    ap.add_argument("--version", action="version", version=f"gpushare {__version__}")
    ap.add_argument(
        "--socket",
        metavar="PATH",
        default=argparse.SUPPRESS,
        help="the socket of the command that follows, as if given after it: the workload"
        " socket for node and run, the admin socket for ctl, top and timeline",
    )
    ap.add_argument(
        "--admin-socket", metavar="PATH", default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    for module in COMMANDS.values():
        module.add_parser(sub)

    for p in _parsers(ap):
        # "-1GiB", "-5m", "-5": a value (refused with its reason), never an unknown option
        p._negative_number_matcher = re.compile(r"^-\.?[0-9]")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    if "_ARGCOMPLETE" in os.environ:  # a shell asks for completions (gpushare completion)
        try:
            import argcomplete
        except ImportError:
            return 1
        argcomplete.autocomplete(parser)
    args = parser.parse_args(argv)
    try:
        rc = _command(args)
        sys.stdout.flush()  # here, so that a reader gone away is seen here
        return rc
    except GpushareError as e:
        print(f"gpushare {args.cmd}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`gpushare ctl events | head`): stop quietly, as `yes | head`
        # does, with the status of a SIGPIPE; nothing more may reach the closed pipe.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


def _command(args: argparse.Namespace) -> int:
    command: Callable[[argparse.Namespace], int] = COMMANDS[args.cmd].command
    return command(args)

"""``gpushare completion``: its parser and its command (a shell completion script)."""

from __future__ import annotations

import argparse
import sys

from gpushare.errors import GpushareError
from gpushare.tools.cli.args import Subparsers


def add_parser(sub: Subparsers) -> None:
    comp = sub.add_parser(
        "completion",
        help="print a shell completion script",
        description="Print the completion script for SHELL (needs argcomplete: pip install"
        " 'gpushare[cli]'). bash: eval \"$(gpushare completion bash)\" in ~/.bashrc; zsh the"
        " same in ~/.zshrc; fish: gpushare completion fish | source.",
    )
    comp.add_argument("shell", choices=["bash", "zsh", "fish"], nargs="?", default="bash")


def command(args: argparse.Namespace) -> int:
    return _completion(args.shell)


def _completion(shell: str) -> int:
    try:
        from argcomplete.shell_integration import shellcode
    except ImportError:
        raise GpushareError(
            "shell completion needs argcomplete: pip install 'gpushare[cli]'"
        ) from None
    sys.stdout.write(shellcode(["gpushare"], shell=shell))
    return 0

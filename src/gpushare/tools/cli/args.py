"""What the commands' parsers share: the argparse types of sizes, weights, durations and
node settings (each refusing a value with the one validation's words), and the admin
socket's option."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from typing import TypeAlias

from gpushare.settings import RANGES, SettingsError, check
from gpushare.units import parse_duration, parse_size, parse_weight

# What a command's add_parser is given: the top parser's subcommands.
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _weight(text: str) -> float:
    try:
        return parse_weight(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_size(text: str) -> int:
    size = _size(text)
    if size <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, like 80GiB, not {text}")
    return size


def _seconds(text: str) -> float:
    try:
        v = parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be positive (a duration like 30s, 5m), not {text}")
    return v


def _setting(key: str) -> Callable[[str], float]:
    """The argparse type of a node setting: read as a duration (``5m``), a whole number or
    a number, then checked by the one validation (gpushare.settings), so a flag, the config
    file and ``ctl`` refuse a value with the same words."""
    r = RANGES[key]

    def parse(text: str) -> float:
        try:
            if r.unit == "s":
                value: float = parse_duration(text)
            elif r.integer and re.fullmatch(r"\s*[-+]?[0-9]+\s*", text):
                value = int(text)
            else:
                value = float(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(
                str(e) if r.unit == "s" else f"cannot read {text!r}: {r.describe()}"
            ) from None
        try:
            return check(key, value)
        except SettingsError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = key
    return parse


ADMIN_SOCKET_HELP = (
    "the node's admin socket (default $GPUSHARE_ADMIN_SOCKET, else /run/gpushare/admin.sock);"
    " --admin-socket is the same"
)
DURATIONS = "30, 30s, 5m, 1.5h, 1d, 250ms, 1e3"


def _admin_socket(parser: argparse.ArgumentParser) -> None:
    """``--socket`` (or ``--admin-socket``) for the commands that administer: the admin
    socket, before or after the subcommand. SUPPRESS: a level that was not given it does
    not override the level that was."""
    parser.add_argument(
        "--socket",
        "--admin-socket",
        dest="admin_socket",
        metavar="ADMIN_SOCKET",
        default=argparse.SUPPRESS,
        help=ADMIN_SOCKET_HELP,
    )


def _admin(args: argparse.Namespace) -> str | None:
    """The admin socket of ctl, top, timeline: --socket or --admin-socket, before or after."""
    return getattr(args, "admin_socket", None) or getattr(args, "socket", None)

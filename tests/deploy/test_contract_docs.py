"""docs/contract.md names what the code offers: every command and flag, every config
key, every top-level Python name, every environment variable read, every protocol
message and field, every event kind. An addition not written there fails here: write it
in docs/contract.md, and under its "Changes to the contract"."""

from __future__ import annotations

import argparse
import re
import typing
from collections.abc import Iterator

import msgspec
import pytest

import gpushare
from gpushare import protocol
from gpushare.node.keep.config import GpuOverride, NodeConfig
from gpushare.node.keep.events import EVENT_KINDS
from gpushare.tools.cli import build_parser
from tests.support import REPO

CONTRACT = (REPO / "docs" / "contract.md").read_text()
# Set by `gpushare run` for its own child, or a development aid: not for users.
INTERNAL_ENV = {"GPUSHARE_AUTOATTACH", "GPUSHARE_WEIGHT", "GPUSHARE_NAME", "GPUSHARE_GPU"}
INTERNAL_ENV |= {"GPUSHARE_DEMO_DIR"}


def written(name: str) -> bool:
    """``name`` as a whole word (a flag, a key, a field) somewhere in the contract."""
    return re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", CONTRACT) is not None


def commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], list[str]]]:
    """(command path, its option strings) for every command and subcommand."""
    options = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, (*path, name))
        else:
            options += [o for o in action.option_strings if o.startswith("--")]
    yield path, options


def test_every_command_and_flag_is_in_the_contract():
    missing = []
    for path, options in commands(build_parser()):
        if path and not re.search(rf"gpushare( \S+)* {re.escape(path[-1])}\b", CONTRACT):
            missing.append(" ".join(path))
        missing += [f"{' '.join(path)} {o}" for o in options if o != "--help" and not written(o)]
    assert not missing, f"write these in docs/contract.md: {missing}"


def test_every_config_key_is_in_the_contract():
    keys = [*msgspec.structs.fields(NodeConfig), *msgspec.structs.fields(GpuOverride)]
    missing = [f.name for f in keys if not written(f"`{f.name}`") and f.name != "gpu"]
    assert written("[gpu.N]")
    assert not missing, f"write these config keys in docs/contract.md: {missing}"


def test_every_top_level_name_is_in_the_contract():
    missing = [n for n in gpushare.__all__ if not written(n)]
    assert not missing, f"write these in docs/contract.md's Python API: {missing}"


def test_every_environment_variable_read_is_in_the_contract():
    read = set()
    for path in (REPO / "src" / "gpushare").rglob("*.py"):
        read |= set(re.findall(r"\bGPUSHARE_[A-Z_]+\b", path.read_text()))
    assert {"GPUSHARE_SOCKET", "GPUSHARE_MEMORY"} <= read  # the scan sees them
    missing = sorted(v for v in read - INTERNAL_ENV if not written(v))
    assert not missing, f"write these in docs/contract.md's environment: {missing}"


MESSAGES = typing.get_args(protocol.Message)


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: m.__name__)
def test_every_protocol_message_and_field_is_in_the_contract(msg):
    tag = msg.__struct_config__.tag
    assert written(f"`{tag}`"), f"write the {tag!r} message in docs/contract.md"
    missing = [f for f in msg.__struct_fields__ if not written(f)]
    assert not missing, f"write these fields of {tag!r} in docs/contract.md: {missing}"


def test_the_protocol_version_is_the_one_written():
    assert f"Protocol version: {protocol.PROTOCOL_VERSION}." in CONTRACT


def test_every_event_kind_is_in_the_contract():
    missing = [k for k in (*EVENT_KINDS, "refused") if not written(f"`{k}`")]
    assert not missing, f"write these event kinds in docs/contract.md: {missing}"

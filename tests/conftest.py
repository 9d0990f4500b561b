"""Fixtures: a real node daemon process on simulated GPUs, over real Unix sockets
(helpers in :mod:`tests.support`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

from gpushare.core.arbiter import Arbiter
from tests.support import NodeProcess

# Every arbiter in the tests (the model's, the in-process nodes') checks its running
# totals and deadline structures against scans of every session after every input.
Arbiter.check_every_input = True

# In CI the property tests draw the same examples every run (reproducible verdicts);
# elsewhere they explore new ones each time.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture
def short_tmp():
    import tempfile

    with tempfile.TemporaryDirectory(prefix="gs-") as d:
        yield Path(d)


@pytest.fixture
def node_factory(short_tmp):
    nodes: list[NodeProcess] = []

    def make(*args: str, start: bool = True) -> NodeProcess:
        n = NodeProcess(short_tmp, *args)
        nodes.append(n)
        return n.start() if start else n

    yield make
    for n in nodes:
        if n.proc and n.proc.poll() is None:
            n.proc.kill()
            n.proc.wait()


@pytest.fixture(autouse=True)
def _no_inherited_gpushare_env(monkeypatch):
    for k in (
        "GPUSHARE_SOCKET",
        "GPUSHARE_MEMORY",
        "GPU_PORTION",
        "NVIDIA_VISIBLE_DEVICES",
        "GPUSHARE_ADMIN_SOCKET",
    ):
        monkeypatch.delenv(k, raising=False)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")

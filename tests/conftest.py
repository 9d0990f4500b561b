"""Fixtures: a real node daemon process on simulated GPUs, over real Unix sockets
(helpers in :mod:`tests.support`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import is_hypothesis_test

from tests import profiles  # noqa: F401  (the hypothesis profile: dev here, ci in CI)
from tests.support import NodeProcess


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every property test is ``slow`` (``-m "not slow"`` leaves them out); they run by
    default, with the dev profile's few examples outside CI."""
    for item in items:
        if is_hypothesis_test(getattr(item, "obj", None)):
            item.add_marker(pytest.mark.slow)


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

"""Fixtures: a real node daemon process on simulated GPUs, over real Unix sockets
(helpers in :mod:`tests.support`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import is_hypothesis_test

from tests import profiles  # noqa: F401  (the hypothesis profile: dev here, ci in CI)
from tests.support import NodeProcess

# What the client reads from its environment: a workload's identity, its figures, its
# node. The machine the suite runs on may set any of them (a CI runner in a container sets
# CONTAINER_NAME): the suite is its own environment, each test sets what it means.
INHERITED = (
    "POD_NAME", "POD_NAMESPACE", "POD_UID", "CONTAINER_NAME", "NVIDIA_VISIBLE_DEVICES",
    "GPU_PORTION", "GPU_MEMORY_LIMIT", "CUDA_DEVICE_MEMORY_LIMIT",
    "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
    "GPUSHARE_SOCKET", "GPUSHARE_ADMIN_SOCKET", "GPUSHARE_NAME", "GPUSHARE_GPU",
    "GPUSHARE_MEMORY", "GPUSHARE_MEMORY_LIMIT", "GPUSHARE_HOST_MEMORY",
    "GPUSHARE_COMPUTE_LIMIT", "GPUSHARE_WEIGHT", "GPUSHARE_FAMILY", "GPUSHARE_GANG",
    "GPUSHARE_PODINFO", "GPUSHARE_AUTOATTACH", "GPUSHARE_RECONNECT_TIMEOUT",
    "GPUSHARE_UNGATED_SAID",
)  # fmt: skip


def pytest_configure(config: pytest.Config) -> None:
    """Before any fixture (module-scoped ones start workloads too): none inherited."""
    for k in INHERITED:
        os.environ.pop(k, None)


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
    for k in INHERITED:
        monkeypatch.delenv(k, raising=False)  # what an earlier test left set
    os.environ.setdefault("PYTHONUNBUFFERED", "1")

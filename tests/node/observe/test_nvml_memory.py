"""Memory a hello says is resident, checked against NVML's per-process count (issue 24).

NVML is faked at the driver's edge, shaped like pynvml: ``nvmlDeviceGetComputeRunningProcesses``
gives objects with ``pid`` and ``usedGpuMemory`` (None where the driver may not say). No real
GPU ran these: the GPU run is still to do (docs/gpu-run.md)."""

from __future__ import annotations

import dataclasses
import logging
import os
import types

import pytest

from gpushare import protocol as p
from gpushare.node.observe.utilization import NvmlUtilization
from tests.node.harness import G, InProcessNode, in_process

PID = os.getpid()  # the test's connections are this process's


class FakeNvml:
    """pynvml's calls the node makes for one GPU's processes: ``used`` is pid -> bytes
    (None: listed, figure not available), as nvmlDeviceGetComputeRunningProcesses gives
    them (c_nvmlProcessInfo_t: pid, usedGpuMemory, gpuInstanceId, computeInstanceId)."""

    def __init__(self, used: dict[int, int | None]) -> None:
        self.used = used
        self.calls = 0

    def nvmlDeviceGetHandleByIndex(self, i: int) -> str:
        return f"h{i}"

    def nvmlDeviceGetComputeRunningProcesses(self, h: str) -> list[object]:
        self.calls += 1
        return [
            types.SimpleNamespace(
                pid=pid, usedGpuMemory=used, gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF
            )
            for pid, used in self.used.items()
        ]


def test_memory_of_sums_the_pids_listed_and_says_when_it_cannot_tell():
    nvml = FakeNvml({10: 3 * G, 11: G, 12: 5 * G, 13: None})
    u = NvmlUtilization(nvml, 0)
    assert u.memory_of({10, 11}) == 4 * G  # a process and its child, together
    assert u.memory_of({99}) == 0  # not listed: no context on this GPU
    assert u.memory_of({10, 13}) is None  # listed without a figure: nothing to check
    assert u.memory() == {10: 3 * G, 11: G, 12: 5 * G}  # the sampler's view, as before


def real_gpu(node: InProcessNode, used: dict[int, int | None]) -> FakeNvml:
    """GPU 0 as a real one whose driver counts ``used``."""
    node.node.gpus[0] = dataclasses.replace(node.node.gpus[0], simulated=False)
    nvml = FakeNvml(used)
    node.node.sampler.nvml = {0: NvmlUtilization(nvml, 0)}
    return nvml


@pytest.mark.parametrize(
    ("counted", "believed"),
    [
        (30 * G, 20 * G),  # NVML counts more (its CUDA context too): the claim stands
        (12 * G, 12 * G),  # NVML counts less: no more than NVML counts
        (None, 0),  # NVML cannot say: a new session has nothing resident
    ],
)
@in_process(memory="80GiB", mode="exclusive")
async def test_a_new_sessions_resident_memory_counts_as_far_as_nvml_sees_it(
    node, counted, believed, caplog
):
    caplog.set_level(logging.WARNING, logger="gpushare.node")
    nvml = real_gpu(node, {PID: counted, PID + 1: 50 * G})  # another process's memory
    w = await node.workload(memory_limit=40 * G, name="w", resident=20 * G)
    (s,) = node.node.status().gpus[0].sessions
    assert s.resident_bytes == believed and nvml.calls >= 1
    assert any("taken as" in r.getMessage() for r in caplog.records) == (believed < 20 * G)
    w.close()


@in_process(memory="80GiB", mode="exclusive")
async def test_a_process_nvml_does_not_list_has_nothing_resident(node):
    real_gpu(node, {PID + 1: 60 * G})  # only another process has memory there
    w = await node.workload(memory_limit=60 * G, name="stranger", resident=60 * G)
    (s,) = node.node.status().gpus[0].sessions
    assert s.resident_bytes == 0
    w.close()


@in_process(memory="80GiB", mode="exclusive")
async def test_a_simulated_gpu_has_no_nvml_and_a_new_session_nothing_resident(node):
    w = await node.workload(memory_limit=40 * G, name="w", resident=20 * G)
    (s,) = node.node.status().gpus[0].sessions
    assert s.resident_bytes == 0
    w.close()


@pytest.mark.parametrize(
    ("counted", "believed"),
    [(8 * G, 8 * G), (None, 30 * G), ("unlisted", 30 * G)],
)
@in_process(memory="80GiB", mode="exclusive", tq=5)
async def test_a_session_on_record_counts_no_more_than_nvml_sees(node, counted, believed):
    b = await node.workload(memory_limit=30 * G, name="b")
    await b.send(p.Acquire())
    await b.expect(p.Grant)
    await b.send(p.Report(resident=30 * G, swapped=0), p.Release(resident=30 * G, swapped=0))
    await node.settle()
    await node.restart()  # b outlives it, on record with its 30 GiB
    real_gpu(node, {PID + 1: G} if counted == "unlisted" else {PID: counted})
    b2 = await node.workload(session=b.session, memory_limit=30 * G, name="b", resident=30 * G)
    assert b2.session == b.session  # back, on record
    (s,) = node.node.status().gpus[0].sessions
    assert s.resident_bytes == believed
    b2.close()

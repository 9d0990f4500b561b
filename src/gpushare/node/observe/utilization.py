"""GPU utilization sampling, attributed to sessions through the lease; and the GPU's own
view of each session's memory (NVML), checked against its limit.

NVML's device utilization is sampled once a second. In an exclusive period the whole
sample is credited to the one holder: the lease says who used the GPU. In a shared
period, NVML's per-process samples are used where the driver gives them (credited to the
session of each pid), and whatever is left is counted as *shared*, not guessed.

A simulated GPU's utilization follows a stated model: 1.0 while any session holds a
lease, 0.0 otherwise (a simulated workload computes during its lease).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from gpushare.core import events as typed
from gpushare.core.arbiter import Arbiter
from gpushare.core.attribution import Attribution
from gpushare.core.clock import Clock
from gpushare.node.decide.decisions import Decisions
from gpushare.node.guard import Conn
from gpushare.node.host.gpus import GpuInfo
from gpushare.node.host.procs import descends

log = logging.getLogger("gpushare.node.utilization")


class NvmlUtilization:
    """Device and per-process utilization through a module with pynvml's API."""

    def __init__(self, nvml: Any, index: int, mig_index: int = -1) -> None:
        self.nvml = nvml
        self.handle = nvml.nvmlDeviceGetHandleByIndex(index)
        self.mig = mig_index >= 0
        if self.mig:  # a MIG instance: its own handle, its own processes
            self.handle = nvml.nvmlDeviceGetMigDeviceHandleByIndex(self.handle, mig_index)
        self._last_ts = 0

    def device(self) -> float | None:
        """The device's utilization (0-1); None where NVML does not give it (a MIG
        instance: the lease's model then, as for a simulated GPU)."""
        if self.mig:
            return None
        return float(self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu) / 100.0

    def memory(self) -> dict[int, int]:
        """pid -> GPU memory bytes in use, as the driver counts them."""
        out: dict[int, int] = {}
        for proc in self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle):
            used = proc.usedGpuMemory
            if used is not None:  # None where the driver may not say (no permission)
                out[int(proc.pid)] = out.get(int(proc.pid), 0) + int(used)
        return out

    def memory_of(self, pids: Collection[int]) -> int | None:
        """The GPU memory the driver counts for ``pids`` together: 0 where it lists none
        of them (no context on this GPU); None where it lists one without a figure
        (``usedGpuMemory`` is None where the driver may not say: no permission, some
        vGPU and MIG setups), so nothing can be checked."""
        total = 0
        for proc in self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle):
            if int(proc.pid) in pids:
                if proc.usedGpuMemory is None:
                    return None
                total += int(proc.usedGpuMemory)
        return total

    def processes(self) -> dict[int, float]:
        """pid -> SM utilization (0-1) since the last call; empty where unsupported."""
        try:
            samples = self.nvml.nvmlDeviceGetProcessUtilization(self.handle, self._last_ts)
        except Exception:  # NVMLError_NotSupported / NotFound: no samples this period
            return {}
        out: dict[int, float] = {}
        for smp in samples:
            self._last_ts = max(self._last_ts, int(smp.timeStamp))
            out[int(smp.pid)] = max(out.get(int(smp.pid), 0.0), float(smp.smUtil) / 100.0)
        return out


class Sampler:
    """Once a period: each GPU's utilization, credited to its lease holders; where NVML
    shows each process's memory, a session over its limit goes to its arbiter."""

    def __init__(
        self,
        gpus: Sequence[GpuInfo],
        arbiters: Sequence[Arbiter],
        utilization: Sequence[Attribution],
        nvml: Mapping[int, NvmlUtilization],
        conns: Mapping[int, Conn],
        clock: Clock,
        decisions: Decisions,
        allowance: Callable[[], int],
        publish: Callable[[dict[str, Any]], None] = lambda rec: None,
        proc_root: Callable[[], str] = lambda: "/proc",
    ) -> None:
        self.gpus, self.arbiters, self.utilization = gpus, arbiters, utilization
        self.nvml, self.conns, self.clock, self.decisions = nvml, conns, clock, decisions
        self.allowance = allowance  # NVML bytes a process may use beyond its session's
        self.publish, self.proc_root = publish, proc_root
        # (gpu, pid) NVML shows that no session is, looked at once: whose program started
        # it (0: none of them; said where one did), while NVML goes on showing it
        self.strangers: dict[tuple[int, int], int] = {}

    def used_by(self, gpu: int, pids: Collection[int]) -> int | None:
        """What NVML counts on GPU ``gpu`` for ``pids`` (:meth:`NvmlUtilization.memory_of`);
        None where the node has no NVML for it (a simulated GPU) or the driver fails."""
        sampler = self.nvml.get(gpu)
        if sampler is None:
            return None
        try:
            return sampler.memory_of(pids)
        except Exception as e:  # a flaky driver: nothing checked, the node goes on
            log.warning("GPU %d: NVML's per-process memory unreadable: %s", gpu, e)
            return None

    async def run(self, period: float = 1.0) -> None:
        last = self.clock.monotonic()
        while True:
            await asyncio.sleep(period)
            now = self.clock.monotonic()
            try:
                self.sample(now - last)
            except Exception:  # one bad sample is said; the next second samples again
                log.exception("sampling the GPUs failed; sampling goes on")
            last = now

    def sample(self, dt: float) -> None:
        for g, arb, att in zip(self.gpus, self.arbiters, self.utilization, strict=True):
            sampler = self.nvml.get(g.index)
            used: dict[int, int] = {}
            try:
                if sampler is None:  # the simulated GPU's model: busy while leased
                    ratio, procs = (1.0 if arb.holders else 0.0), None
                else:
                    measured = sampler.device()
                    ratio = (1.0 if arb.holders else 0.0) if measured is None else measured
                    procs = sampler.processes() if len(arb.holders) > 1 else None
                    used = sampler.memory()
            except Exception as e:  # a flaky driver must not stop the node
                log.warning("GPU %d: utilization sample failed: %s", g.index, e)
                continue
            pids = {sid: c.pid for sid, c in self.conns.items() if c.gpu == g.index}
            att.credit(ratio, dt, list(arb.holders), procs, pids)
            if sampler is not None:  # the GPU's own view of each session's memory
                allowance = self.allowance()
                for sid, pid in pids.items():
                    if pid in used and sid in arb.sessions:
                        # NVML may count less than the allowance (a process whose CUDA
                        # context is most of what it has): nothing over, not a negative
                        # figure, which the arbiter refuses (on an H200 it ended the
                        # sampling task for good)
                        over = max(0, used[pid] - allowance)
                        self.decisions.act(arb, arb.over_limit(sid, used=over))
                self.say_ungated(g.index, used)

    def say_ungated(self, gpu: int, used: Mapping[int, int]) -> None:
        """A process with memory on ``gpu`` that a session's program started (its chain of
        parents reaches a session's process) but that is neither a session nor a member:
        its GPU work runs ungated (a child started with a clean environment, ``python
        -I``, a fork of a member). Said once per process, in the log and as an
        ``ungated`` event: the node cannot gate it, but it does not leave it unsaid."""
        for key in [k for k in self.strangers if k[0] == gpu and k[1] not in used]:
            del self.strangers[key]  # gone from the GPU: forgotten (bounded by NVML's list)
        conns = list(self.conns.values())
        known = {c.pid for c in conns}
        root = self.proc_root()
        for pid, nbytes in used.items():
            if pid in known or (gpu, pid) in self.strangers:
                continue
            head = next(
                (c for c in conns if c.proc is not None and descends(pid, c.proc, root)), None
            )
            self.strangers[gpu, pid] = head.session if head is not None else 0
            if head is None:
                continue  # not started by a session's program: none of the node's business
            log.warning(
                "GPU %d: process %d, started by session %d's program (pid %d), uses %d bytes"
                " of GPU memory ungated: it is neither a session nor a member (started with"
                " a clean environment, python -I, or forked by a member?): keep"
                " GPUSHARE_FAMILY and PYTHONPATH in its environment, or attach it",
                gpu,
                pid,
                head.session,
                head.pid,
                nbytes,
            )
            ev = typed.Ungated(session=head.session, pid=pid, used_bytes=nbytes)
            self.publish(typed.record(ev, ts=self.clock.wall(), gpu=gpu))

"""GPU utilization, attributed to sessions through the lease.

NVML's device utilization is sampled once a second. In an exclusive period the whole
sample is credited to the one holder: the lease says who used the GPU. In a shared
period, NVML's per-process samples are used where the driver gives them (credited to the
session of each pid), and whatever is left is counted as *shared*, not guessed.

A simulated GPU's utilization follows a stated model: 1.0 while any session holds a
lease, 0.0 otherwise (a simulated workload computes during its lease).
"""

from __future__ import annotations

from typing import Any


class NvmlUtilization:
    """Device and per-process utilization through a module with pynvml's API."""

    def __init__(self, nvml: Any, index: int) -> None:
        self.nvml = nvml
        self.handle = nvml.nvmlDeviceGetHandleByIndex(index)
        self._last_ts = 0

    def device(self) -> float:
        return float(self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu) / 100.0

    def memory(self) -> dict[int, int]:
        """pid -> GPU memory bytes in use, as the driver counts them."""
        out: dict[int, int] = {}
        for proc in self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle):
            used = proc.usedGpuMemory
            if used is not None:  # None where the driver may not say (no permission)
                out[int(proc.pid)] = out.get(int(proc.pid), 0) + int(used)
        return out

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

"""Finding the GPUs: NVML where there is one, simulated GPUs otherwise or when asked."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from gpushare.units import format_size


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    uuid: str
    memory_bytes: int
    simulated: bool


def simulated_gpus(count: int, memory_bytes: int) -> list[GpuInfo]:
    return [
        GpuInfo(
            index=i,
            name=f"Simulated GPU ({format_size(memory_bytes)})",
            uuid=f"GPU-00000000-0000-0000-0000-5133{i:08d}",
            memory_bytes=memory_bytes,
            simulated=True,
        )
        for i in range(count)
    ]


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def nvml_gpus(nvml: Any) -> list[GpuInfo]:
    """The GPUs NVML sees, through a module with pynvml's API (``nvidia-ml-py``)."""
    nvml.nvmlInit()
    gpus = []
    for i in range(nvml.nvmlDeviceGetCount()):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        gpus.append(
            GpuInfo(
                index=i,
                name=_text(nvml.nvmlDeviceGetName(h)),
                uuid=_text(nvml.nvmlDeviceGetUUID(h)),
                memory_bytes=int(nvml.nvmlDeviceGetMemoryInfo(h).total),
                simulated=False,
            )
        )
    return gpus


def find_gpus(nvml_module: str = "pynvml") -> tuple[list[GpuInfo], str, Any]:
    """Real GPUs through NVML and the NVML module, or ``([], why_not, None)``."""
    try:
        nvml = importlib.import_module(nvml_module)
    except ImportError:
        return [], "NVML bindings are not installed (pip install 'gpushare[nvml]')", None
    try:
        gpus = nvml_gpus(nvml)
    except Exception as e:  # NVMLError and friends: no driver, no device
        return [], f"NVML found no GPU ({e})", None
    return gpus, "" if gpus else "NVML found no GPU", nvml if gpus else None

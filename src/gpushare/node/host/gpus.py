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
    # Where NVML finds it: the physical GPU's index and, for a MIG instance (which the
    # node counts as a GPU of its own, with its own memory), its index on that GPU.
    nvml_index: int = -1
    mig_index: int = -1


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


NVML_DEVICE_MIG_ENABLE = 1  # nvmlDeviceGetMigMode's current mode when MIG is on


def _mig_enabled(nvml: Any, h: Any) -> bool:
    try:
        current = nvml.nvmlDeviceGetMigMode(h)[0]
    except Exception:  # NVMLError_NotSupported: no MIG on this GPU (or old bindings)
        return False
    return bool(current == getattr(nvml, "NVML_DEVICE_MIG_ENABLE", NVML_DEVICE_MIG_ENABLE))


def nvml_gpus(nvml: Any) -> list[GpuInfo]:
    """The GPUs NVML sees, through a module with pynvml's API (``nvidia-ml-py``). A GPU
    in MIG mode is its MIG instances, each with its own memory and UUID (the whole GPU's
    memory is not there for a session on one instance); one with MIG on and no instance
    gives none."""
    nvml.nvmlInit()
    gpus: list[GpuInfo] = []
    for i in range(nvml.nvmlDeviceGetCount()):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        if not _mig_enabled(nvml, h):
            gpus.append(_info(nvml, h, len(gpus), i, -1))
            continue
        for m in range(nvml.nvmlDeviceGetMaxMigDeviceCount(h)):
            try:
                mh = nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, m)
            except Exception:  # NVMLError_NotFound: no instance in this slot
                continue
            gpus.append(_info(nvml, mh, len(gpus), i, m))
    return gpus


def _info(nvml: Any, h: Any, index: int, nvml_index: int, mig_index: int) -> GpuInfo:
    return GpuInfo(
        index=index,
        name=_text(nvml.nvmlDeviceGetName(h)),
        uuid=_text(nvml.nvmlDeviceGetUUID(h)),
        memory_bytes=int(nvml.nvmlDeviceGetMemoryInfo(h).total),
        simulated=False,
        nvml_index=nvml_index,
        mig_index=mig_index,
    )


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

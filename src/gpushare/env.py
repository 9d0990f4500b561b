"""What a workload's environment says: socket path, memory limit, KAI's GPU portion."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from gpushare.units import parse_size

DEFAULT_SOCKET = "/run/gpushare/gpushare.sock"
DEFAULT_ADMIN_SOCKET = "/run/gpushare/admin.sock"


@dataclass(frozen=True)
class WorkloadEnv:
    socket: str
    memory: int | None
    portion: float | None  # KAI's GPU_PORTION: the fraction of the GPU this pod was given
    gpu: int | None
    pod: str
    namespace: str
    container: str
    pod_uid: str


def read_env(environ: Mapping[str, str] | None = None) -> WorkloadEnv:
    e = os.environ if environ is None else environ
    memory = None
    if e.get("GPUSHARE_MEMORY"):
        try:
            memory = parse_size(e["GPUSHARE_MEMORY"])
        except ValueError as err:
            raise ValueError(f"GPUSHARE_MEMORY: {err}") from None
    portion = None
    if e.get("GPU_PORTION"):
        try:
            portion = float(e["GPU_PORTION"])
        except ValueError:
            portion = -1.0
        if not 0 < portion <= 1:
            raise ValueError(
                f"GPU_PORTION={e['GPU_PORTION']!r} is not a fraction in (0, 1]: fix the pod's"
                " gpu-fraction annotation"
            )
    gpu = None
    visible = e.get("NVIDIA_VISIBLE_DEVICES", "")
    if visible.isdigit():
        gpu = int(visible)
    return WorkloadEnv(
        socket=e.get("GPUSHARE_SOCKET") or DEFAULT_SOCKET,
        memory=memory,
        portion=portion,
        gpu=gpu,
        pod=e.get("POD_NAME", ""),
        namespace=e.get("POD_NAMESPACE", ""),
        container=e.get("CONTAINER_NAME", ""),
        pod_uid=e.get("POD_UID", ""),
    )

"""What a workload's environment says: socket, memory limit, GPU, pod identity, and what
KAI Scheduler gave the pod, so that a pod placed by KAI needs no other setting.

Read, in order of precedence for the memory limit: ``GPUSHARE_MEMORY``; KAI's
``gpu-memory`` annotation (MiB); KAI's fraction (``GPU_PORTION``, else the
``gpu-fraction`` annotation) of the GPU's memory, applied by the node. The fraction is
also the session's weight. ``NVIDIA_VISIBLE_DEVICES`` names the GPU by index or UUID.
Annotations come from a downward-API volume (``GPUSHARE_PODINFO``, default
``/etc/podinfo``, file ``annotations``). The environment and that folder are parameters,
so recorded pod environments can be tested.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpushare.units import format_size, parse_size

DEFAULT_SOCKET = "/run/gpushare/gpushare.sock"
DEFAULT_ADMIN_SOCKET = "/run/gpushare/admin.sock"
DEFAULT_PODINFO = "/etc/podinfo"
_ANNOTATION = re.compile(r'^([^=]+)="(.*)"$')


@dataclass(frozen=True)
class WorkloadEnv:
    socket: str
    memory: int | None
    portion: float | None  # the fraction of the GPU this pod was given (KAI)
    gpu: int | None
    gpu_uuid: str
    pod: str
    namespace: str
    container: str
    pod_uid: str
    memory_limit: int | None = None  # the most it may use, when more than its request
    portion_limit: float | None = None  # the limit as a fraction of the GPU (KAI)


def read_annotations(podinfo: str | Path) -> dict[str, str]:
    """A downward-API ``annotations`` file: ``key="value"`` lines, Go-quoted values."""
    try:
        text = (Path(podinfo) / "annotations").read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        m = _ANNOTATION.match(line.strip())
        if m:
            try:
                out[m.group(1)] = json.loads(f'"{m.group(2)}"')
            except json.JSONDecodeError:
                out[m.group(1)] = m.group(2)
    return out


def _fraction(value: str, source: str) -> float:
    try:
        f = float(value)
    except ValueError:
        f = -1.0
    if not 0 < f <= 1:
        raise ValueError(
            f"{source}={value!r} is not a fraction in (0, 1]: fix the pod's gpu-fraction annotation"
        )
    return f


def _size(e: Mapping[str, str], var: str) -> int | None:
    if not e.get(var):
        return None
    try:
        return parse_size(e[var])
    except ValueError as err:
        raise ValueError(f"{var}: {err}") from None


def read_env(
    environ: Mapping[str, str] | None = None, podinfo: str | Path | None = None
) -> WorkloadEnv:
    e = os.environ if environ is None else environ
    notes = read_annotations(podinfo or e.get("GPUSHARE_PODINFO") or DEFAULT_PODINFO)
    memory = _size(e, "GPUSHARE_MEMORY")
    if memory is None and notes.get("gpu-memory"):
        try:
            memory = int(notes["gpu-memory"]) * 2**20  # KAI writes MiB
        except ValueError:
            raise ValueError(
                f"gpu-memory annotation {notes['gpu-memory']!r} is not a number of MiB"
            ) from None
    limit = _size(e, "GPUSHARE_MEMORY_LIMIT")
    portion = None
    if e.get("GPU_PORTION"):
        portion = _fraction(e["GPU_PORTION"], "GPU_PORTION")
    elif notes.get("gpu-fraction"):
        portion = _fraction(notes["gpu-fraction"], "gpu-fraction annotation")
    gpu, uuid = None, ""
    first = e.get("NVIDIA_VISIBLE_DEVICES", "").split(",")[0].strip()
    if first.isdigit():
        gpu = int(first)
    elif first.startswith(("GPU-", "MIG-")):
        uuid = first
    return WorkloadEnv(
        socket=e.get("GPUSHARE_SOCKET") or DEFAULT_SOCKET,
        memory=memory,
        portion=portion,
        gpu=gpu,
        gpu_uuid=uuid,
        pod=e.get("POD_NAME", ""),
        namespace=e.get("POD_NAMESPACE", ""),
        container=e.get("CONTAINER_NAME", ""),
        pod_uid=e.get("POD_UID", ""),
        memory_limit=limit,
    )


def program_name(argv0: str, orig_argv: Sequence[str]) -> str:
    """A session's default name (the pid goes after it): the script's file name, the
    module of ``python -m``, ``python-c`` for ``python -c``. ``orig_argv`` is Python's
    own command line (``sys.orig_argv``): ``sys.argv[0]`` is ``-c``, or ``-m`` while
    the module is found and its file's path after."""
    args = list(orig_argv[1:])
    i = 0
    while i < len(args) and args[i].startswith("-") and args[i] not in ("-", "--"):
        flags, i = args[i][1:], i + 1
        for k, f in enumerate(flags):  # a cluster (-ic, -um mod) as Python reads it
            rest = flags[k + 1 :]
            if f == "c":
                return "python-c"
            if f == "m":
                mod = rest or (args[i] if i < len(args) else "")
                return mod or "python"
            if f in "WX":  # takes a value: the rest of the cluster, or the next word
                i += 0 if rest else 1
                break
    if argv0 in ("", "-", "-c", "-m"):
        return "python"
    return os.path.basename(argv0) or "python"


def rank_gpu(environ: Mapping[str, str] | None = None) -> int | None:
    """The GPU (the node's index) a rank of a distributed job works on: the launcher's
    ``LOCAL_RANK`` is its CUDA device, counted among ``CUDA_VISIBLE_DEVICES`` where set,
    and those among the container's ``NVIDIA_VISIBLE_DEVICES`` where they are indices.
    None where it is not a rank, or where a UUID in the way leaves it unknown."""
    e = os.environ if environ is None else environ
    local = e.get("LOCAL_RANK", "").strip()
    if not local.isdigit():
        return None
    index = int(local)
    for var in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"):
        value = e.get(var, "").strip()
        if not value or value in ("all", "none", "void"):
            continue
        ids = [x.strip() for x in value.split(",")]
        if index >= len(ids) or not ids[index].isdigit():
            return None
        index = int(ids[index])
    return index


def memory_figures(
    memory: str | int | None, memory_limit: str | int | None, env: WorkloadEnv
) -> tuple[int | None, int | None]:
    """The hello's (request, limit): each given, else from the environment; a limit
    alone is the limit (the request defaults to it at the node), a request alone is
    both. ValueError names the argument and the fix."""
    try:
        request = parse_size(memory) if memory is not None else env.memory
    except ValueError as e:
        raise ValueError(f"memory={memory!r}: {e}") from None
    try:
        limit = parse_size(memory_limit) if memory_limit is not None else env.memory_limit
    except ValueError as e:
        raise ValueError(f"memory_limit={memory_limit!r}: {e}") from None
    if limit is None:
        return None, request  # the request is the limit: one figure, as before
    if request is not None and limit < request:
        raise ValueError(
            f"memory limit {format_size(limit)} is below the memory request"
            f" {format_size(request)}: give a limit at least as large as the request"
        )
    return (request if request != limit else None), limit

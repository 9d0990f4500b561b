"""What a workload's environment says: socket, memory request and limit, GPU, pod
identity, and what KAI Scheduler gave the pod, so that a pod placed by KAI needs no other
setting.

The memory REQUEST (what the node guarantees and packs by), in order of precedence:
``GPUSHARE_MEMORY``; KAI's ``gpu-memory`` annotation (MiB); KAI's fraction
(``GPU_PORTION``, else the ``gpu-fraction`` annotation) of the GPU's memory, applied by
the node; else ``NVIDIA_GPU_MEMORY_REQUEST`` (MiB), or NvFractions'
``nvidia.com/container.<name>.gpu-memory.request`` (a Kubernetes quantity), or its limit
where only that is written (KAI schedules a limit-only pod by its limit). The fraction is
also the session's weight.

The memory LIMIT (what the workload is held to) is one figure, a size or a fraction:
``GPUSHARE_MEMORY_LIMIT``; ``GPU_MEMORY_LIMIT`` (bytes, or a size with its unit);
``NVIDIA_GPU_MEMORY_LIMIT`` (MiB: what KAI's NvFractions node runtime, fractiond,
injects, and the driver enforces); ``CUDA_DEVICE_MEMORY_LIMIT`` (what KAI's ``hamicore``
binder plugin writes for HAMi-core: ``<MiB>m``); the container's
``kai.scheduler/container.<name>.gpu-memory.portion.limit``, else the pod's
``gpu-fraction.limit`` (fractions); the container's
``nvidia.com/container.<name>.gpu-memory.limit``, else the pod's ``gpu-memory.limit``
(Kubernetes quantities). None: the limit is the request (the caller's rule).

``GPUSHARE_SHARING_MODE`` (what gpushare's DRA driver writes), KAI's
``kai.scheduler/gpu-compute-sharing-mode`` or NvFractions' per-container
``.gpu-compute.mode`` is the pod's compute-sharing mode (where more are set they agree).
``NVIDIA_VISIBLE_DEVICES`` names the GPU by index or UUID. Annotations come from a
downward-API volume (``GPUSHARE_PODINFO``, default ``/etc/podinfo``, file
``annotations``). The environment and that folder are parameters, so recorded pod
environments can be tested.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpushare.settings import SHARING_MODES as MODE_OF_SHARING
from gpushare.units import MAX_SIZE, format_size, is_fraction, parse_quantity, parse_size

DEFAULT_SOCKET = "/run/gpushare/gpushare.sock"
DEFAULT_ADMIN_SOCKET = "/run/gpushare/admin.sock"
DEFAULT_PODINFO = "/etc/podinfo"
_ANNOTATION = re.compile(r'^([^=]+)="(.*)"$')

# KAI Scheduler's names (kai-scheduler/KAI-Scheduler pkg/common/constants, and
# kai-scheduler/api constants/constants.go). Per-container keys are prefix + name + suffix.
SHARING_MODE_ANNOTATION = "kai.scheduler/gpu-compute-sharing-mode"
SHARING_MODES = tuple(MODE_OF_SHARING)  # (the node's map: settings.SHARING_MODES)
_NV = "nvidia.com/container."  # NvFractions: Kubernetes quantities
_KAI = "kai.scheduler/container."
_NV_REQUEST = ".gpu-memory.request"
_NV_LIMIT = ".gpu-memory.limit"
_NV_MODE = ".gpu-compute.mode"
_KAI_PORTION_LIMIT = ".gpu-memory.portion.limit"
_PER_CONTAINER = ((_NV, _NV_REQUEST), (_NV, _NV_LIMIT), (_NV, _NV_MODE), (_KAI, _KAI_PORTION_LIMIT))
# What KAI's node runtime for NvFractions (kai-gpu-fractioning's fractiond) injects into
# the container, in whole MiB; the driver holds the container to the limit.
# Its first versions wrote them plural (the toolkit's CDI hook reads the singular only).
_FRACTIOND_REQUEST = ("NVIDIA_GPU_MEMORY_REQUEST", "NVIDIA_GPU_MEMORY_REQUESTS")
_FRACTIOND_LIMIT = ("NVIDIA_GPU_MEMORY_LIMIT", "NVIDIA_GPU_MEMORY_LIMITS")
# HAMi-core's CUDA_DEVICE_MEMORY_LIMIT: bytes, or k/m/g, binary (KAI writes "<MiB>m").
_HAMI = re.compile(r"^([0-9]+)([kKmMgG]?)$")
_HAMI_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}


@dataclass(frozen=True)
class WorkloadEnv:
    socket: str
    memory: int | None  # the memory REQUEST, bytes
    portion: float | None  # the fraction of the GPU this pod was given (KAI): a request
    gpu: int | None
    gpu_uuid: str
    pod: str
    namespace: str
    container: str
    pod_uid: str
    # The memory LIMIT: at most one of the two is set (a size, or a fraction of the GPU);
    # neither: the limit is the request.
    memory_limit: int | None = None
    portion_limit: float | None = None
    sharing_mode: str = ""  # "", or one of SHARING_MODES
    claim: str = ""  # GPUSHARE_CLAIM: the DRA ResourceClaim's UID (its CDI env)


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


def _fraction(value: str, source: str, fix: str = "fix the pod's gpu-fraction annotation") -> float:
    try:
        f = float(value)
    except ValueError:
        f = -1.0
    if not is_fraction(f):
        raise ValueError(f"{source}={value!r} is not a fraction in (0, 1]: {fix}")
    return f


def _size(value: str, source: str) -> int:
    try:
        return parse_size(value)
    except ValueError as err:
        raise ValueError(f"{source}: {err}") from None


def _mib(value: str, source: str) -> int:
    n = int(value.strip()) if value.strip().isdigit() else 0
    if not 0 < n * 2**20 <= MAX_SIZE:
        raise ValueError(
            f"{source}={value!r} is not a whole number of MiB, as KAI's fractiond writes it:"
            " unset it, or write it like 4096"
        )
    return n * 2**20


def _kai_memory_limit(value: str) -> int:
    """``GPU_MEMORY_LIMIT``: KAI issue 1367 specifies bytes; a size with a unit is read
    too. A bare number under 1 MiB is refused: it was most likely meant as MiB (as KAI's
    withdrawn first version of the variable wrote it), and would hold the workload to
    nothing."""
    n = _size(value, "GPU_MEMORY_LIMIT")
    if value.strip().isdigit() and n < 2**20:
        raise ValueError(
            f"GPU_MEMORY_LIMIT={value!r} reads as {n} bytes: write it with its unit"
            f" (GPU_MEMORY_LIMIT={value.strip()}MiB)"
        )
    return n


def _hami_limit(value: str) -> int:
    m = _HAMI.match(value.strip())
    n = int(m.group(1)) * _HAMI_UNITS[m.group(2).lower()] if m else 0
    if not 0 < n <= MAX_SIZE:
        raise ValueError(
            f"CUDA_DEVICE_MEMORY_LIMIT={value!r} is not a size as HAMi-core reads it: write"
            " it like 20480m or 20g"
        )
    return n


def _container_notes(notes: Mapping[str, str], container: str) -> dict[str, tuple[str, str]]:
    """This container's per-container annotations: suffix -> (key, value). KAI allows
    one fractional container a pod; where CONTAINER_NAME is unset, the one container the
    annotations name is taken to be this one."""
    named: dict[str, dict[str, tuple[str, str]]] = {}
    for key, value in notes.items():
        for prefix, suffix in _PER_CONTAINER:
            if key.startswith(prefix) and key.endswith(suffix) and value:
                name = key[len(prefix) : -len(suffix)]
                if name:
                    named.setdefault(name, {})[suffix] = (key, value)
    if container:
        return named.get(container, {})
    if len(named) > 1:
        raise ValueError(
            f"the pod's annotations give GPU memory to containers {', '.join(sorted(named))}:"
            " set CONTAINER_NAME to this container's name"
        )
    return next(iter(named.values()), {})


def _sharing_mode(
    e: Mapping[str, str], notes: Mapping[str, str], mine: Mapping[str, tuple[str, str]]
) -> str:
    modes = {}
    if e.get("GPUSHARE_SHARING_MODE"):  # what gpushare's DRA driver writes (CDI env)
        modes["GPUSHARE_SHARING_MODE"] = e["GPUSHARE_SHARING_MODE"]
    if notes.get(SHARING_MODE_ANNOTATION):
        modes[SHARING_MODE_ANNOTATION] = notes[SHARING_MODE_ANNOTATION]
    if _NV_MODE in mine:
        modes[mine[_NV_MODE][0]] = mine[_NV_MODE][1]
    for key, value in modes.items():
        if value not in SHARING_MODES:
            where = key if key.startswith("GPUSHARE_") else f"annotation {key}"
            raise ValueError(
                f"{where}={value!r} is not a compute-sharing mode: write"
                f" {' or '.join(SHARING_MODES)}"
            )
    if len(set(modes.values())) > 1:
        (k1, v1), (k2, v2) = modes.items()
        raise ValueError(f"{k1}={v1!r} and {k2}={v2!r} differ: keep one")
    return next(iter(modes.values()), "")


def _nvfractions_request(
    e: Mapping[str, str], mine: Mapping[str, tuple[str, str]]
) -> tuple[int | None, str]:
    """NvFractions' own request, read only where no gpu-memory or fraction is given:
    beside a fraction KAI's binder writes it from the fraction, which stays the request.
    Only a limit written: KAI schedules by the limit."""
    for var in _FRACTIOND_REQUEST:
        if e.get(var):
            return _mib(e[var], var), var
    for suffix in (_NV_REQUEST, _NV_LIMIT):
        if suffix in mine:
            key, value = mine[suffix]
            return parse_quantity(value, f"annotation {key}"), f"annotation {key}"
    return None, ""


def _request(
    e: Mapping[str, str], notes: Mapping[str, str], mine: Mapping[str, tuple[str, str]]
) -> tuple[int | None, str, float | None]:
    """(size, where it was read, fraction): the memory request."""
    memory, request_from = None, ""
    if e.get("GPUSHARE_MEMORY"):
        memory, request_from = _size(e["GPUSHARE_MEMORY"], "GPUSHARE_MEMORY"), "GPUSHARE_MEMORY"
    elif notes.get("gpu-memory"):
        try:
            memory = int(notes["gpu-memory"]) * 2**20  # KAI writes MiB
        except ValueError:
            raise ValueError(
                f"gpu-memory annotation {notes['gpu-memory']!r} is not a number of MiB"
            ) from None
        request_from = "annotation gpu-memory"
    portion = None
    if e.get("GPU_PORTION"):
        portion = _fraction(e["GPU_PORTION"], "GPU_PORTION")
    elif notes.get("gpu-fraction"):
        portion = _fraction(notes["gpu-fraction"], "gpu-fraction annotation")
    if memory is None and portion is None:
        memory, request_from = _nvfractions_request(e, mine)
    return memory, request_from, portion


def read_env(
    environ: Mapping[str, str] | None = None, podinfo: str | Path | None = None
) -> WorkloadEnv:
    e = os.environ if environ is None else environ
    notes = read_annotations(podinfo or e.get("GPUSHARE_PODINFO") or DEFAULT_PODINFO)
    container = e.get("CONTAINER_NAME", "")
    mine = _container_notes(notes, container)
    memory, request_from, portion = _request(e, notes, mine)
    memory_limit, portion_limit, limit_from = _limit(e, notes, mine)
    _check(memory, request_from, portion, memory_limit, portion_limit, limit_from)
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
        container=container,
        pod_uid=e.get("POD_UID", ""),
        memory_limit=memory_limit,
        portion_limit=portion_limit,
        sharing_mode=_sharing_mode(e, notes, mine),
        claim=e.get("GPUSHARE_CLAIM", "").strip(),
    )


def _limit(
    e: Mapping[str, str], notes: Mapping[str, str], mine: Mapping[str, tuple[str, str]]
) -> tuple[int | None, float | None, str]:
    """(size, fraction, where it was read): the first source set, in precedence order."""
    if e.get("GPUSHARE_MEMORY_LIMIT"):
        return (
            _size(e["GPUSHARE_MEMORY_LIMIT"], "GPUSHARE_MEMORY_LIMIT"),
            None,
            "GPUSHARE_MEMORY_LIMIT",
        )
    if e.get("GPU_MEMORY_LIMIT"):
        return _kai_memory_limit(e["GPU_MEMORY_LIMIT"]), None, "GPU_MEMORY_LIMIT"
    for var in _FRACTIOND_LIMIT:
        if e.get(var):
            return _mib(e[var], var), None, var
    if e.get("CUDA_DEVICE_MEMORY_LIMIT"):
        return _hami_limit(e["CUDA_DEVICE_MEMORY_LIMIT"]), None, "CUDA_DEVICE_MEMORY_LIMIT"
    # A fraction first: where both are written, KAI's binder wrote the size from it.
    portion_keys = [mine[_KAI_PORTION_LIMIT]] if _KAI_PORTION_LIMIT in mine else []
    if notes.get("gpu-fraction.limit"):
        portion_keys.append(("gpu-fraction.limit", notes["gpu-fraction.limit"]))
    for key, value in portion_keys[:1]:
        fix = "write it like 0.8 (KAI admits up to 0.99999)"
        return None, _fraction(value, f"annotation {key}", fix), f"annotation {key}"
    if _NV_LIMIT in mine:
        key, value = mine[_NV_LIMIT]
        return parse_quantity(value, f"annotation {key}"), None, f"annotation {key}"
    if notes.get("gpu-memory.limit"):
        value = notes["gpu-memory.limit"]
        size = parse_quantity(value, "annotation gpu-memory.limit", unit_required=True)
        return size, None, "annotation gpu-memory.limit"
    return None, None, ""


def _check(
    memory: int | None,
    request_from: str,
    portion: float | None,
    memory_limit: int | None,
    portion_limit: float | None,
    limit_from: str,
) -> None:
    """The combinations KAI refuses, refused here in one line each. A size against a
    fraction is the node's to check: it knows the GPU's memory."""
    from_annotation = limit_from.startswith("annotation ")
    if portion_limit is not None and portion is None:
        raise ValueError(
            f"{limit_from} is a fraction of the GPU and needs a gpu-fraction request (KAI"
            " refuses it beside a size): add the gpu-fraction annotation, or write the"
            " limit as a size (gpu-memory.limit, or nvidia.com/container.<name>.gpu-memory.limit)"
        )
    if memory_limit is not None and from_annotation and memory is None:
        raise ValueError(
            f"{limit_from} is a size and needs a size request (KAI refuses it beside"
            " gpu-fraction): write the limit as kai.scheduler/container.<name>"
            ".gpu-memory.portion.limit, or request a size (gpu-memory)"
        )
    if memory_limit is not None and memory is not None and memory_limit < memory:
        raise ValueError(
            f"the memory limit {format_size(memory_limit)} ({limit_from}) is below the"
            f" request {format_size(memory)} ({request_from}): raise the limit or lower"
            " the request"
        )
    if portion_limit is not None and portion is not None and portion_limit < portion:
        raise ValueError(
            f"the memory limit {portion_limit:g} of the GPU ({limit_from}) is below the"
            f" request {portion:g} (GPU_PORTION or gpu-fraction): raise the limit or lower"
            " the request"
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
    alone is the limit (the request: none asked, None, which the node fills in with the
    limit), a request alone is both. A request is sent whenever one was asked, equal to
    the limit or not (issue 37: None means only "none asked"). ValueError names the
    argument and the fix."""
    try:
        request = parse_size(memory) if memory is not None else env.memory
    except ValueError as e:
        raise ValueError(f"memory={memory!r}: {e}") from None
    try:
        limit = parse_size(memory_limit) if memory_limit is not None else env.memory_limit
    except ValueError as e:
        raise ValueError(f"memory_limit={memory_limit!r}: {e}") from None
    if limit is None:
        return request, request  # the request is the limit (None, None: neither asked)
    if request is not None and limit < request:
        raise ValueError(
            f"memory limit {format_size(limit)} is below the memory request"
            f" {format_size(request)}: give a limit at least as large as the request"
        )
    return request, limit


def compute_limit_of(given: float | None, var: str | None) -> float | None:
    """The compute limit, checked here as the node checks it: one line naming the fix."""
    value: object = given if given is not None else var
    if value is None or value == "":
        return None
    where = "compute_limit" if given is not None else "GPUSHARE_COMPUTE_LIMIT"
    try:
        f = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        f = math.nan
    if not is_fraction(f):
        raise ValueError(
            f"{where}={value!r} is not a fraction of the GPU's time in (0, 1]: like 0.5"
        )
    return f

"""What a session brings when it attaches: one record, :class:`AttachRecord`, built once
by the node from the workload's hello and what the node knows of it
(node/serve/hello_figures.py), passed whole to :meth:`Arbiter.attach
<gpushare.core.arbiter.Arbiter.attach>`, and checked here (:func:`check`), each figure
bounded by what the node knows. A new per-session figure is a field and its check.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpushare.core.checks import MAX_COUNT, ArbiterError, FieldError, check_weight, count
from gpushare.settings import SHARING_MODES
from gpushare.units import format_size, is_fraction


@dataclass(frozen=True)
class AttachRecord:
    """A session's figures at attach. ``memory_request`` None: the limit (the one "none
    given"; the core's :class:`~gpushare.core.sessions.Memory` keeps 0 for "the
    limit")."""

    name: str
    memory_limit: int  # the most it may have resident (a member: the most it asks)
    memory_request: int | None = None  # what the node guarantees and packs by (mode auto)
    grows: bool = False  # its client asks (a release with a need) before passing a bound
    sharing: str = ""  # its pod's compute-sharing mode; "": the GPU's mode
    compute_limit: float | None = None  # the most of the GPU's time over a window (caps)
    workload: str = ""  # the node's key of the compute bucket (pod, else user and name)
    weight: float = 1.0
    # A workload that outlived a node restart: the memory it kept, and whether it was
    # mid-burst with lease ``lease`` (given back only when ``verified``: the node matched
    # it to its record and checked the lease's token).
    resident: int = 0
    swapped: int = 0
    discarded: int = 0
    holding: bool = False
    lease: int = 0
    verified: bool = False
    fills: bool = False  # it swaps in within a room: may overlap another's swap-out
    prefetch: bool = False  # it swaps in ahead of its grant when told
    gang: str = ""  # the node's key of the distributed job it is a rank of
    gang_size: int = 0  # ranks on this node, as its client says
    spans_nodes: bool = False  # ranks elsewhere too
    family: int = 0  # it is a process of this session's (core/families.py)
    joins_family: bool = False  # it joins now (not back after a restart)

    @property
    def resumed(self) -> bool:
        return bool(self.resident or self.swapped or self.discarded or self.holding)


@dataclass(frozen=True)
class Checked:
    """An attach's figures as the core keeps them."""

    limit: int
    request: int  # bytes; the limit where none was given
    weight: float
    compute_limit: float  # 1.0: none


def check(
    sid: int, rec: AttachRecord, *, attached: bool, used: int, capacity: int, gpu: int
) -> Checked:
    """Each figure bounded by what the node knows (``used`` of ``capacity`` bytes in use
    on GPU ``gpu``); :class:`FieldError` names the figure and the fix."""
    if attached:
        raise ArbiterError(f"session {sid} is already attached")
    limit = _positive_bytes("memory_limit", rec.memory_limit)
    if limit > capacity:
        raise FieldError(
            f"memory limit {format_size(limit)} is more than GPU {gpu}'s usable"
            f" {format_size(capacity)}: ask for {format_size(capacity)} or less"
        )
    weight = check_weight(rec.weight)
    _check_kept(rec, limit)
    if used + rec.resident > capacity:
        raise FieldError(
            f"resident: {rec.resident} bytes do not fit beside the {used} bytes"
            f" in use on GPU {gpu} ({capacity} usable)"
        )
    request = _check_request(rec.memory_request, limit)
    if rec.sharing and rec.sharing not in SHARING_MODES:
        raise FieldError(
            f"sharing must be one of {', '.join(SHARING_MODES)} (KAI's"
            f" gpu-compute-sharing-mode), not {rec.sharing!r}"
        )
    return Checked(limit, request, weight, _check_compute_limit(rec.compute_limit))


def _check_kept(rec: AttachRecord, limit: int) -> None:
    """What a workload back after a restart says it kept fits its limit."""
    count("resident", rec.resident, limit)
    count("swapped", rec.swapped, limit)
    count("discarded", rec.discarded, limit)
    if rec.resident + rec.swapped + rec.discarded > limit:
        raise FieldError(
            f"resident + swapped + discarded ({rec.resident} + {rec.swapped} +"
            f" {rec.discarded} bytes) exceed the memory limit of {limit} bytes"
        )
    count("lease", rec.lease, MAX_COUNT)


def _check_request(request: int | None, limit: int) -> int:
    """A memory request: bytes, at most the limit (checked after the limit)."""
    if request is None:
        return limit
    request = _positive_bytes("memory_request", request)
    if request > limit:
        raise FieldError(
            f"memory request {format_size(request)} is more than the memory limit"
            f" {format_size(limit)}: ask for a limit at least as large as the request"
        )
    return request


def _positive_bytes(what: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise FieldError(f"{what} must be a positive number of bytes, not {value!r}")
    return value


def _check_compute_limit(limit: float | None) -> float:
    if limit is None:
        return 1.0
    if not is_fraction(limit):
        raise FieldError(
            f"compute_limit must be a fraction of the GPU's time in (0, 1], not {limit!r}"
        )
    return float(limit)

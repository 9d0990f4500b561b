"""The events, typed: one record per kind of docs/contract.md's events table.

Every event is a JSON object with ``ts`` (Unix seconds), ``gpu`` (its index, ``None`` for
what concerns the node), ``event`` (the kind), ``session`` where one is concerned, and
its kind's fields (:func:`record` builds it). A field left ``None`` is not written: it is
one that appears only in some cases (``room_bytes`` only in an overlapped switch, the
flags ``continued``, ``turn``, ``resumed``, ``regroup`` and ``prefetch`` only when true).
tests/core/test_events.py holds these classes and the contract's table together.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar


@dataclass(kw_only=True, slots=True)
class Event:
    kind: ClassVar[str]
    session: int | None = None


_NAMES: dict[type[Event], tuple[str, ...]] = {}


def _names(kind: type[Event]) -> tuple[str, ...]:
    """A kind's field names but ``session``, found once (dataclasses.fields() is slow for
    a hot path: every decision emits events)."""
    names = _NAMES.get(kind)
    if names is None:
        names = _NAMES[kind] = tuple(f.name for f in fields(kind) if f.name != "session")
    return names


def record(ev: Event, *, ts: float, gpu: int | None) -> dict[str, Any]:
    rec: dict[str, Any] = {"ts": ts, "gpu": gpu, "event": ev.kind}
    if ev.session is not None:
        rec["session"] = ev.session
    for n in _names(type(ev)):
        v = getattr(ev, n)
        if v is not None:
            rec[n] = v
    return rec


@dataclass(kw_only=True, slots=True)
class Attach(Event):
    kind: ClassVar[str] = "attach"
    name: str
    limit_bytes: int
    weight: float
    resumed: bool
    request_bytes: int | None = None  # its memory request: always given (issue 37)
    resident_bytes: int
    swapped_bytes: int
    gang: str | None = None  # a rank of a distributed job: its gang, and as its client says
    gang_size: int | None = None
    spans_nodes: bool | None = None
    family: int | None = None  # a process of this session's, its memory out of that one's


@dataclass(kw_only=True, slots=True)
class Detach(Event):
    kind: ClassVar[str] = "detach"
    reason: str
    freed_bytes: int


@dataclass(kw_only=True, slots=True)
class Grant(Event):
    kind: ClassVar[str] = "grant"
    lease: int
    wait_seconds: float
    swap_in_bytes: int
    quantum_s: float
    shared: bool
    room_bytes: int | None = None
    bound_bytes: int | None = None  # the most it may have without asking (its limit: none lent)
    continued: bool | None = None
    turn: bool | None = None
    resumed: bool | None = None
    gang: str | None = None
    regroup: bool | None = None


@dataclass(kw_only=True, slots=True)
class Revoke(Event):
    kind: ClassVar[str] = "revoke"
    lease: int
    reason: str
    swap_out_bytes: int
    gang: str | None = None


@dataclass(kw_only=True, slots=True)
class Release(Event):
    kind: ClassVar[str] = "release"
    lease: int
    seconds: float
    reason: str
    anticipate_s: float | None = None


@dataclass(kw_only=True, slots=True)
class SwapOut(Event):
    kind: ClassVar[str] = "swap_out"
    bytes: int
    seconds: float
    error: str | None = None
    prefetch: bool | None = None
    discarded_bytes: int | None = None  # a swap-out: discardable bytes dropped, not moved


@dataclass(kw_only=True, slots=True)
class SwapIn(SwapOut):
    kind: ClassVar[str] = "swap_in"


@dataclass(kw_only=True, slots=True)
class Prefetch(Event):
    kind: ClassVar[str] = "prefetch"
    room_bytes: int
    bytes: int


@dataclass(kw_only=True, slots=True)
class Config(Event):
    """The settings a live change set (only those)."""

    kind: ClassVar[str] = "config"
    tq_s: float | None = None
    mode: str | None = None
    policy: str | None = None
    escalation: str | None = None
    overlap: bool | None = None
    prefetch: bool | None = None
    anticipate_s: float | None = None
    turn_s: float | None = None
    turn_share: float | None = None


@dataclass(kw_only=True, slots=True)
class Escalate(Event):
    kind: ClassVar[str] = "escalate"
    reason: str
    action: str
    grace_s: float | None = None
    gang: str | None = None
    pending_bytes: int | None = None
    resident_bytes: int | None = None
    used_bytes: int | None = None
    limit_bytes: int | None = None


@dataclass(kw_only=True, slots=True)
class ConfigRefused(Event):
    kind: ClassVar[str] = "config_refused"
    source: str
    reason: str


@dataclass(kw_only=True, slots=True)
class Refused(Event):
    kind: ClassVar[str] = "refused"
    pid: int
    uid: int
    socket: str
    code: str
    reason: str
    not_logged: int | None = None


@dataclass(kw_only=True, slots=True)
class Recovery(Event):
    kind: ClassVar[str] = "recovery"
    phase: str
    expected: int | None = None
    window_s: float | None = None
    returned: int | None = None
    missing: int | None = None
    seconds: float | None = None
    reason: str | None = None


@dataclass(kw_only=True, slots=True)
class Reclaim(Event):
    """A holder gives back memory lent above its request (a revoke follows, reason
    ``reclaim``): ``waiting_session`` did not fit beside it."""

    kind: ClassVar[str] = "reclaim"
    lent_bytes: int
    request_bytes: int
    resident_bytes: int
    waiting_session: int


@dataclass(kw_only=True, slots=True)
class Ungated(Event):
    """A process the GPU shows (NVML) with memory on it, started by ``session``'s program,
    that is neither that session nor a member of it: its GPU work runs ungated."""

    kind: ClassVar[str] = "ungated"
    pid: int
    used_bytes: int


KINDS: tuple[type[Event], ...] = (
    Attach,
    Detach,
    Grant,
    Revoke,
    Release,
    SwapOut,
    SwapIn,
    Prefetch,
    Config,
    ConfigRefused,
    Escalate,
    Refused,
    Recovery,
    Reclaim,
    Ungated,
)

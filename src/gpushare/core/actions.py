"""What the arbiter decides: each input returns a list of these actions.

The node turns them into messages to workloads, signals and log lines (its dispatch
module is the one place they leave); the tests and the model read them directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpushare.core.clock import Clock
from gpushare.core.events import Event, record
from gpushare.settings import Escalation


@dataclass(frozen=True)
class GrantAction:
    session: int
    lease: int
    swap_in: int
    quantum_s: float
    shared: bool
    thaw: bool = False  # the process was frozen: continue it before telling it
    room: int = 0  # swap in only up to this many resident bytes until a RoomAction
    resume: bool = False  # the lease the session claimed after a node restart, given back
    bound: int = 0  # the most it may have without asking again (0: its limit)
    idle_release_s: float = 0.0  # its implicit bursts end this long after (0: the node's)


@dataclass(frozen=True)
class RoomAction:
    """A filling holder may now have ``room`` bytes on the GPU (its bound: no bound but that)."""

    session: int
    room: int


@dataclass(frozen=True)
class PrefetchAction:
    """The next holder may swap in now, before its grant, up to ``room`` resident bytes
    (no GPU work: the lease is another's). ``seq`` numbers the asks: its client says
    which one it is done with."""

    session: int
    room: int
    seq: int


@dataclass(frozen=True)
class RevokeAction:
    session: int
    lease: int
    swap_out: int
    grace_s: float


@dataclass(frozen=True)
class SwapOutAction:
    session: int
    bytes: int


@dataclass(frozen=True)
class EscalateAction:
    session: int
    escalation: Escalation
    reason: str


@dataclass(frozen=True)
class ThawAction:
    """A session frozen outside the queue (it ignored a swap-out) is continued."""

    session: int


@dataclass(frozen=True)
class LimitsAction:
    """A session's memory limit and request changed: a process of its family joined or
    left (core/families.py); its client is told, and holds itself to them."""

    session: int
    memory_limit: int
    memory_request: int  # bytes, filled in (its limit where it asked none)


@dataclass(frozen=True)
class EventAction:
    record: dict[str, Any] = field(hash=False)


Action = (
    GrantAction
    | RevokeAction
    | RoomAction
    | PrefetchAction
    | SwapOutAction
    | EscalateAction
    | ThawAction
    | LimitsAction
    | EventAction
)


class Outbox:
    """Where one input's decisions gather until the arbiter hands them back."""

    def __init__(self, gpu: int, clock: Clock) -> None:
        self.gpu, self.clock = gpu, clock
        self._actions: list[Action] = []

    def act(self, action: Action) -> None:
        self._actions.append(action)

    def emit(self, ev: Event) -> None:
        self._actions.append(EventAction(record(ev, ts=self.clock.wall(), gpu=self.gpu)))

    def take(self) -> list[Action]:
        out, self._actions = self._actions, []
        return out

"""Counted memory: what the GPU must be able to hold now, kept as running totals.

Every session counts at :attr:`SessionState.used` (a holder at its limit, anyone else at
what it has: core/planner.py's rule). The ledger keeps their sum and the attached
sessions' weights as running totals, so a decision costs the same with 2 sessions or
1,000; :meth:`Ledger.recount` is the one place the sum changes, called after anything
``used`` reads changed. It also draws the planner's picture of the sessions
(:func:`view`) and checks what a session says it has against what fits.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from gpushare.core.checks import FieldError, check_split
from gpushare.core.planner import MemoryView
from gpushare.core.sessions import SessionState


class Ledger:
    def __init__(self, gpu: int, capacity: int) -> None:
        self.gpu = gpu
        self.capacity = capacity
        self.used = 0  # the sum of every session's counted memory
        self._weights: Counter[float] = Counter()  # the attached sessions' weights
        self._top_weight = 0.0  # max(self._weights), 0 when it must be found again

    def recount(self, s: SessionState, gone: bool = False) -> None:
        """After anything ``SessionState.used`` reads changed (state, room, swapping_in,
        memory, window, gang held), and when a session goes."""
        now = 0 if gone else s.used
        self.used += now - s.memory.counted
        s.memory.counted = now

    def weigh(self, weight: float, k: int) -> None:
        """A session of ``weight`` came (k=1) or went (k=-1)."""
        self._weights[weight] += k
        if not self._weights[weight]:
            del self._weights[weight]
            if weight == self._top_weight:
                self._top_weight = 0.0  # found again when next needed
        elif k > 0 and self._top_weight:
            self._top_weight = max(self._top_weight, weight)

    def largest_weight(self) -> float:
        if not self._top_weight:
            self._top_weight = max(self._weights)
        return self._top_weight

    def check_figures(self, s: SessionState, what: str, resident: int, swapped: int) -> None:
        """A session's memory as it says it: bytes, together within its limit, and for a
        session without a lease (which cannot allocate) no more than the GPU has room for."""
        check_split(what, resident, swapped, s.memory.limit)
        if not s.holding and resident > s.used:
            others = self.used - s.used
            if others + resident > self.capacity:
                raise FieldError(
                    f"{what}: resident {resident} bytes do not fit beside the {others} bytes"
                    f" in use on GPU {self.gpu} ({self.capacity} usable) without a lease"
                )

    def verify(self, sessions: Iterable[SessionState]) -> list[str]:
        """What differs between the running totals and a scan (O(sessions))."""
        wrong = []
        scan, weights = 0, Counter[float]()
        for s in sessions:
            if s.memory.counted != s.used:
                wrong.append(f"session {s.id} counted {s.memory.counted}, uses {s.used}")
            scan += s.used
            weights[s.weight] += 1
        if self.used != scan:
            wrong.append(f"used bytes: running total {self.used}, scan {scan}")
        if self._weights != weights:
            wrong.append(f"weights {dict(self._weights)}, scan {dict(weights)}")
        top = max(weights, default=0.0)
        if self._top_weight not in (0.0, top):
            wrong.append(f"largest weight {self._top_weight}, scan {top}")
        return wrong


def bound_for(s: SessionState, mode: str) -> int:
    """What a grant lets ``s`` have without asking again: its limit, except in mode auto
    for a client that asks before it grows (``grows``) and is no rank of a gang: the
    most of its request, what it has (resident and swapped) and what it last asked for,
    up to its limit. So a session packed by its request holds at its request until it
    asks for more (docs/scheduling.md, "Memory request and limit")."""
    m = s.memory
    if s.mode_of(mode) != "auto" or not m.grows or s.rank.gang:
        return m.limit
    return min(m.limit, max(m.guaranteed, m.resident + m.swapped + m.discarded, m.need))


def view(s: SessionState, now: float, mode: str) -> MemoryView:
    """``s`` as the planner sees it: a holder (a quantum waiting for it) at its bound, a
    rank whose gang holds at its limit, never victims; anyone else sized at what a grant
    would let it have (:func:`bound_for`); pinned where it cannot be asked now."""
    pinned = s.esc.frozen or s.esc.swap_failed_until > now or s.prefetch.active
    m = s.memory
    resident = m.resident if s.holding else s.used
    holding = s.holding or s.share.window or s.rank.held
    size = m.limit if s.rank.held and not s.holding else (m.held if holding else bound_for(s, mode))
    return MemoryView(
        s.id,
        size,
        resident,
        holding,
        s.lease.last_served,
        m.pending_out,
        pinned,
        s.expected_back(now),
        m.guaranteed,
    )


def released(s: SessionState) -> MemoryView:
    """Holder ``s`` as if it had released: at what it has, a possible victim."""
    m = s.memory
    # Rotated by its quantum: every byte of it may go for the next holder.
    return MemoryView(s.id, m.held, m.resident, False, s.lease.last_served, m.pending_out)


def at_limit(s: SessionState) -> MemoryView:
    """``s`` at its limit, not a victim (a rank whose gang a grant makes hold)."""
    m = s.memory
    return MemoryView(s.id, m.limit, m.limit, True, s.lease.last_served, m.pending_out)

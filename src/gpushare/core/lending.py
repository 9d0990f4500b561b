"""Memory lent above a request, and how it is given back (docs/scheduling.md 6).

A session is packed by its request and may use up to its limit. A holder counts at its
bound (core/ledger.py's :func:`~gpushare.core.ledger.bound_for`); a grant made at once
into memory that was free lends what that bound holds above the request (core/leases.py
marks the holder ``lent``). This module is how those bytes come back:

* :func:`reclaim_for`: the queue's head waits for memory while the requests fit (mode
  auto): holders that were lent memory give it back at their next safe point (a revoke,
  reason ``reclaim``, after a ``reclaim`` event), the most lent first, only as many as
  the head needs; a holder that won its memory by the quanta's rotation was lent
  nothing and keeps its quantum. The planner then asks for the bytes above requests
  before any within one (core/planner.py ``take_from``);
* :func:`past_bound`: a holder that has more than its grant lent it, without asking
  (not the protocol), has its bound grow to that where it fits; else it gives the GPU
  back at its next safe point (a revoke, reason ``over_memory_bound``);
* :func:`returned`: a lease's end ends what it was lent.

Nothing here ends or escalates a session for memory within its limit: only not
yielding when revoked is, as for any revoke (core/escalation.py).
"""

from __future__ import annotations

from collections.abc import Callable

from gpushare.core.events import Reclaim
from gpushare.core.ledger import bound_for
from gpushare.core.sessions import Memory, SessionState, State
from gpushare.core.state import GpuState

# How a lease is taken back (core/leases.py's Leases.revoke): the holder, now, the reason.
Revoke = Callable[[SessionState, float, str], None]


def reclaim_for(st: GpuState, head: SessionState, revoke: Revoke) -> None:
    """``head`` waits for memory while the requests fit: the holders whose memory above
    their request was lent from what was free give it back (each its event, then its
    revoke), the most lent first, until the holders left fit beside the head."""
    lent = [
        h
        for h in map(st.sessions.__getitem__, st.holders)
        if h.memory.lent and h.state is State.HOLDING
    ]
    if not lent or head.mode_of(st.settings.mode) != "auto":
        return
    over = st.used_bytes() - head.used + bound_for(head, st.settings.mode) - st.capacity
    for h in sorted(lent, key=lambda h: (h.memory.guaranteed - h.memory.held, h.id)):
        if over <= 0:
            break
        m = h.memory
        back = m.held - m.guaranteed
        over -= back
        m.lent = False
        m.reclaims += 1
        m.reclaimed += back
        st.out.emit(
            Reclaim(
                session=h.id,
                lent_bytes=back,
                request_bytes=m.guaranteed,
                resident_bytes=m.resident,
                waiting_session=head.id,
            )
        )
        revoke(h, st.now(), "reclaim")


def past_bound(st: GpuState, s: SessionState, resident: int, revoke: Revoke) -> None:
    """``s`` reports ``resident`` bytes (within its limit, checked). A holder with more
    than its grant lent, not asked for: its bound grows to what it has where that fits
    (as an ask would have been answered); else it is revoked, once per stretch, and
    counted at its bound meanwhile (what it was lent)."""
    m = s.memory
    if not (s.holding and m.bound and resident > m.held):
        m.over_bound = False
        return
    if st.used_bytes() - s.used + resident <= st.capacity:
        m.bound = resident if resident < m.limit else 0
        st.ledger.recount(s)
    elif not m.over_bound:
        m.over_bound = True
        if s.state is State.HOLDING:
            revoke(s, st.now(), "over_memory_bound")


def returned(m: Memory) -> None:
    """The lease ended: nothing is lent to it until its next grant."""
    m.lent = False

"""Prefetch (docs/scheduling.md 2): the next session swaps in during the quantum.

While the GPU is held, the head of the queue brings back (without the lease, so without
GPU work) what fits beside everyone's count, holders at their limits, in steps of at
least :data:`PREFETCH_STEP` as memory frees; for the rest, idle sessions not expected
back soon and waiting sessions further back (furthest first) are asked to swap out,
only as much as needed. At its grant the head has most of its memory back already.
"""

from __future__ import annotations

from gpushare.core import growth
from gpushare.core.actions import PrefetchAction
from gpushare.core.events import Prefetch
from gpushare.core.ledger import view
from gpushare.core.planner import take_from
from gpushare.core.sessions import SessionState, State
from gpushare.core.state import GpuState

PREFETCH_STEP = 2**30  # a prefetch asks for at least this much (or all that is left)


def plan_prefetch(st: GpuState, now: float, *, taken: bool) -> None:
    """The prefetch (and the swap-outs that make room for it) while the GPU is ``taken``
    (held, or its quantum waits for its holder)."""
    if not (st.settings.prefetch and st.queue) or not taken:
        return
    h = st.sessions[st.queue[0]]
    if not _may_prefetch(h, now):
        return
    m, p = h.memory, h.prefetch
    want = m.resident + m.swapped
    have = max(m.resident, p.room) if p.active else m.resident
    more = min(st.capacity - st.used_bytes(), want - have)
    if more > 0 and (more >= PREFETCH_STEP or have + more == want):
        have += more
        p.room = have
        p.seq += 1
        st.ledger.recount(h)
        st.out.emit(Prefetch(session=h.id, room_bytes=have, bytes=have - m.resident))
        st.out.act(PrefetchAction(h.id, have, p.seq))
    need = want - have - sum(v.memory.pending_out for v in st.sessions.values() if v is not h)
    if need > 0:
        _make_room(st, h, now, need)


def _may_prefetch(h: SessionState, now: float) -> bool:
    """The head swaps in ahead: its client does, it has memory out, and nothing it is
    doing or has just failed stands in the way."""
    m = h.memory
    if not h.prefetch.enabled or not m.swapped or h.esc.frozen:
        return False
    return not (m.pending_out or m.swapping_in or h.esc.swap_failed_until > now)


def _make_room(st: GpuState, h: SessionState, now: float, need: int) -> None:
    """Swap-outs for the rest: idle sessions not expected back soon, then the waiting
    ones behind the head, furthest first, only as much as needed."""
    idle = sorted(
        (v for v in st.sessions.values() if v.state is State.IDLE and not v.share.window),
        key=lambda v: (v.expected_back(now), v.lease.last_served, v.id),
    )
    mode = st.settings.mode
    victims = [view(v, now, mode) for v in idle if not v.expected_back(now)]
    victims += [view(st.sessions[q], now, mode) for q in reversed(st.queue) if q != h.id]
    victims = growth.shield(victims, h, st.sessions, now, mode)[0]  # a grower's: by the rule
    for sid, n in take_from(victims, need)[0]:
        st.ask_swap_out(sid, n)

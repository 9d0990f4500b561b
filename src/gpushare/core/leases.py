"""Leases: a grant, a revoke, the queue a session joins, the freeze that stops a holder.

What a grant sets (the lease's number, its quantum by kind: the rest of one continued
within its window, a turn, the rest of one a turn paused, or a plain quantum with its
debt or credit; a gang's rank gets what is left of its gang's), what a revoke asks
(the holder's own swap-out with its answer, the others' at once, so that the next
holder's memory moves while this one winds down), and a filling holder's room growing
into what swap-outs free. Who is granted, and when, is the arbiter's and admission's
(core/arbiter.py, core/admission.py).
"""

from __future__ import annotations

import math
from typing import Any

from gpushare.core import caps, growth
from gpushare.core.actions import GrantAction, RevokeAction, RoomAction
from gpushare.core.claims import Claims
from gpushare.core.escalation import Escalation
from gpushare.core.events import Grant, Release, Revoke
from gpushare.core.gangs import Gangs
from gpushare.core.ledger import bound_for, released
from gpushare.core.planner import MemoryView, plan_grant
from gpushare.core.sessions import SessionState, State
from gpushare.core.shares import Shares
from gpushare.core.state import GpuState
from gpushare.core.turns import SERVER_IDLE_S, Turns

# A quantum is GPU time: it starts when the swap-in is done. A swap-in slower than this
# (bytes/s) is taken for stuck, so the quantum starts anyway and a revoke can follow.
SWAP_FLOOR_BPS = 1e9
# A grant this soon after its ask moved nothing for it: what its bound holds above its
# request was free, lent, and is given back on demand (core/admission.py's reclaim).
LENT_WITHIN_S = 1e-3


class Leases:
    def __init__(
        self,
        st: GpuState,
        shares: Shares,
        turns: Turns,
        gangs: Gangs,
        claims: Claims,
        escalation: Escalation,
        lease_base: int = 0,
    ) -> None:
        self.st, self.shares, self.turns, self.gangs = st, shares, turns, gangs
        self.claims, self.escalation = claims, escalation
        self.last_lease = lease_base  # leases are numbered on from the last node's
        self.grants_total = 0  # on this GPU since the node started, sessions gone included

    def freeze(self, s: SessionState, now: float) -> None:
        """The freeze escalation: the process is stopped; its lease goes to the next, and
        it waits for its turn (its memory stays where it is: a stopped process cannot
        swap)."""
        st = self.st
        caps.settle(s, now)
        s.totals.lease_s += now - s.lease.start
        st.holders.remove(s.id)
        held = now - s.lease.start
        st.out.emit(Release(session=s.id, lease=s.lease.number, seconds=held, reason="frozen"))
        s.lease.number = 0
        s.esc.frozen = True
        s.esc.escalated = False
        s.memory.pending_out = 0
        st.deadlines.set_swap_out(s, math.inf)
        s.memory.room = 0
        s.share.turn, s.share.resume_s = False, 0.0
        self.enqueue(s)

    def grant(
        self, s: SessionState, room: int = 0, resume: bool = False, lent: bool = False
    ) -> None:
        """``lent``: it fits beside the others as things are; granted at once after its
        ask (:data:`LENT_WITHIN_S`), what its bound holds above its request is lent from
        free memory and given back on demand (core/admission.py's reclaim)."""
        st = self.st
        now = self.st.now()
        if st.queue[0] == s.id:
            st.queue.popleft()
        else:  # a gang member joining its gang's lease, ahead of the queue
            st.queue.remove(s.id)
        caps.settle(s, now)  # (before it holds: the wait filled its bucket)
        growth.granted(s, now)  # (a turn inside its quantum: that quantum's end stays)
        regroup, s.rank.parked = s.rank.parked, False
        waited = st.end_wait(s, now)
        self.shares.collect_credit(s)
        self.turns.granted(s)
        shared = bool(st.holders)
        self.last_lease += 1
        ls = s.lease
        ls.number = self.last_lease
        s.state = State.HOLDING
        s.totals.grants += 1
        self.grants_total += 1
        ls.start = now
        q, kind = self._quantum_of_grant(s, now)
        if s.share.cap:  # its compute limit: no longer than its bucket lasts
            q = caps.capped_quantum(s, q, now)
        g = self.gangs.of(s)
        if g is not None:  # the gang's quantum is its first holder's: no more than what is left
            self.gangs.hold(g, True)
            left = self.gangs.quantum_left(g, s, now)
            if left is not None:
                q = min(q, left)
            kind["gang"] = g.key
            if regroup:  # parked, its peers still holding: on to its next safe point
                kind["regroup"] = True
        m = s.memory
        bound = bound_for(s, st.settings.mode)
        m.bound = bound if bound < m.limit else 0
        m.need = 0  # answered: a later grant lends what it has then (its burst freed or not)
        m.lent = lent and waited < LENT_WITHIN_S and m.held > m.guaranteed
        ls.quantum_len = q
        m.room = room
        m.swapping_in = bool(m.swapped or m.discarded)
        ls.gpu_since = math.inf if m.swapping_in or room else now
        # A prefetch in flight is moot: the holder counts at its limit (or its room).
        s.prefetch.moot()
        # The quantum starts when the swap-in is done (swap_done); a filling holder's
        # bound waits for its room too.
        ls.quantum_end = math.inf if room else self._quantum_end(s)
        ls.last_served = now
        st.holders.append(s.id)
        thaw, s.esc.frozen = s.esc.frozen, False
        s.esc.escalated = False
        st.deadlines.set_swap_out(s, math.inf)  # a holder's memory is not asked for
        s.esc.swap_escalated = False
        self.claims.clear(s)
        self.escalation.thaw_idle()
        st.ledger.recount(s)
        st.out.emit(
            Grant(
                session=s.id,
                lease=ls.number,
                wait_seconds=waited,
                swap_in_bytes=m.swapped,
                quantum_s=q,
                shared=shared,
                room_bytes=room or None,
                bound_bytes=m.held,  # always given (issue 37): its bound, else its limit
                **kind,
            )
        )
        idle = SERVER_IDLE_S if self.turns.requests(s) else 0.0  # a server's: soon after
        ls.idle_release = idle or st.settings.anticipate_s
        st.out.act(
            GrantAction(s.id, ls.number, m.swapped, q, shared, thaw, room, resume, m.bound, idle)
        )
        # Its gang is on its way out: it goes on to its next safe point only.
        if g is not None and self.gangs.yielding(g):
            self.revoke(s, now, g.reason or "quantum")

    def _quantum_of_grant(self, s: SessionState, now: float) -> tuple[float, dict[str, Any]]:
        """This grant's quantum, and what kind of grant it is (the event's flags)."""
        sh = s.share
        if sh.continued:  # asked again within its window: what is left of its quantum
            sh.continued = False
            s.totals.continues += 1
            return max(0.0, s.lease.quantum_end - now), {"continued": True}
        if sh.turn:
            return self.turns.length(s), {"turn": True}
        if sh.resume_s:  # paused by a turn: the rest of it
            q, sh.resume_s = sh.resume_s, 0.0
            return q, {"resumed": True}
        return self.shares.next_quantum(s), {}

    def _quantum_end(self, s: SessionState) -> float:
        """A quantum from now, after the swap-in at no less than the floor rate."""
        return self.st.now() + s.lease.quantum_len + s.memory.swapped / SWAP_FLOOR_BPS

    def fill_rooms(self) -> None:
        """Grow each filling holder's room into what swap-outs have freed, and ask for
        more swap-outs where those under way will not do (one failed, say)."""
        st = self.st
        for sid in st.holders:
            s = st.sessions[sid]
            m = s.memory
            if not m.room:
                continue
            free = self.st.capacity - (self.st.used_bytes() - m.room)
            if free >= m.held:
                m.room = 0
                st.ledger.recount(s)
                st.out.act(RoomAction(s.id, m.held))
                if math.isinf(s.lease.quantum_end):  # bounded again, even if it never reports
                    s.lease.quantum_end = self._quantum_end(s)
                continue
            if free > m.room:
                m.room = free
                st.ledger.recount(s)
                st.out.act(RoomAction(s.id, free))
            views = self._shielded(self._views_released(s), s)
            for vid, n in plan_grant(self.st.capacity, views, s.id).swap_outs:
                st.ask_swap_out(vid, n)

    def revoke(self, s: SessionState, now: float, reason: str = "quantum") -> None:
        st = self.st
        g = self.gangs.of(s)
        if g is not None:
            self.gangs.revoke(g, now, reason)
            return
        s.state = State.YIELDING
        s.lease.revoke_deadline = now + self.st.settings.grace_s
        s.lease.revoked_at = now
        s.totals.revokes += 1
        # Plan the next grant as if this holder had already yielded, so that its swap-out
        # and everyone else's start now, in parallel with its wind-down.
        swap_out = 0
        asks: list[tuple[int, int]] = []  # what the planner would say, without it
        # (nobody waits: a compute limit's revoke; the memory stays)
        if st.queue and not self._fits_after_release(s, st.sessions[st.queue[0]]):
            head = st.sessions[st.queue[0]]
            views = self._shielded(self._views_released(s), head)
            asks = plan_grant(self.st.capacity, views, head.id).swap_outs
        if self.st.settings.mode == "exclusive" or len(st.holders) == 1:
            for sid, n in asks:
                if sid == s.id:  # its own share goes with its answer to the revoke
                    s.memory.pending_out += n
                    swap_out = n
                else:
                    st.ask_swap_out(sid, n)
        lease = s.lease.number
        st.out.emit(Revoke(session=s.id, lease=lease, reason=reason, swap_out_bytes=swap_out))
        st.out.act(RevokeAction(s.id, lease, swap_out, self.st.settings.grace_s))

    def _fits_after_release(self, s: SessionState, head: SessionState) -> bool:
        """Would the planner find that ``head`` fits with holder ``s`` counted as if
        released (:meth:`_views_released`)? Its sum without scanning: holders count at
        their bounds there (rooms here), ``s`` at what it has."""
        st = self.st
        planned = st.used_bytes() - head.used - s.used + s.memory.resident
        planned += bound_for(head, st.settings.mode)
        for h in self.st.holders:
            if h != s.id:
                v = self.st.sessions[h]
                planned += v.memory.held - v.used
        return planned <= self.st.capacity

    def _views_released(self, s: SessionState) -> list[MemoryView]:
        """The planner's view with holder ``s`` counted as if it had released: at what
        it has, and a possible victim (the revoked holder; a filling one, for itself)."""
        views = self.gangs.views(s, 0)
        return [released(s) if v.id == s.id else v for v in views]

    def _shielded(self, views: list[MemoryView], head: SessionState) -> list[MemoryView]:
        """A plan on grower ``head``'s behalf asks no neighbour inside its quantum."""
        st = self.st
        return growth.shield(views, head, st.sessions, st.now(), st.settings.mode)[0]

    def enqueue(self, s: SessionState, front: bool = False) -> None:
        """Join the queue: at its back, or (``front``) at its front, behind the sessions
        there already that go first: turns before paused quanta (docs/scheduling.md)."""
        st = self.st
        s.state = State.WAITING
        s.lease.wait_start = self.st.now()
        self.shares.joined_queue(s)
        st.ledger.recount(s)
        if not front:
            st.queue.append(s.id)
            return
        i = 0
        for i, sid in enumerate(st.queue):  # noqa: B007  the place to insert at
            q = st.sessions[sid].share
            if not (q.turn or (q.resume_s and not s.share.turn)):
                break
        else:
            i = len(st.queue)
        st.queue.insert(i, s.id)

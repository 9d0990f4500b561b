"""Admission: who joins the holders, and when.

In mode ``exclusive`` the GPU is one session's (or one gang's) at a time; in mode
``auto`` sessions hold together while the memory requests of all who want the GPU fit
(a request is the limit unless the session gave a smaller one). A grant is made only
when the grantee's bound (core/ledger.bound_for) fits beside everyone's count
(core/planner.py's rule); when it does not, the planner asks for swap-outs (bytes above
requests first), a holder that holds memory lent above its request gives it back
(core/lending.py), and a client that can fill is granted at once into what is
free and what those swap-outs free. Nothing is granted
during a node's recovery window, while a verified claim has not yielded, or while the
GPU is kept for a gang on several GPUs (core/coordinator.py).
"""

from __future__ import annotations

from gpushare.core import growth, lending
from gpushare.core.caps import Caps
from gpushare.core.claims import Claims
from gpushare.core.escalation import Escalation
from gpushare.core.gangs import Gangs
from gpushare.core.leases import Leases
from gpushare.core.ledger import bound_for
from gpushare.core.planner import plan_grant
from gpushare.core.sessions import SessionState, State
from gpushare.core.state import GpuState
from gpushare.core.window import Window


class Admission:
    def __init__(
        self,
        st: GpuState,
        leases: Leases,
        gangs: Gangs,
        claims: Claims,
        window: Window,
        escalation: Escalation,
        caps: Caps,
    ) -> None:
        self.st, self.leases, self.gangs, self.caps = st, leases, gangs, caps
        self.claims, self.window, self.escalation = claims, window, escalation
        # When the first quantum a grower's plan waits for ends (core/growth.py): a
        # deadline, so the plan is made again then even if nothing else happens.
        self.shield_until: float | None = None

    def deadlines(self) -> list[float]:
        """A grower's plan waits for a neighbour's quantum to end (core/growth.py)."""
        return [] if self.shield_until is None else [self.shield_until]

    def taken(self) -> bool:
        """The GPU is held, or its quantum waits for its holder."""
        return bool(self.st.holders) or self.window.holder is not None

    def may_join(self) -> bool:
        st = self.st
        if self.claims.holds_grants():
            return False  # nothing granted until the sessions it knew are back / yielded
        if self.gangs.claimed():
            return False  # kept for a gang on several GPUs: its ranks only (grant_joining)
        if not self.taken():
            return True
        if self._exclusive():
            return False
        # Do the requests of all who want the GPU fit (a quantum waiting for its holder
        # included; a gang's ranks' limits all, as they may all ask at any time)? Stop at
        # the first that does not: the queue is long only when they do not.
        total = 0
        gangs: set[str] = set()
        for i in (*self._holding(), *st.queue):
            s = st.sessions[i]
            if not s.rank.gang:
                total += s.memory.guaranteed
            elif s.rank.gang not in gangs:
                gangs.add(s.rank.gang)
                total += self.gangs.limits(s.rank.gang)
            if total > self.st.capacity:
                return False
        return True

    def _exclusive(self) -> bool:
        """The head, or one who holds (a quantum waiting for its holder included), is in
        mode exclusive (the GPU's, or its pod's time-slicing): nobody joins."""
        st = self.st
        head = st.sessions[st.queue[0]] if st.queue else None
        return (head is not None and head.mode_of(st.settings.mode) == "exclusive") or any(
            st.sessions[i].mode_of(st.settings.mode) == "exclusive" for i in self._holding()
        )

    def _holding(self) -> tuple[int, ...]:
        """The holders, and the session a quantum waits for."""
        w = self.window.holder
        return (*self.st.holders, *(() if w is None else (w,)))

    def joins(self, s: SessionState) -> bool:
        """Mode auto, nobody waiting, and ``s`` would be granted at once as things are
        (the grant's own measure: its bound beside everyone's count, :meth:`_others`):
        asking now, it would join the holders, which is no turn. Its request alone is not
        that measure: a session whose bound is above its request (a limit, what it has)
        was said to join, and then waited the holders' whole quantum."""
        st, mode = self.st, self.st.settings.mode
        if st.queue or s.mode_of(mode) == "exclusive":
            return False
        ids = self._holding()
        if any(st.sessions[i].mode_of(mode) == "exclusive" for i in ids):
            return False
        return self._others(s) + bound_for(s, mode) <= st.capacity

    def _others(self, head: SessionState) -> int:
        """Everyone's count beside ``head``'s, as a grant to it sees it. A filling holder
        counts at its limit: a holder joining in mode auto may not take what its room is
        to grow into (it could never fill). A rank's grant makes its gang hold: its peers
        then count at their limits."""
        st = self.st
        filling = 0
        for h in st.holders:
            x = st.sessions[h].memory
            if x.room:
                filling += x.held - x.room
        return st.used_bytes() - head.used + filling + self.gangs.peers_to_count(head)

    def grant_what_fits(self) -> None:
        st = self.st
        now = self.st.now()
        self.shield_until = None
        if self.gangs.revoked:
            self.gangs.settle()
        if self.gangs:
            self.gangs.hold_all()
            self.gangs.grant_joining(now, self.leases.grant)
        if not self.caps.rest(now):
            return  # all who wait rest for their compute limits
        while st.queue and self.may_join():
            head = self.gangs.head()
            if head is None or head.rank.parked:  # (parked: its gang yields, not free yet)
                return
            granted = self._grant_head(head)
            if not granted:  # memory lent above requests comes back for it (rule 6)
                lending.reclaim_for(st, head, self.leases.revoke)
                self._grant_beside_grower(head)
                return
            if head.rank.gang:  # its peers that ask join it
                self.gangs.grant_joining(now, self.leases.grant)

    def _grant_head(self, head: SessionState) -> bool:
        """Grant the queue's head if it fits, or as it fills what swap-outs free; else
        ask for the swap-outs that make room. False: it waits."""
        st = self.st
        # Fast path (the common case, on every handoff): it fits as things are.
        others = self._others(head)
        if others + bound_for(head, st.settings.mode) <= self.st.capacity:
            self.leases.grant(head, lent=True)
            return True
        peers = self.gangs.peers_to_count(head)
        views, self.shield_until = growth.shield(
            self.gangs.views(head, peers), head, st.sessions, st.now(), st.settings.mode
        )
        plan = plan_grant(self.st.capacity, views, head.id)
        if plan.fits:
            self.leases.grant(head)
            return True
        for sid, n in plan.swap_outs:
            st.ask_swap_out(sid, n)
        room = self.st.capacity - others
        m = head.memory
        overlap = self.st.settings.overlap and m.fills and m.swapped and not plan.shortfall
        if overlap and room > m.resident:
            # Enough is on its way out: the head swaps in now, into what is free and then
            # into what the swap-outs free (RoomActions), at once.
            self.leases.grant(head, room)
            return True
        if plan.shortfall and not plan.swap_outs and not st.holders:
            self.escalation.kill_frozen_blockers()
        return False

    def _grant_beside_grower(self, head: SessionState) -> None:
        """``head`` grows and waits for the rotation of quanta: a session behind it whose
        quantum still runs and fits as things are starts its next burst meanwhile
        (core/growth.py), rather than idling until the grower takes its bytes: with what
        is left of that quantum, never a new one (else the grower waits for ever)."""
        st = self.st
        now = st.now()
        if not growth.grower(head, st.settings.mode):
            return
        for sid in list(st.queue)[1:]:
            s = st.sessions[sid]
            if s.state is State.WAITING and growth.protected(s, now) and self.joins_beside(s):
                s.lease.quantum_end = growth.running_end(s, now)
                s.share.continued, s.share.turn = True, False
                self.leases.grant(s, lent=True)

    def joins_beside(self, s: SessionState) -> bool:
        return self._others(s) + bound_for(s, self.st.settings.mode) <= self.st.capacity

    def resume_or_yield(self, s: SessionState, lease: int) -> None:
        """A verified claim (``s`` is queued): its lease back if the mode and memory allow,
        else a revoke."""
        others = self.st.used_bytes() - s.used
        if self.may_join() and others + bound_for(s, self.st.settings.mode) <= self.st.capacity:
            self.st.queue.remove(s.id)
            self.st.queue.appendleft(s.id)
            self.leases.grant(s, resume=True)
        else:
            self.claims.tell_to_yield(s, lease, verified=True)

"""Escalation (docs/faults.md): what follows when a workload does not do as asked.

A holder that does not yield within the grace period, a non-holder asked to swap out
that moves nothing for one, a workload past its memory limit: each is escalated once
per stretch by the GPU's policy (``log``, ``freeze``, ``kill``). A frozen process
cannot swap: its memory stays, and where it is all that blocks the queue the
escalation goes one step further (``kill``). A session frozen outside the queue is
thawed at the next grant of anyone, as what froze it is past.
"""

from __future__ import annotations

import math
from typing import Any

from gpushare.core.actions import EscalateAction, ThawAction
from gpushare.core.events import Escalate
from gpushare.core.sessions import SessionState, State
from gpushare.core.state import GpuState
from gpushare.settings import Escalation as Policy


class Escalation:
    def __init__(self, st: GpuState) -> None:
        self.st = st
        self.frozen_idle: set[int] = set()  # frozen outside the queue (thawed at a grant)

    def escalate(
        self,
        s: SessionState,
        reason: str,
        fields: dict[str, Any],
        action: Policy | None = None,
    ) -> Policy:
        esc = action or self.st.settings.escalation
        s.totals.escalations += 1
        self.st.out.emit(Escalate(session=s.id, reason=reason, action=esc, **fields))
        self.st.out.act(EscalateAction(s.id, esc, reason))
        return esc

    def check_limit(self, s: SessionState, used: int, what: str) -> None:
        """Escalate once per stretch over the limit."""
        m = s.memory
        if used > m.limit and not m.over_limit:
            m.over_limit = True
            self.escalate(s, "over_memory_limit", {what: used, "limit_bytes": m.limit})
        elif used <= m.limit:
            m.over_limit = False

    def freeze_waiting(self, s: SessionState) -> None:
        """A non-holder stopped by the freeze escalation: its memory stays (pinned); in
        the queue it is thawed at its grant, outside at the next grant of anyone."""
        s.esc.frozen = True
        if s.state is State.IDLE:
            self.frozen_idle.add(s.id)

    def overdue_swap_outs(self, now: float) -> None:
        """Non-holders asked to swap out that moved no byte for a grace period: asked no
        more (the planner looks for another way) and escalated once."""
        st = self.st
        for sid in st.deadlines.overdue_swap_outs(st.sessions, now):
            s = st.sessions[sid]
            pending, s.memory.pending_out = s.memory.pending_out, 0
            st.deadlines.set_swap_out(s, math.inf)
            st.deadlines.retry_after_failure(s, now, st.sessions)
            if s.esc.swap_escalated:
                continue
            s.esc.swap_escalated = True
            fields = {"grace_s": st.settings.grace_s, "pending_bytes": pending}
            if self.escalate(s, "no_swap_out_within_grace", fields) == "freeze":
                self.freeze_waiting(s)

    def kill_frozen_blockers(self) -> None:
        """A frozen session's memory blocks the head, and thawing it would not help (it
        ignores revokes): the escalation goes one step further, or the queue waits
        forever."""
        for sid in [*self.st.queue, *self.frozen_idle]:
            v = self.st.sessions[sid]
            if v.esc.frozen and not v.esc.escalated:
                v.esc.escalated = True
                self.escalate(
                    v, "frozen_memory_needed", {"resident_bytes": v.memory.resident}, "kill"
                )

    def thaw_idle(self) -> None:
        """Someone was granted: what froze those outside the queue is past."""
        for fid in list(self.frozen_idle):
            f = self.st.sessions[fid]
            f.esc.frozen, f.esc.escalated = False, False
            self.frozen_idle.discard(fid)
            self.st.out.act(ThawAction(fid))

    def forget(self, sid: int) -> None:
        self.frozen_idle.discard(sid)

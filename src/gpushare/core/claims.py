"""Recovery claims: a workload that outlived a node restart says it holds a lease.

After a restart the node grants nothing until the sessions on record are back (the
recovery window) or the window ends. A claim the node verified (the session matched its
record, and the lease's token checked out) may be true: it is given back at the
window's end, the most recent lease first, where the mode and memory allow, and until
it has yielded nothing else is granted. Any other claim is not believed: the session is
told to yield (a revoke for the lease it named) and escalated like a holder that does
not, and it blocks no one.
"""

from __future__ import annotations

from gpushare.core.actions import RevokeAction
from gpushare.core.escalation import Escalation
from gpushare.core.events import Revoke
from gpushare.core.sessions import SessionState
from gpushare.core.state import GpuState


class Claims:
    def __init__(self, st: GpuState, escalation: Escalation) -> None:
        self.st, self.escalation = st, escalation
        self.recovering = False  # until the sessions it knew are back: nothing granted
        self.told: set[int] = set()  # told to yield a lease they claimed (yield_due)
        self.blocking: set[int] = set()  # of those, the verified: nothing granted meanwhile

    def holds_grants(self) -> bool:
        return self.recovering or bool(self.blocking)

    def end(self) -> list[tuple[SessionState, int]]:
        """The window ends: the verified claims, the most recent lease first."""
        self.recovering = False
        out = []
        claimed = (s for s in self.st.sessions.values() if s.esc.claim)
        for s in sorted(claimed, key=lambda s: s.esc.claim, reverse=True):
            lease, s.esc.claim = s.esc.claim, 0
            out.append((s, lease))
        return out

    def tell_to_yield(self, s: SessionState, lease: int, verified: bool) -> None:
        """It says it works on the GPU without a lease this node gives it: it is told to
        yield (its release answers), and past the grace period escalated. A verified
        claim blocks grants until it has yielded; an unverified one blocks no one."""
        e, grace = s.esc, self.st.settings.grace_s
        e.yield_due, e.claim, e.escalated = True, 0, False
        s.lease.revoke_deadline = self.st.now() + grace
        s.totals.revokes += 1
        self.told.add(s.id)
        if verified:
            self.blocking.add(s.id)
        reason = "claim_not_honoured"
        self.st.out.emit(Revoke(session=s.id, lease=lease, reason=reason, swap_out_bytes=0))
        self.st.out.act(RevokeAction(s.id, lease, 0, grace))

    def clear(self, s: SessionState) -> None:
        s.esc.yield_due = False
        self.told.discard(s.id)
        self.blocking.discard(s.id)

    def overdue(self, now: float) -> None:
        """Claims not yielded within the grace period: escalated once; a frozen one is off
        the GPU until its grant thaws it, its turn after those who waited."""
        st = self.st
        for sid in [i for i in self.told if st.sessions[i].lease.revoke_deadline <= now]:
            s = st.sessions[sid]
            if s.esc.escalated:
                continue
            s.esc.escalated = True
            fields = {"grace_s": st.settings.grace_s}
            if self.escalation.escalate(s, "no_yield_within_grace", fields) == "freeze":
                self.clear(s)
                self.escalation.freeze_waiting(s)
                st.queue.remove(sid)
                st.queue.append(sid)

    def deadlines(self) -> list[float]:
        ss = self.st.sessions
        return [ss[i].lease.revoke_deadline for i in self.told if not ss[i].esc.escalated]

    def forget(self, sid: int) -> None:
        self.told.discard(sid)
        self.blocking.discard(sid)

    def verify(self) -> list[str]:
        told = {s.id for s in self.st.sessions.values() if s.esc.yield_due}
        wrong = []
        if self.told != told:
            wrong.append(f"told to yield {self.told}, scan {told}")
        if not self.blocking <= told:
            wrong.append(f"blocking {self.blocking}, told {told}")
        return wrong

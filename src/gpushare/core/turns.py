"""Interactive turns (docs/scheduling.md 3): a notebook cell goes ahead of the quanta.

A session that asks after idling (longer than half of ``anticipate_s``) and whose usual
burst is short is given a *turn*: it goes to the front of the queue, and holders that
cannot share with it are revoked at once, each keeping what was left of its quantum
(*resumed* after the turn). A turn is paid from the session's *credit*, which accrues
while it idles at ``turn_share`` of its weight share, up to ``turn_s``: a session cannot
take more than its share this way. Turns never starve a queue: none is taken while
someone has waited a whole round.
"""

from __future__ import annotations

from gpushare.core.sessions import SessionState, State
from gpushare.core.shares import Shares
from gpushare.core.state import GpuState

TURN_MIN_S = 0.02  # a turn shorter than this is not worth its two switches
RESUME_MIN_S = 0.01  # less left of a paused quantum than this: not resumed


class Turns:
    def __init__(self, st: GpuState, shares: Shares) -> None:
        self.st, self.shares = st, shares

    def first_credit(self) -> float:
        return self.st.settings.turn_s  # a notebook's first cell after it attached is a turn

    def accrue(self, s: SessionState, idle: float) -> None:
        """Credit for ``idle`` seconds away, at its share of ``turn_share``."""
        rate = self.st.settings.turn_share * self.shares.weight_share(s)
        s.share.credit = min(self.st.settings.turn_s, s.share.credit + rate * idle)

    def may_take(
        self, s: SessionState, idle: float, now: float, *, ahead: bool, kept: bool
    ) -> bool:
        """An interactive turn: the session asked (not for the first time) after idling
        longer than half of ``anticipate_s`` (away long enough that its quantum would not
        wait for it: no session falls between the two rules and waits two quanta), its
        credit covers its usual burst, there is someone to go ``ahead`` of (the GPU is
        held, or its quantum waits for its holder, or others wait for it and it went idle
        before they began to: a cell that asks while the GPU is between holders, the next
        still swapping in, goes first too, not behind that holder's whole quantum), and no
        one waiting has waited a whole round yet (the queue's length in quanta). ``kept``:
        the GPU is kept for a gang on several GPUs (core/coordinator.py), its ranks only."""
        st = self.st.settings
        sh = s.share
        if st.turn_s <= 0 or idle <= st.anticipate_s / 2 or s.esc.frozen or sh.burst_ewma is None:
            return False  # (no burst of its own yet: nothing says it asks briefly)
        if s.rank.gang:  # a rank's turn alone would wait in its collectives for the others
            return False
        if kept or not ahead:
            return False  # kept for a gang; nothing to go ahead of
        if sh.credit < max(TURN_MIN_S, sh.burst_ewma or 0.0):
            return False
        guard = st.tq_s * (len(self.st.holders) + len(self.st.queue) + 1)
        return all(now - self.st.sessions[q].lease.wait_start < guard for q in self.st.queue)

    def due(self) -> bool:
        """A turn is first in line."""
        q = self.st.queue
        return bool(q) and self.st.sessions[q[0]].share.turn

    @staticmethod
    def preempts(h: SessionState) -> bool:
        """A turn first in line revokes holder ``h`` at once, ``h`` keeping what is left
        of its quantum for after the turn; holders still swapping in are revoked once
        their memory is back."""
        if h.state is not State.HOLDING or h.share.turn:
            return False
        return not (h.memory.swapping_in or h.memory.room)

    def length(self, s: SessionState) -> float:
        """A turn's quantum: its credit, within [TURN_MIN_S, turn_s]."""
        s.totals.turns += 1
        return min(max(s.share.credit, TURN_MIN_S), self.st.settings.turn_s)

    @staticmethod
    def settle(s: SessionState, now: float) -> bool:
        """A lease ends: a turn is paid from the credit (its GPU time: its swap-in is a
        switch's cost, as anyone's); a quantum paused by a turn keeps what was left of it
        at the revoke. False: neither, the quantum is the shares' to settle."""
        sh = s.share
        if sh.turn:
            sh.credit = max(0.0, sh.credit - max(0.0, now - s.lease.gpu_since))
            sh.turn = False
            return True
        if sh.resume_s:
            sh.resume_s = max(0.0, sh.resume_s - (now - s.lease.revoked_at))
            if sh.resume_s < RESUME_MIN_S:
                sh.resume_s = 0.0
            return True
        return False

    @staticmethod
    def over(s: SessionState) -> None:
        """Its turn ended with nobody waiting: it holds on as anyone would."""
        if s.share.turn:
            s.share.turn, s.share.credit = False, 0.0

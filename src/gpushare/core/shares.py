"""Shares that match the weights (docs/scheduling.md 4): the quantum, and deficit
accounting both ways.

A session's quantum is TQ, scaled under policy ``weighted`` by its weight over the
largest attached. GPU time a holder keeps past its quantum (the way to its safe point, a
late answer) is its *debt*, paid off its next quanta, up to :data:`PAYBACK` of each;
what one quantum cannot pay is *owed* to those waiting, by weight, as credit added to
their next quanta (one running total, so crediting every waiter costs O(1)).
"""

from __future__ import annotations

import math

from gpushare.core.sessions import SessionState
from gpushare.core.state import GpuState

# A quantum pays back at most this much of itself in debt (a grant that costs a switch
# still works a quarter of it), and gets at most one quantum more from what others owe
# it; stored credit is kept up to this many of its quanta.
PAYBACK = 0.75
CREDIT_QUANTA = 2.0


class Shares:
    def __init__(self, st: GpuState) -> None:
        self.st = st
        # GPU seconds per unit of weight share owed to every session waiting, by holders
        # that held past their quanta more than their next ones can pay back: a waiting
        # session's credit is its share times the growth since it began to wait (O(1)).
        self.owed = 0.0

    def quantum(self, s: SessionState) -> float:
        tq = self.st.settings.tq_s
        if self.st.settings.policy == "weighted":
            return tq * s.weight / self.st.ledger.largest_weight()
        return tq

    def weight_share(self, s: SessionState) -> float:
        if self.st.settings.policy == "weighted":
            return s.weight / self.st.ledger.largest_weight()
        return 1.0

    def joined_queue(self, s: SessionState) -> None:
        s.share.owed_mark = self.owed

    def collect_credit(self, s: SessionState) -> None:
        """A session leaves the queue for a lease: what holders owed those waiting since
        it began to wait becomes its credit (bounded)."""
        owed = (self.owed - s.share.owed_mark) * self.weight_share(s)
        s.share.owed_mark = self.owed
        s.share.debt = max(s.share.debt - owed, -CREDIT_QUANTA * self.quantum(s))

    def next_quantum(self, s: SessionState) -> float:
        """A plain grant's quantum: a debt comes off it, a credit adds to it."""
        q = self.quantum(s)
        take = max(-q, min(s.share.debt, q * PAYBACK))
        s.share.debt -= take
        return q - take

    def settle(self, s: SessionState, now: float) -> None:
        """A revoked quantum ends: GPU time held past it is owed, taken off later quanta;
        what its next quantum cannot pay back goes to those waiting instead (a lighter
        session's quantum may be shorter than the way to its safe point)."""
        if math.isinf(s.lease.quantum_end):
            return
        sh = s.share
        sh.debt += max(0.0, now - s.lease.quantum_end)
        excess = sh.debt - self.quantum(s) * PAYBACK
        if excess > 0:
            sh.debt -= excess
            if not s.rank.gang:  # a gang's members share one quantum: not each other's
                self.owed += excess / self.weight_share(s)

    @staticmethod
    def went_idle(s: SessionState) -> None:
        s.share.debt = max(s.share.debt, 0.0)  # no credit banked while idle (a debt stays)

"""Interactive turns (docs/scheduling.md 3): a notebook cell, or a server's request, goes
ahead of the quanta.

A session that asks after idling (longer than half of ``anticipate_s``; any gap, when
nothing waited for it and its usual gap is not a loop's: a server) and whose usual burst
is short is given a *turn*: it goes to the front of the queue, and holders that cannot
share with it are revoked at once, each keeping what was left of its quantum (*resumed*
after the turn). A turn is paid from the session's *credit*, which accrues while it idles
at ``turn_share`` of its weight share, or at what its measured use needs (with headroom)
up to its weight's share of the GPU, and is kept up to ``turn_s``: a session cannot take
more than its share this way. Its usual burst is the lower median of its recent bursts,
a burst that waited (and so drained a backlog) counted at most at ``turn_s``: one backlog
or one slow request does not lock it out. A server (by its measured use, or by its history:
:meth:`Turns.requests`) short of credit overdraws half a turn, or waits only until its
wait has earned the turn, never for a quantum; one whose turn (or quantum) runs out with
requests still queued waits alike for a whole turn (:meth:`Turns.went_on`: past its
share, longer and fewer turns), and what its turns took comes off its next quanta (its
share, no more). Turns never starve a queue: none is taken while someone has waited a
whole round.
"""

from __future__ import annotations

import math

from gpushare.core import families
from gpushare.core.sessions import SessionState, State
from gpushare.core.shares import Shares
from gpushare.core.state import GpuState
from gpushare.core.window import ANTICIPATE_FLOOR_S

TURN_MIN_S = 0.02  # a turn shorter than this is not worth its two switches
RESUME_MIN_S = 0.01  # less left of a paused quantum than this: not resumed
USE_TAU_S = 60.0  # its measured use is a decayed average over about this long
HEADROOM = 1.5  # credit earned for this much of its measured use (within its share)
SHARE_MOST = 0.9  # the most of the GPU turns are earned for (alone, a session has 1)
SERVER_BURSTS = 2  # bursts seen before a session is taken for a server
SERVER_IDLE_S = 0.05  # a server's implicit burst ends this long after its last safe point


class Turns:
    def __init__(self, st: GpuState, shares: Shares) -> None:
        self.st, self.shares = st, shares
        # servers refused a turn for want of credit, waiting in the queue: when the
        # credit they earn as they wait covers the turn they wait for, since when they
        # earn it, and that turn (looked at again then: a turn, not the rest of a quantum)
        self.refused: dict[int, tuple[float, float, float]] = {}

    def first_credit(self) -> float:
        return self.st.settings.turn_s  # a notebook's first cell after it attached is a turn

    # --- what it is owed, and what it uses -------------------------------------------

    def share(self, s: SessionState) -> float:
        """Its weight's share of the GPU among the sessions attached."""
        st = self.st
        if st.settings.policy != "weighted":
            return 1.0 / max(1, len(st.sessions))
        # (the ledger's running count of weights: O(distinct weights), not O(sessions))
        total = sum(w * n for w, n in st.ledger._weights.items())
        return s.weight / total if total > 0 else 1.0

    @staticmethod
    def use(s: SessionState) -> float:
        """Its measured use: the fraction of the last minute or so it held the GPU."""
        sh = s.share
        return min(1.0, sh.use_s / sh.use_span) if sh.use_span > 0 else 0.0

    @staticmethod
    def _bring_up(s: SessionState, now: float) -> None:
        sh = s.share
        dt = max(0.0, now - (sh.use_at or s.attached))
        k = math.exp(-dt / USE_TAU_S)
        sh.use_s *= k
        sh.use_span = sh.use_span * k + USE_TAU_S * (1.0 - k)
        sh.use_at = now

    def _rates(self, s: SessionState) -> tuple[float, float]:
        """A notebook's rate (``turn_share`` of its weight share) and the fraction ``u``
        of the time its measured use asks for, with headroom, within its share."""
        base = self.st.settings.turn_share * self.shares.weight_share(s)
        return base, min(self.share(s), HEADROOM * self.use(s), SHARE_MOST)

    def rate(self, s: SessionState) -> float:
        """Credit earned per idle second: ``turn_share`` of its weight share (a
        notebook's), or, when it uses more, what its measured use needs with headroom, up
        to its share of the GPU. Earned at ``r`` per idle second, turns take at most
        ``r / (1 + r)`` of any stretch of time (plus what it keeps): ``u / (1 - u)`` for
        a fraction ``u``."""
        base, u = self._rates(s)
        return max(base, u / (1.0 - u))

    def serves(self, s: SessionState) -> bool:
        """It earns for its measured use, more than a notebook's rate: a server."""
        base, u = self._rates(s)
        return u / (1.0 - u) > base

    def requests(self, s: SessionState) -> bool:
        """Request-driven (a server, a notebook): it asks often and briefly after idle
        gaps (most of its recent bursts, more than half, shorter than a turn; gaps longer
        than the shortest window), so its implicit bursts end soon after each request
        (:data:`SERVER_IDLE_S`), not the node's ``idle_release`` later: the GPU goes back
        to the batch job at once. Two bursts seen are enough when both are short (a
        server's memory made, then its first request: each request before this held the
        GPU idle 0.5 s more, a trainer's time); a training loop's short first burst (its
        memory made) then its long one is not. Bursts counted at the cap (each drained a
        backlog, past its share) say nothing either way: they keep the verdict its history
        gave at its last burst's end (a server past its share stays one: its bursts' idle
        release 0.5 s, not 0.05, had cost it a tenth of its share at each)."""
        sh = s.share
        n = len(sh.bursts)
        if n < SERVER_BURSTS or sh.gap_ewma is None:
            return False
        upper = sorted(sh.bursts)[n // 2]  # (the upper median: a strict majority below it)
        cap = self.st.settings.turn_s
        short = upper < cap or (upper == cap and sh.served)
        return short and sh.gap_ewma > ANTICIPATE_FLOOR_S

    def bank(self, s: SessionState) -> float:
        """The most credit it keeps: ``turn_s``, or, a server, its share of a quantum
        (requests come in bunches)."""
        st = self.st.settings
        if not self.serves(s):
            return st.turn_s
        return max(st.turn_s, self._rates(s)[1] * self.shares.quantum(s))

    def answers(self, s: SessionState) -> bool:
        """A server, by its measured use (:meth:`serves`) or by its history
        (:meth:`requests`): a turn it is refused must not send it behind a quantum. Not
        by its use alone: at a light load its use is below a notebook's rate, by a few
        hundredths, or above it, by how long its swap-ins took (its waits count as use);
        a server whose cache is dropped rather than swapped (no swap-in) fell below, had
        no overdraft and waited for the batch job's whole quantum (issue 28: p50 5.6 s)."""
        return self.serves(s) or self.requests(s)

    def overdraft(self, s: SessionState) -> float:
        """What a server's turn may take beyond its credit, paid back while it idles:
        half a turn (a request that finds the credit spent by the last bunch is answered,
        not sent behind a quantum); a session not taken for a server, none."""
        return self.st.settings.turn_s / 2 if self.answers(s) else 0.0

    def waiting_rate(self, s: SessionState) -> float:
        """What a refused server earns per second it waits: its rate ``r`` per idle
        second, as if idle (every second it does not hold earns ``r``, so its turns still
        take at most ``r / (1 + r)`` of the time: ``u``, its share at most). At ``u / (1 +
        u)`` (earned per second waited at ``u``), a server past its share, its turns ending
        with requests queued, got a third of the GPU for a half share and its backlog grew
        without bound; 0 for a session not taken for a server."""
        return self.rate(s) if self.answers(s) else 0.0

    @staticmethod
    def usual_burst(s: SessionState) -> float | None:
        """The lower median of its recent bursts (None: none yet)."""
        b = sorted(s.share.bursts)
        return b[(len(b) - 1) // 2] if b else None

    # --- a burst's ask and end ---------------------------------------------------------

    def asked(self, s: SessionState, now: float, idle: float) -> None:
        """A burst begins after ``idle`` seconds: credit for them at its rate, kept up to
        ``turn_s``; the burst's wait is measured from now."""
        sh = s.share
        self._bring_up(s, now)
        sh.credit = min(self.bank(s), sh.credit + self.rate(s) * idle)
        sh.asked_at, sh.held_mark = now, s.totals.lease_s

    def burst_ended(self, s: SessionState, now: float, gpu_s: float, *, windowed: bool) -> None:
        """A burst ended after ``gpu_s`` seconds of GPU time. One that waited longer than
        a turn for its lease drained a backlog: it says nothing of how long a request of
        its own takes, so it counts at most at ``turn_s`` (never more than a full credit
        covers: no lock-out). So does its first, its start (a model loaded, memory made):
        a session with no history but its start gets its first turn, bounded by the credit
        it attached with, when it asks after idling, and a server's first request does
        not wait a quantum (issue 40: 19.6-25.9 s at TQ 30, its start a long load alone).
        ``windowed``: its quantum waits for it to ask again."""
        sh = s.share
        cap = self.st.settings.turn_s
        waited = (now - sh.asked_at) - (s.totals.lease_s - sh.held_mark)
        start = not sh.bursts and s.totals.bursts <= 1
        sh.bursts.append(gpu_s if waited <= cap and not start else min(gpu_s, cap))
        sh.served = self.requests(s)
        self._bring_up(s, now)
        sh.use_s += now - sh.asked_at  # it wanted the GPU from its ask: waits count
        # (a window opened knowing no gap of its own, its first, is the floor's: it says
        # nothing of whether its quantum would wait for it)
        sh.windowless = not windowed or sh.gap_ewma is None

    # --- the rule ----------------------------------------------------------------------

    def rarely(self, s: SessionState, idle: float) -> bool:
        """It asks after an idle gap: longer than half of ``anticipate_s`` (its quantum
        would not have waited so long for it), or any, when nothing waited for it (its
        last burst was a turn, or ended with no window) and its usual gap is longer than
        the shortest window (requests, not a loop's steps)."""
        half = self.st.settings.anticipate_s / 2
        if idle > half:
            return True
        g = s.share.gap_ewma
        return s.share.windowless and g is not None and g > ANTICIPATE_FLOOR_S

    def may_take(
        self, s: SessionState, idle: float, now: float, *, ahead: bool, kept: bool
    ) -> bool:
        """An interactive turn: the session asked (not for the first time) after an idle
        gap (:meth:`rarely`: away long enough that its quantum would not wait for it, so
        that no session falls between the two rules and waits two quanta), its credit
        covers its usual burst, there is someone to go ``ahead`` of (the GPU is held, or
        its quantum waits for its holder, or others wait for it and it went idle before
        they began to: a cell that asks while the GPU is between holders, the next still
        swapping in, goes first too, not behind that holder's whole quantum), and no one
        waiting has waited a whole round yet (the queue's length in quanta). ``kept``:
        the GPU is kept for a gang on several GPUs (core/coordinator.py), its ranks only."""
        st = self.st.settings
        sh = s.share
        usual = self.usual_burst(s)
        if st.turn_s <= 0 or s.esc.frozen or usual is None:
            return False  # (no burst of its own yet: nothing says it asks briefly)
        if not self.rarely(s, idle):
            return False
        if self._ranked(s):
            return False  # a rank's turn alone would wait in its collectives for the others
        if kept or not ahead:
            return False  # kept for a gang; nothing to go ahead of
        if sh.credit + self.overdraft(s) < max(TURN_MIN_S, usual):
            self._refuse(s, now, usual)
            return False
        return self._no_one_starves(now)

    @staticmethod
    def _ranked(s: SessionState) -> bool:
        """A rank of a job (not of its own family): no turns, its peers would not follow."""
        return bool(s.rank.gang) and not families.alone(s.rank.gang)

    def _refuse(self, s: SessionState, now: float, want: float) -> None:
        """A server short of credit for a turn of ``want`` seconds waits, earning as it
        would idle (:meth:`waiting_rate`: its turns stay within ``u`` of the time); when
        that covers the turn it is looked at again."""
        r = self.waiting_rate(s)
        if r <= 0:
            return
        want = max(TURN_MIN_S, want)
        need = want - self.overdraft(s) - s.share.credit
        # (at least a millisecond on: rounding must not look again at the same instant)
        self.refused[s.id] = (now + max(1e-3, need / r), now, want)

    def went_on(self, s: SessionState, now: float, *, turn: bool) -> None:
        """Its turn (or quantum) ended with its burst going on (requests still queued: a
        backlog, past its share): a server waits as one refused does, not sent behind the
        quanta (issue 40: at TQ 5 and 2 requests a second, served in whole quanta, p99
        24.7 s), until it has earned a whole turn: what queued meanwhile is served
        together, so that past its share its turns grow longer and fewer, each switch
        paid for by a turn's work, and its latency grows by degrees (docs/scheduling.md
        3)."""
        sh = s.share
        # It goes idle between bursts (a burst ended after its start, its gaps longer than
        # the shortest window): a server's queue drains; a training loop's burst never
        # ends, and a turn at its loop's start is not chained through another's quantum
        # (each a switch of its whole memory). Once, before a burst has ended: a server
        # whose first requests queued past one turn.
        idles = len(sh.bursts) >= SERVER_BURSTS and (sh.gap_ewma or 0.0) > ANTICIPATE_FLOOR_S
        if (idles or (turn and not sh.chained)) and self.answers(s) and not self._ranked(s):
            sh.chained = True
            self._refuse(s, now, self.st.settings.turn_s)

    def granted(self, s: SessionState) -> None:
        """A refused server granted (a turn, or from the queue) waits no more: its entry
        would count the time it holds as waited."""
        self.refused.pop(s.id, None)

    def deadlines(self) -> list[float]:
        """When a refused server's credit will cover its usual burst."""
        st = self.st.sessions
        return [
            t
            for sid, (t, _, _) in self.refused.items()
            if sid in st and st[sid].state is State.WAITING and not st[sid].share.turn
        ]

    def reconsider(self, now: float) -> None:
        """Refused servers whose credit, earned as they waited, now covers their usual
        burst: a turn, first in line, if the GPU is held and nobody has waited a round."""
        if not self.refused:
            return
        st = self.st
        for sid, (t, since, want) in list(self.refused.items()):
            s = st.sessions.get(sid)
            if s is None or s.state is not State.WAITING or s.share.turn:
                del self.refused[sid]
                continue
            if t > now:
                continue
            del self.refused[sid]
            sh = s.share
            sh.credit = min(self.bank(s), sh.credit + self.waiting_rate(s) * (now - since))
            if sh.credit + self.overdraft(s) < want - 1e-9:
                self._refuse(s, now, want)
            elif st.holders and not self._ranked(s) and self._no_one_starves(now):
                sh.turn = True
                st.queue.remove(sid)
                i = next(
                    (i for i, q in enumerate(st.queue) if not st.sessions[q].share.turn),
                    len(st.queue),
                )
                st.queue.insert(i, sid)

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
        """A turn's quantum: its credit (and a server's overdraft), within [TURN_MIN_S,
        turn_s]."""
        s.totals.turns += 1
        have = s.share.credit + self.overdraft(s)
        return min(max(have, TURN_MIN_S), self.st.settings.turn_s)

    def renew(self, s: SessionState, now: float) -> bool:
        """Its turn's time is up and others wait: it goes on for another turn while its
        credit (less what this turn has used) lasts, and nobody waiting has waited a whole
        round (a server's requests that came during the turn are answered in it,
        not after the next quantum). Its credit is paid when the lease ends."""
        if not s.share.turn:
            return False
        left = s.share.credit + self.overdraft(s) - max(0.0, now - s.lease.gpu_since)
        if left < TURN_MIN_S or not self._no_one_starves(now):
            return False
        s.lease.quantum_len = min(left, self.st.settings.turn_s)
        s.lease.quantum_end = now + s.lease.quantum_len
        return True

    def _no_one_starves(self, now: float) -> bool:
        """No one waiting has waited a whole round (TQ x those holding and waiting, + 1)."""
        st = self.st
        guard = st.settings.tq_s * (len(st.holders) + len(st.queue) + 1)
        return all(now - st.sessions[q].lease.wait_start < guard for q in st.queue)

    def settle(self, s: SessionState, now: float) -> bool:
        """A lease ends: a turn is paid from the credit (its GPU time: its swap-in is a
        switch's cost, as anyone's); a quantum paused by a turn keeps what was left of it
        at the revoke. False: neither, the quantum is the shares' to settle."""
        sh = s.share
        if sh.turn:  # (below 0: a server's overdraft, or a late safe point: paid back)
            used = max(0.0, now - s.lease.gpu_since)
            sh.credit -= used
            # ... and taken off its next quantum from the queue (core/shares.py's debt):
            # turns inside others' quanta and a whole quantum of its own besides took a
            # session that ends its burst at each revoke past its share (0.645 at TQ 30).
            # Up to a quantum: a server's day of turns does not shorten its quanta for hours.
            sh.debt = max(sh.debt, min(sh.debt + used, self.shares.quantum(s)))
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
            s.share.turn, s.share.credit = False, min(s.share.credit, 0.0)

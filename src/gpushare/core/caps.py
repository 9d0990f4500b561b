"""Compute limits (docs/scheduling.md 6, "Compute"): a session's share of GPU time capped,
even when the GPU would otherwise idle (KAI's proposed min-max compute, issue 2191).

A session with compute limit ``c`` (a fraction in (0, 1]) has a bucket of GPU seconds:
at most ``c`` x :data:`WINDOW_S`, filled at ``c`` per second, spent by its GPU time (from
its swap-in's end). A grant's quantum ends by the time the bucket would run dry; at that
quantum's end it is revoked (reason ``compute_limit``) whether or not anyone waits, and
it is not granted again (others are, ahead of it) until the bucket holds :data:`REST_S`
of GPU time, or all of it when the bucket is smaller. Over a long run its share is ``c``;
over any window of :data:`WINDOW_S` it holds at most ``c`` x ``WINDOW_S`` plus one bucket.
The weight stays the compute request: what it gets beside others when the GPU is
contended.
"""

from __future__ import annotations

import math

from gpushare.core.sessions import SessionState, State
from gpushare.core.state import GpuState

WINDOW_S = 10.0  # the window a compute limit is kept over
REST_S = 0.5  # GPU seconds a capped session waits for before its next grant (at most its bucket)
EPS = 1e-9


def left(s: SessionState, now: float) -> float:
    """GPU seconds in the bucket now (may be below 0 by a late yield's overrun)."""
    sh = s.share
    spent = 0.0
    if s.holding:
        spent = max(0.0, now - max(sh.cap_at, s.lease.gpu_since))
    return min(sh.cap * WINDOW_S, sh.cap_left + sh.cap * (now - sh.cap_at) - spent)


def settle(s: SessionState, now: float) -> None:
    """The bucket brought up to ``now`` (at a grant and a release)."""
    if s.share.cap:
        s.share.cap_left, s.share.cap_at = left(s, now), now


def capped_quantum(s: SessionState, q: float, now: float) -> float:
    """``q`` cut to when the bucket runs dry while it holds."""
    c = s.share.cap
    if not c or c >= 1.0:
        return q
    return min(q, max(0.0, left(s, now)) / (1.0 - c))


def dry(s: SessionState, now: float) -> bool:
    """A holder whose bucket is spent: revoked at its quantum's end, even alone."""
    return 0 < s.share.cap < 1.0 and left(s, now) <= EPS


def ready_at(s: SessionState) -> float:
    """When a waiting capped session may be granted again (-inf: it may now)."""
    sh = s.share
    if not sh.cap or sh.cap >= 1.0:
        return -math.inf
    need = min(REST_S, sh.cap * WINDOW_S) - sh.cap_left
    return -math.inf if need <= EPS else sh.cap_at + need / sh.cap


def resting(s: SessionState, now: float) -> bool:
    return s.state is State.WAITING and ready_at(s) > now


class Caps:
    """The queue's view of capped sessions; ``count`` of them attached keeps the scans
    off every decision where none is."""

    def __init__(self, st: GpuState) -> None:
        self.st = st
        self.count = 0

    def rest(self, now: float) -> bool:
        """Resting sessions go behind the others in the queue (order kept); True if the
        queue's head may be granted now (it is not resting)."""
        q = self.st.queue
        ss = self.st.sessions
        if not self.count or not q or not resting(ss[q[0]], now):
            return True
        ready: list[int] = []
        waiting: list[int] = []
        for i in q:
            (waiting if resting(ss[i], now) else ready).append(i)
        if not ready:
            return False
        q.clear()
        q.extend(ready + waiting)
        return True

    def verify(self) -> list[str]:
        """The running count of capped sessions against a scan."""
        n = sum(1 for s in self.st.sessions.values() if s.share.cap)
        return [] if n == self.count else [f"capped sessions: count {self.count}, scan {n}"]

    def all_resting(self, now: float) -> bool:
        ss = self.st.sessions
        q = self.st.queue
        return bool(self.count and q) and all(resting(ss[i], now) for i in q)

    def deadlines(self) -> list[float]:
        """When resting sessions in the queue may be granted: those after the rules last
        ran (one due since is due still, until a decision sees it)."""
        if not self.count:
            return []
        ss, since = self.st.sessions, self.st.deadlines.advanced
        return [t for i in self.st.queue if (t := ready_at(ss[i])) > since]

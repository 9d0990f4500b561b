"""Compute limits (docs/scheduling.md 8): a session's share of GPU time capped,
even when the GPU would otherwise idle (KAI's proposed min-max compute, issue 2191).

A session with compute limit ``c`` (a fraction in (0, 1]) has a bucket of GPU seconds:
at most ``c`` x :data:`WINDOW_S`, filled at ``c`` per second, spent by its GPU time (from
its swap-in's end). A grant's quantum ends by the time the bucket would run dry; at that
quantum's end it is revoked (reason ``compute_limit``) whether or not anyone waits, and
it is not granted again (others are, ahead of it) until the bucket holds :data:`REST_S`
of GPU time, or all of it when the bucket is smaller. Over a long run its share is ``c``;
over any window of :data:`WINDOW_S` it holds at most ``c`` x ``WINDOW_S`` plus one bucket.
The weight stays the compute request: what it gets beside others when the GPU is
contended. The bucket is the workload's (its pod, else its user and name: the node's
key), not one session's: its sessions spend from one bucket, and it outlives them until
it is full again, so detaching and attaching again starts no new one.
"""

from __future__ import annotations

import math

from gpushare.core.sessions import Bucket, SessionState, State
from gpushare.core.state import GpuState

WINDOW_S = 10.0  # the window a compute limit is kept over
REST_S = 0.5  # GPU seconds a capped session waits for before its next grant (at most its bucket)
EPS = 1e-9


def left(s: SessionState, now: float) -> float:
    """GPU seconds in its workload's bucket now (may be below 0 by a late yield's overrun)."""
    b = s.share.bucket
    return b.now(now) if b is not None else 0.0


def settle(s: SessionState, now: float) -> None:
    """The bucket brought up to ``now`` (at a grant and a release of any of its members)."""
    b = s.share.bucket
    if b is not None:
        b.left, b.at = b.now(now), now


def capped_quantum(s: SessionState, q: float, now: float) -> float:
    """``q`` cut to when the bucket runs dry while it holds (beside its workload's other
    holders, which spend from it too)."""
    b = s.share.bucket
    if b is None or b.cap >= 1.0:
        return q
    spenders = max(1, sum(1 for m in b.members if m.holding or m is s))
    return min(q, max(0.0, b.now(now)) / (spenders - b.cap))


def dry(s: SessionState, now: float) -> bool:
    """A holder whose bucket is spent: revoked at its quantum's end, even alone."""
    b = s.share.bucket
    return b is not None and b.cap < 1.0 and b.now(now) <= EPS


def ready_at(s: SessionState, now: float) -> float:
    """When a waiting capped session may be granted again (-inf: it may now; inf: not
    while another session of its workload holds, spending the bucket)."""
    b = s.share.bucket
    if b is None or b.cap >= 1.0:
        return -math.inf
    need = min(REST_S, b.cap * b.window)
    if b.now(now) >= need - EPS:
        return -math.inf
    if any(m.holding for m in b.members):
        return math.inf
    return b.at + (need - b.left) / b.cap


def resting(s: SessionState, now: float) -> bool:
    return s.state is State.WAITING and ready_at(s, now) > now


class Caps:
    """The queue's view of capped sessions, and each workload's bucket: its sessions
    share it, and it outlives them until it is full again (so detaching and attaching
    again gives a workload no new bucket). ``count`` of capped sessions attached keeps
    the scans off every decision where none is."""

    def __init__(self, st: GpuState) -> None:
        self.st = st
        self.count = 0
        self.buckets: dict[str, Bucket] = {}  # by workload, kept until full again

    def join(self, s: SessionState, workload: str, cap: float, now: float) -> None:
        """``s`` spends from its workload's bucket: the one its other sessions have (or
        their last left, not yet full again), at the lower of their limits and ``cap``;
        else, with a limit, a new full one."""
        for key in [k for k, b in self.buckets.items() if b.full(now)]:
            del self.buckets[key]  # as a new one would be: forgotten (bounded)
        b = self.buckets.get(workload) if workload else None
        if b is None and cap >= 1.0:
            return
        if b is None:
            b = Bucket(cap, cap * WINDOW_S, now, WINDOW_S)
            if workload:
                self.buckets[workload] = b
        else:
            b.left, b.at = b.now(now), now
            if cap < b.cap:
                b.cap, b.left = cap, min(b.left, cap * b.window)
        b.members.append(s)
        s.share.bucket = b
        self.count += 1

    def leave(self, s: SessionState, now: float) -> None:
        b = s.share.bucket
        if b is None:
            return
        b.left, b.at = b.now(now), now
        b.members.remove(s)
        s.share.bucket = None
        self.count -= 1

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
        n = sum(1 for s in self.st.sessions.values() if s.share.bucket is not None)
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
        times = (ready_at(ss[i], since) for i in self.st.queue)
        return [t for t in times if since < t < math.inf]

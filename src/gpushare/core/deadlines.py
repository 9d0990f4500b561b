"""Deadlines the arbiter keeps apart from its holders': swap-outs asked of non-holders,
and retries after a failed swap (trio's ``Deadlines`` does this job for its tasks).

Holders' quantum ends and revoke deadlines are few (the holders are few) and read from
them; these two sets can grow with the sessions attached, so they are kept where a
decision finds the earliest at once: the sessions with a swap-out deadline as a set, the
retries as a heap whose stale entries are dropped as they are read.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping

from gpushare.core.sessions import SessionState

SWAP_RETRY_S = 1.0  # a session whose swap failed is not asked again for this long


class Deadlines:
    def __init__(self) -> None:
        self.asked: set[int] = set()  # non-holders with a swap-out deadline
        # (swap_failed_until, session) of failed swaps, stale entries skipped as read
        self._retries: list[tuple[float, int]] = []
        # When the rules last ran: a retry due since is still to be acted on.
        self.advanced = -math.inf

    def set_swap_out(self, s: SessionState, when: float) -> None:
        """``s`` must have moved a byte of its swap-out by ``when`` (inf: none asked)."""
        s.esc.swap_out_deadline = when
        if math.isinf(when):
            self.asked.discard(s.id)
        else:
            self.asked.add(s.id)

    def swap_outs(self, sessions: Mapping[int, SessionState]) -> list[float]:
        return [sessions[i].esc.swap_out_deadline for i in self.asked]

    def overdue_swap_outs(self, sessions: Mapping[int, SessionState], now: float) -> list[int]:
        return [i for i in self.asked if sessions[i].esc.swap_out_deadline <= now]

    def retry_after_failure(
        self, s: SessionState, now: float, sessions: Mapping[int, SessionState]
    ) -> None:
        """Its swap failed (or did not start): not asked again for SWAP_RETRY_S."""
        s.esc.swap_failed_until = now + SWAP_RETRY_S
        self.next_retry(sessions)  # drop what has passed: the heap holds the last second's
        heapq.heappush(self._retries, (s.esc.swap_failed_until, s.id))

    def next_retry(self, sessions: Mapping[int, SessionState]) -> float | None:
        """The earliest swap_failed_until the rules have not yet run at or after, if any:
        one that has passed since is due now (a tick plans with it). Each session's
        latest is in the heap; older entries, those of sessions gone and those the rules
        ran after are skipped."""
        heap = self._retries
        while heap:
            t, sid = heap[0]
            s = sessions.get(sid)
            if t > self.advanced and s is not None and s.esc.swap_failed_until == t:
                return t
            heapq.heappop(heap)
        return None

    def forget(self, sid: int) -> None:
        self.asked.discard(sid)

    def verify(self, sessions: Mapping[int, SessionState]) -> list[str]:
        asked = {s.id for s in sessions.values() if not math.isinf(s.esc.swap_out_deadline)}
        if self.asked != asked:
            return [f"asked to swap out {self.asked}, scan {asked}"]
        return []

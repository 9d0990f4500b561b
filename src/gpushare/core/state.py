"""One GPU's state as every rule reads it: its sessions, its queue, its holders.

The arbiter (core/arbiter.py) owns one and hands it to each rule (core/shares.py,
core/window.py, core/turns.py, core/prefetch.py, core/gangs.py, core/claims.py,
core/escalation.py), as KAI Scheduler's actions and plugins share its session. The few
operations more than one rule needs live here: a session's memory set from what it says,
a swap-out asked, a wait ended.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from gpushare.core.actions import Outbox, SwapOutAction
from gpushare.core.checks import ArbiterError
from gpushare.core.clock import Clock
from gpushare.core.deadlines import Deadlines
from gpushare.core.events import SwapIn, SwapOut
from gpushare.core.ledger import Ledger
from gpushare.core.sessions import WAIT_BUCKETS, SessionState
from gpushare.settings import GpuSettings


@dataclass
class GpuState:
    gpu: int
    capacity: int  # usable bytes
    clock: Clock
    settings: GpuSettings
    out: Outbox
    ledger: Ledger
    deadlines: Deadlines = field(default_factory=Deadlines)
    sessions: dict[int, SessionState] = field(default_factory=dict)
    queue: deque[int] = field(default_factory=deque)
    holders: list[int] = field(default_factory=list)

    def now(self) -> float:
        return self.clock.monotonic()

    def get(self, sid: int) -> SessionState:
        try:
            return self.sessions[sid]
        except KeyError:
            raise ArbiterError(f"no session {sid} on GPU {self.gpu}") from None

    def used_bytes(self) -> int:
        return self.ledger.used

    def set_memory(self, s: SessionState, resident: int, swapped: int) -> None:
        """The figures, checked by the caller (before anything changed)."""
        m = s.memory
        # Bytes that left the GPU (swapped out as reported chunk by chunk, or freed) are
        # bytes no longer pending: a swap-out counts down as it goes.
        m.pending_out = max(0, min(m.pending_out - max(0, m.resident - resident), resident))
        if not m.pending_out:
            self.deadlines.set_swap_out(s, float("inf"))
        elif resident < m.resident and not s.holding:  # progress: a grace period more
            self.deadlines.set_swap_out(s, self.now() + self.settings.grace_s)
            s.esc.swap_escalated = False
        m.resident = resident
        m.swapped = swapped
        self.ledger.recount(s)

    def set_discarded(self, s: SessionState, n: int) -> None:
        """Discardable bytes it has dropped now (checked by the caller); those dropped
        since are counted. (No count: rebuilt at its grant, they are in its bound.)"""
        m = s.memory
        if n > m.discarded:
            s.totals.discarded_bytes += n - m.discarded
            m.dropping += n - m.discarded
        m.discarded = n

    def take_dropped(self, s: SessionState) -> int:
        """Drops counted since its last swap_out event, for the next one: a progress
        report mid-swap-out takes some of them before the swap ends, and the event log
        must add up to the totals."""
        n, s.memory.dropping = s.memory.dropping, 0
        return n

    def ask_swap_out(self, sid: int, n: int) -> None:
        s = self.sessions[sid]
        if not s.memory.pending_out or s.esc.swap_out_deadline == float("inf"):
            self.deadlines.set_swap_out(s, self.now() + self.settings.grace_s)
        s.memory.pending_out += n
        self.out.act(SwapOutAction(sid, n))

    def end_wait(self, s: SessionState, now: float) -> float:
        waited = now - s.lease.wait_start
        t = s.totals
        t.wait_s += waited
        t.wait_max_s = max(t.wait_max_s, waited)
        t.wait_counts[bisect.bisect_left(WAIT_BUCKETS, waited)] += 1
        t.recent_waits.append(waited)
        return waited

    def count_swap(
        self,
        s: SessionState,
        direction: str,
        nbytes: int,
        seconds: float,
        prefetch: bool = False,
        dropped: int = 0,
    ) -> None:
        t = s.totals
        if direction == "out":  # pending_out went down with resident (set_memory)
            t.swap_outs += 1
            t.swap_out_bytes += nbytes
            t.swap_out_s += seconds
        else:
            t.swap_ins += 1
            t.swap_in_bytes += nbytes
            t.swap_in_s += seconds
        swap = SwapOut if direction == "out" else SwapIn
        self.out.emit(
            swap(
                session=s.id,
                bytes=nbytes,
                seconds=seconds,
                prefetch=prefetch or None,
                discarded_bytes=dropped or None,
            )
        )

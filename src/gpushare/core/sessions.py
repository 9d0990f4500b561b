"""A session as the arbiter keeps it: its state, its memory and its running totals."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum

# Upper bounds (seconds) of the wait histogram's buckets; +Inf is implied.
WAIT_BUCKETS: tuple[float, ...] = (0.001, 0.01, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class State(StrEnum):
    IDLE = "idle"
    WAITING = "waiting"
    HOLDING = "holding"
    YIELDING = "yielding"


@dataclass
class SessionState:
    id: int
    name: str
    limit: int
    weight: float
    state: State = State.IDLE
    resident: int = 0
    swapped: int = 0
    pending_out: int = 0
    fills: bool = False  # its client can swap in chunk by chunk within a room
    room: int = 0  # while filling: the most it may have on the GPU (0: its limit)
    swapping_in: bool = False  # granted with bytes to bring back, not yet reported done
    lease: int = 0
    lease_start: float = 0.0
    quantum_end: float = 0.0
    revoke_deadline: float = 0.0
    escalated: bool = False
    wait_start: float = 0.0
    attached: float = 0.0  # monotonic
    frozen: bool = False  # stopped by the freeze escalation until its next grant
    swap_failed_until: float = 0.0
    over_limit: bool = False
    last_served: float = -math.inf
    # scheduling (docs/scheduling.md)
    prefetch: bool = False  # its client swaps in before its grant when the node says
    prefetch_room: int = 0  # while prefetching: the most it may have on the GPU
    prefetch_seq: int = 0  # the last Prefetch sent
    prefetch_acked: int = 0  # the last one its client said it is done with
    reserved: bool = False  # its quantum waits for it to ask again (anticipation)
    reserve_until: float = 0.0
    continued: bool = False  # asked again within its window: granted the rest of its quantum
    resume_s: float = 0.0  # a quantum paused by a turn: what is left of it
    front_until: float = 0.0  # paused while reserved: asks before this to resume it
    revoked_at: float = 0.0
    turn: bool = False  # waits for, or holds, an interactive turn
    credit: float = 0.0  # turn credit, seconds of GPU time
    idle_since: float = 0.0  # monotonic: when its last burst ended (or it attached)
    gap_ewma: float | None = None  # seconds from a burst's end to the next ask
    gap_last: float = 0.0
    burst_ewma: float | None = None  # GPU seconds per burst
    burst_lease: float = 0.0  # GPU seconds of the burst in progress
    quantum_len: float = 0.0  # this grant's quantum (GPU time, from its swap-in's end)
    gpu_since: float = math.inf  # holding: when its memory was back (its GPU time began)
    # GPU seconds it owes (held past earlier quanta), taken off later ones; negative: owed
    # to it (others held past theirs while it waited), added to later ones
    debt: float = 0.0
    owed_mark: float = 0.0  # the arbiter's owed total when it began to wait
    # Asked to swap out (pending_out > 0) as a non-holder: escalated if no byte has left
    # by this time (each one that leaves moves it on by a grace period).
    swap_out_deadline: float = math.inf
    swap_escalated: bool = False
    # It claimed a lease after a node restart that the node could not give back (not
    # verified, or another holds the GPU now): it was told to yield by revoke_deadline.
    yield_due: bool = False
    claim: int = 0  # during recovery: the verified lease it claims, granted at the end
    counted: int = 0  # its part of the arbiter's running total of used bytes (Arbiter._recount)
    # gangs (core/gangs.py)
    gang: str = ""  # the node's key of the job it is a rank of ("": none)
    parked: bool = False  # yielded to its gang's revoke; waits for its peers to yield too
    gang_held: bool = False  # its gang holds the GPU: counted at its limit, never a victim
    # totals
    lease_s: float = 0.0
    wait_s: float = 0.0  # completed waits
    wait_max_s: float = 0.0
    grants: int = 0
    bursts: int = 0
    revokes: int = 0
    escalations: int = 0
    turns: int = 0
    continues: int = 0  # grants that continued a quantum (asked again within the window)
    swap_outs: int = 0
    swap_ins: int = 0
    swap_out_bytes: int = 0
    swap_in_bytes: int = 0
    swap_out_s: float = 0.0
    swap_in_s: float = 0.0
    wait_counts: list[int] = field(default_factory=lambda: [0] * (len(WAIT_BUCKETS) + 1))
    recent_waits: deque[float] = field(default_factory=lambda: deque(maxlen=128))

    @property
    def holding(self) -> bool:
        return self.state in (State.HOLDING, State.YIELDING)

    @property
    def prefetching(self) -> bool:
        """A Prefetch is out that its client has not said it is done with."""
        return self.prefetch_acked < self.prefetch_seq

    @property
    def used(self) -> int:
        """What it may have on the GPU: a holder its limit (its room while filling), a
        session whose quantum waits for it its limit too, as does a rank whose gang holds
        (it may join at any time), a prefetching one its room, anyone else what is there
        now."""
        if self.holding:
            return self.room or self.limit
        if self.reserved or self.gang_held:
            return self.limit
        if self.swapping_in:  # frozen mid swap-in: all of it may have landed
            return self.resident + self.swapped
        if self.prefetching:
            return max(self.resident, self.prefetch_room)
        return self.resident

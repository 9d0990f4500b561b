"""A session as the arbiter keeps it: who it is, its state, and one record per rule.

Each record holds the figures one part of the core owns (docs/architecture.md, "The
core by rule"): :class:`Memory` the ledger's (core/ledger.py), :class:`Lease` the
arbiter's grants and revokes, :class:`Escalation` the deadlines' and escalation's
(core/deadlines.py, core/escalation.py, core/claims.py), :class:`Share` the quantum's, the
window's and the turns' (core/shares.py, core/window.py, core/turns.py),
:class:`Prefetch` core/prefetch.py's, :class:`Rank` core/gangs.py's and
core/families.py's, and
:class:`Totals` what is only counted, for status and metrics.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum

from gpushare.settings import SHARING_MODES

# Upper bounds (seconds) of the wait histogram's buckets; +Inf is implied.
WAIT_BUCKETS: tuple[float, ...] = (0.001, 0.01, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class State(StrEnum):
    IDLE = "idle"
    WAITING = "waiting"
    HOLDING = "holding"
    YIELDING = "yielding"


@dataclass
class Memory:
    """Its memory: the limit it is held to, the request it is packed by, what it has
    where, and what is on its way."""

    limit: int  # the most it may have on the GPU (memory_limit on the wire)
    # What the node guarantees and packs by in mode auto (memory_request), in bytes,
    # always filled in: at most the limit; constructed with 0 (none given), the limit.
    request: int = 0
    grows: bool = False  # its client asks (a need) before it has more than its bound
    # Holding: the most it may have without asking again (0: its limit). In mode auto a
    # growing client's grant lends what it asks, up to its limit (core/ledger.bound_for).
    bound: int = 0
    need: int = 0  # the room its ask named (an allocation past its bound), until granted
    lent: bool = False  # holding above its request on memory that was free: given back on demand
    resident: int = 0
    swapped: int = 0
    pending_out: int = 0  # asked to swap out, not yet gone
    fills: bool = False  # its client can swap in chunk by chunk within a room
    room: int = 0  # while filling: the most it may have on the GPU (0: its limit)
    swapping_in: bool = False  # granted with bytes to bring back, not yet reported done
    over_limit: bool = False  # escalated for this stretch over its limit
    over_bound: bool = False  # escalated for this stretch over its bound, not asked for
    counted: int = 0  # its part of the ledger's running total (Ledger.recount)
    discarded: int = 0  # discardable bytes it dropped: made again, empty, at its grant
    dropping: int = 0  # of those, dropped since its last swap_out event (counted there)
    reclaims: int = 0  # bursts given back (revoked for being above its request)
    reclaimed: int = 0  # bytes above its request it was asked to give back

    def __post_init__(self) -> None:
        # One sentinel per figure (issue 37): the request is never 0 once made.
        if not self.request:
            self.request = self.limit

    @property
    def held(self) -> int:
        """What it may have while it holds (its bound, else its limit)."""
        return self.bound or self.limit

    @property
    def guaranteed(self) -> int:
        """Its request: what it is packed by."""
        return self.request


@dataclass
class Lease:
    """Its lease, its quantum, and when it last waited or idled (monotonic seconds)."""

    number: int = 0  # the lease it holds (0: none)
    start: float = 0.0
    quantum_len: float = 0.0  # this grant's quantum (GPU time, from its swap-in's end)
    quantum_end: float = 0.0
    own_end: float = 0.0  # a turn's lease: when its own quantum ends (core/growth.py)
    gpu_since: float = math.inf  # holding: when its memory was back (its GPU time began)
    idle_release: float = 0.0  # what this grant told its implicit bursts' idle release is
    revoke_deadline: float = 0.0
    revoked_at: float = 0.0
    wait_start: float = 0.0
    idle_since: float = 0.0  # when its last burst ended (or it attached)
    last_served: float = -math.inf


@dataclass
class Escalation:
    """What it was asked and did not do, and what followed (docs/faults.md)."""

    escalated: bool = False  # this revoke's (or yield's) escalation was applied
    frozen: bool = False  # stopped by the freeze escalation until its next grant
    # Asked to swap out (pending_out > 0) as a non-holder: escalated if no byte has left
    # by this time (each one that leaves moves it on by a grace period).
    swap_out_deadline: float = math.inf
    swap_escalated: bool = False
    swap_failed_until: float = 0.0  # its last swap failed: not asked again until then
    # It claimed a lease after a node restart that the node could not give back (not
    # verified, or another holds the GPU now): it was told to yield by revoke_deadline.
    yield_due: bool = False
    claim: int = 0  # during recovery: the verified lease it claims, granted at the end


@dataclass
class Share:
    """Its share of GPU time (docs/scheduling.md 1, 3 and 4): the window its quantum waits
    for it, its interactive turns, and what it owes or is owed."""

    window: bool = False  # its quantum waits for it to ask again (1: the window)
    window_until: float = 0.0
    continued: bool = False  # asked again within its window: granted the rest of its quantum
    resume_s: float = 0.0  # a quantum paused by a turn: what is left of it
    front_until: float = 0.0  # paused while in its window: asks before this to resume it
    turn: bool = False  # waits for, or holds, an interactive turn (3)
    credit: float = 0.0  # turn credit, seconds of GPU time
    gap_ewma: float | None = None  # seconds from a burst's end to the next ask
    gap_last: float = 0.0
    # GPU seconds of its recent bursts, a burst that waited (held a backlog) counted at
    # most at the turn cap; their lower median is its usual burst (core/turns.py)
    bursts: deque[float] = field(default_factory=lambda: deque(maxlen=8))
    burst_lease: float = 0.0  # GPU seconds of the burst in progress
    served: bool = False  # its history took it for a server at its last burst's end
    chained: bool = False  # a turn of its went on in the next (core/turns.py went_on)
    asked_at: float = 0.0  # when the burst in progress asked
    held_mark: float = 0.0  # its lease seconds then (what the burst held is the rest)
    use_s: float = 0.0  # GPU seconds used, decayed (its measured use: use_s / use_span)
    use_span: float = 0.0  # seconds, decayed alike
    use_at: float = 0.0  # when both were last brought up to date
    windowless: bool = False  # its last burst ended with no quantum waiting for it
    # GPU seconds it owes (held past earlier quanta), taken off later ones; negative: owed
    # to it (others held past theirs while it waited), added to later ones (4)
    debt: float = 0.0
    owed_mark: float = 0.0  # the shares' owed total when it began to wait
    # Its workload's compute-limit bucket (core/caps.py), shared with its other sessions;
    # None: no limit.
    bucket: Bucket | None = None

    @property
    def cap(self) -> float:
        """Its compute limit: its bucket's (0: none)."""
        return self.bucket.cap if self.bucket is not None else 0.0


@dataclass(eq=False)
class Bucket:
    """A workload's compute-limit bucket (core/caps.py): ``left`` GPU seconds at ``at``,
    filled at ``cap`` per second up to ``cap`` x ``window``, spent by each of its
    ``members``' GPU time while it holds (from its swap-in's end)."""

    cap: float
    left: float
    at: float
    window: float
    members: list[SessionState] = field(default_factory=list)

    def now(self, now: float) -> float:
        """GPU seconds in it now (below 0 by a late yield's overrun)."""
        spent = sum(
            max(0.0, now - max(self.at, m.lease.gpu_since)) for m in self.members if m.holding
        )
        return min(self.cap * self.window, self.left + self.cap * (now - self.at) - spent)

    def full(self, now: float) -> bool:
        """No session spends from it, and it has filled up again: as a new one would be."""
        return not self.members and self.now(now) >= self.cap * self.window - 1e-9


@dataclass
class Prefetch:
    """Swapping in ahead of its grant (docs/scheduling.md 2)."""

    enabled: bool = False  # its client swaps in before its grant when the node says
    room: int = 0  # while prefetching: the most it may have on the GPU
    seq: int = 0  # the last Prefetch sent
    acked: int = 0  # the last one its client said it is done with

    @property
    def active(self) -> bool:
        """A Prefetch is out that its client has not said it is done with."""
        return self.acked < self.seq

    def moot(self) -> None:
        """Whatever was asked is done with (a grant, the end of a wait)."""
        self.acked, self.room = self.seq, 0


@dataclass
class Rank:
    """Its place in a distributed job (docs/scheduling.md 5, core/gangs.py)."""

    gang: str = ""  # the node's key of the job it is a rank of ("": none)
    parked: bool = False  # yielded to its gang's revoke; waits for its peers to yield too
    held: bool = False  # its gang holds the GPU: counted at its limit, never a victim
    # A process of session ``family``'s (core/families.py: 0, none): its memory came from
    # that session's limit, and goes back to it when it detaches.
    family: int = 0
    took: int = 0  # of that session's memory request, given back with its limit


@dataclass
class Totals:
    """Running totals since it attached: counted, never decided on."""

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
    discarded_bytes: int = 0  # dropped instead of swapped out (discardable memory)
    swap_out_s: float = 0.0
    swap_in_s: float = 0.0
    wait_counts: list[int] = field(default_factory=lambda: [0] * (len(WAIT_BUCKETS) + 1))
    recent_waits: deque[float] = field(default_factory=lambda: deque(maxlen=128))


@dataclass
class SessionState:
    id: int
    name: str
    weight: float
    memory: Memory
    attached: float = 0.0  # monotonic
    sharing: str = ""  # its pod's compute-sharing mode (SHARING_MODES; "": the GPU's mode)
    state: State = State.IDLE
    lease: Lease = field(default_factory=Lease)
    esc: Escalation = field(default_factory=Escalation)
    share: Share = field(default_factory=Share)
    prefetch: Prefetch = field(default_factory=Prefetch)
    rank: Rank = field(default_factory=Rank)
    totals: Totals = field(default_factory=Totals)

    @property
    def holding(self) -> bool:
        return self.state in (State.HOLDING, State.YIELDING)

    @property
    def used(self) -> int:
        """What it may have on the GPU: a holder its bound (its limit, unless a growing
        client's grant lent less; its room while filling), a session whose quantum waits
        for it its bound too, a rank whose gang holds its limit (it may join at any
        time), a prefetching one its room, anyone else what is there now."""
        m = self.memory
        if self.holding:
            return m.room or m.held
        if self.share.window:
            return m.held
        if self.rank.held:
            return m.limit
        if m.swapping_in:  # frozen mid swap-in: all of it may have landed (or been made)
            return m.resident + m.swapped + m.discarded
        if self.prefetch.active:
            return max(m.resident, self.prefetch.room)
        return m.resident

    def mode_of(self, gpu_mode: str) -> str:
        """The mode this session is in: its pod's compute-sharing mode, else the GPU's."""
        return SHARING_MODES.get(self.sharing, gpu_mode) if self.sharing else gpu_mode

    def expected_back(self, now: float) -> bool:
        """Idle, and it usually asks again soon (within twice its usual gap)."""
        g = self.share.gap_ewma
        return (
            self.state is State.IDLE
            and g is not None
            and now - self.lease.idle_since < max(2 * g, 1e-3)
        )

"""The arbiter: who holds each GPU, who waits, when a quantum ends, who swaps what.

Pure logic with no I/O: every input is a method call, every decision comes back as a
list of actions (messages for workloads, events for the log), and time is read from an
injected :class:`~gpushare.core.clock.Clock`. The daemon, the tests and the simulators drive
this same code. The rules are those of DESIGN.md "Arbitration rules".
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections import Counter, deque
from typing import Any, Literal

from gpushare.core.actions import (
    Action,
    EscalateAction,
    EventAction,
    GrantAction,
    PrefetchAction,
    RevokeAction,
    RoomAction,
    SwapOutAction,
    ThawAction,
)
from gpushare.core.clock import Clock
from gpushare.core.gangs import REGROUP_S, Gang, Peers
from gpushare.core.planner import MemoryView, plan_grant, take_from
from gpushare.core.sessions import WAIT_BUCKETS, SessionState, State
from gpushare.settings import Change, Escalation, GpuSettings, SettingsError, validate
from gpushare.units import format_size

SWAP_RETRY_S = 1.0  # a session whose swap failed is not asked again for this long
# A quantum is GPU time: it starts when the swap-in is done. A swap-in slower than this
# (bytes/s) is taken for stuck, so the quantum starts anyway and a revoke can follow.
SWAP_FLOOR_BPS = 1e9
# A session's weight (its share under policy weighted) lies in these bounds: finite, and
# no quantum more than a million times another's.
MIN_WEIGHT, MAX_WEIGHT = 1e-3, 1e3
MAX_SECONDS = 1e6  # a swap reported longer than this (11 days) is not a measurement
MAX_ERROR = 1024  # characters of a failed swap's error text
# docs/scheduling.md has the rules these figures belong to.
ANTICIPATE_FLOOR_S = 0.05  # the shortest wait of a quantum for its holder to ask again
EWMA = 0.3  # weight of the newest sample in a session's gap and burst averages
TURN_MIN_S = 0.02  # a turn shorter than this is not worth its two switches
RESUME_MIN_S = 0.01  # less left of a paused quantum than this: not resumed
# Deficit accounting (docs/scheduling.md, 4): a quantum pays back at most this much of
# itself in debt (a grant that costs a switch still works a quarter of it), and gets at
# most one quantum more from what others owe it; what a session owes beyond what its next
# quantum can pay goes to those waiting, as credit; stored credit is kept up to this many
# of its quanta.
PAYBACK = 0.75
CREDIT_QUANTA = 2.0
PREFETCH_STEP = 2**30  # a prefetch asks for at least this much (or all that is left)


class ArbiterError(ValueError):
    """An input that is not valid in the session's current state. Raised before anything
    changes: a refused input leaves the arbiter as it was."""

    code = "state"


class FieldError(ArbiterError):
    """A figure the node knows to be wrong (negative, beyond the session's limit or the
    GPU, not finite); the message names the field."""

    code = "value"


def _count(what: str, value: object, most: int) -> int:
    """A whole number of bytes in [0, most], or :class:`FieldError` naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= most:
        raise FieldError(f"{what} must be a whole number of bytes in [0, {most}], not {value!r}")
    return value


def _seconds(what: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise FieldError(f"{what} must be a number of seconds, not {value!r}")
    if not 0 <= value <= MAX_SECONDS:  # NaN fails too
        raise FieldError(f"{what} must be a number of seconds in [0, {MAX_SECONDS:g}], not {value}")
    return float(value)


def check_weight(weight: object) -> float:
    """A weight within [MIN_WEIGHT, MAX_WEIGHT], or :class:`FieldError`."""
    if isinstance(weight, bool) or not isinstance(weight, int | float):
        raise FieldError(f"weight must be a number, not {weight!r}")
    if not MIN_WEIGHT <= weight <= MAX_WEIGHT:  # NaN fails too
        raise FieldError(
            f"weight must be a number in [{MIN_WEIGHT:g}, {MAX_WEIGHT:g}], not {weight}"
        )
    return float(weight)


class Arbiter:
    """Decisions for one GPU of ``capacity`` usable bytes.

    Its cost per input does not grow with the sessions attached: what the rules need of
    all of them is kept as running totals (counted memory: :meth:`_recount`; the largest
    weight; the swap-retry times as a heap), and the planner runs only when the fast
    path fails. :meth:`verify` checks each against a scan of every session; with
    ``check_every_input`` set (the tests set it) it runs after every input.
    """

    check_every_input = False

    def __init__(
        self,
        gpu: int,
        capacity: int,
        clock: Clock,
        settings: GpuSettings | None = None,
        lease_base: int = 0,
    ) -> None:
        if capacity <= 0:
            raise ValueError("GPU capacity must be positive")
        self.gpu = gpu
        self.capacity = capacity
        self.clock = clock
        self.settings = settings or GpuSettings()
        self.sessions: dict[int, SessionState] = {}
        self.queue: deque[int] = deque()
        self.holders: list[int] = []
        self._lease_seq = lease_base  # leases are numbered on from the last node's
        self.reserved: int | None = None  # the session whose quantum waits for it to ask
        self.grants_total = 0  # on this GPU since the node started, sessions gone included
        self.gangs: dict[str, Gang] = {}  # by the node's key (core/gangs.py)
        self._revoked_gangs: set[str] = set()
        # The node's other GPUs, for gangs with ranks on several (core/coordinator.py).
        self.peers: Peers | None = None
        self._out: list[Action] = []
        # After a node restart, until the sessions it knew are back: nothing is granted.
        self.recovering = False
        self._asked: set[int] = set()  # non-holders with a swap-out deadline
        self._told: set[int] = set()  # told to yield a lease they claimed (yield_due)
        self._blocking: set[int] = set()  # of those, the verified: nothing granted meanwhile
        self._frozen_idle: set[int] = set()  # frozen outside the queue (thawed at a grant)
        self._used = 0  # the sum of every session's counted memory (SessionState.counted)
        self._weights: Counter[float] = Counter()  # the attached sessions' weights
        self._top_weight = 0.0  # max(self._weights), 0 when it must be found again
        # GPU seconds per unit of weight share owed to every session waiting, by holders
        # that held past their quanta more than their next ones can pay back: a waiting
        # session's credit is its share times the growth since it began to wait (O(1)).
        self._owed = 0.0
        # (swap_failed_until, session) of failed swaps, stale entries skipped as read
        self._retries: list[tuple[float, int]] = []
        # When the rules last ran (_advance): a retry due since is still to be acted on.
        self._advanced = -math.inf

    # --- inputs ---------------------------------------------------------------------

    def attach(
        self,
        sid: int,
        *,
        name: str,
        limit: int,
        weight: float = 1.0,
        resident: int = 0,
        swapped: int = 0,
        holding: bool = False,
        lease: int = 0,
        verified: bool = False,
        fills: bool = False,
        prefetch: bool = False,
        gang: str = "",
        gang_size: int = 0,
        spans_nodes: bool = False,
    ) -> list[Action]:
        """A new session; ``resident``/``swapped``/``holding`` re-register a workload that
        outlived a node restart (it keeps its memory and, mid-burst, says it holds lease
        ``lease``). The lease is given back only when ``verified`` (the node matched the
        session to its record and checked the lease's token) and the rules allow it (after
        the recovery window, if one is open); any other claim is told to yield (a revoke
        for ``lease``), and escalated like a holder's if it does not within the grace
        period. ``fills``: its client can swap in within a room, so its swap-in may
        overlap another's swap-out; ``prefetch``: it swaps in ahead of its grant when
        told. ``gang``: the node's key of the distributed job it is a rank of
        (``gang_size`` ranks on the node, as its client says; ``spans_nodes``: it has
        ranks elsewhere too)."""
        if sid in self.sessions:
            raise ArbiterError(f"session {sid} is already attached")
        if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
            raise FieldError(f"memory_limit must be a positive number of bytes, not {limit!r}")
        if limit > self.capacity:
            raise FieldError(
                f"memory limit {format_size(limit)} is more than GPU {self.gpu}'s usable"
                f" {format_size(self.capacity)}: ask for {format_size(self.capacity)} or less"
            )
        weight = check_weight(weight)
        _count("resident", resident, limit)
        _count("swapped", swapped, limit)
        if resident + swapped > limit:
            raise FieldError(
                f"resident + swapped ({resident} + {swapped} bytes) exceed the memory limit"
                f" of {limit} bytes"
            )
        _count("lease", lease, 2**63 - 1)
        if self.used_bytes() + resident > self.capacity:
            raise FieldError(
                f"resident: {resident} bytes do not fit beside the {self.used_bytes()} bytes"
                f" in use on GPU {self.gpu} ({self.capacity} usable)"
            )
        g = self.gangs.get(gang) if gang else None
        if gang:
            self._check_gang(gang, g, limit, spans_nodes)
        s = SessionState(
            id=sid,
            name=name,
            limit=limit,
            weight=weight,
            attached=self.clock.monotonic(),
            fills=fills,
            prefetch=prefetch,
            idle_since=self.clock.monotonic(),
            credit=self.settings.turn_s,  # a notebook's first cell after it is a turn
        )
        self._set_memory(s, resident, swapped)
        self.sessions[sid] = s
        self._weigh(weight, 1)
        if gang:
            if g is None:
                g = self.gangs[gang] = Gang(gang)
            g.members.add(sid)
            g.size, g.spans_nodes = max(g.size, gang_size), g.spans_nodes or spans_nodes
            s.gang = gang
        resumed = bool(resident or swapped or holding)
        self._event(
            "attach",
            sid,
            name=name,
            limit_bytes=limit,
            weight=weight,
            resumed=resumed,
            resident_bytes=resident,
            swapped_bytes=swapped,
            **({"gang": gang, "gang_size": gang_size, "spans_nodes": spans_nodes} if gang else {}),
        )
        if holding:  # it was working when the node went away
            s.bursts += 1
            self._enqueue(s)
            if not (verified and lease):
                self._tell_to_yield(s, lease, verified=False)
            elif self.recovering:
                s.claim = lease  # granted back at the window's end, if the rules allow
            else:
                self._resume_or_yield(s, lease)
        return self._advance()

    def begin_recovery(self) -> None:
        """A node restarted: grant nothing until :meth:`end_recovery` (the sessions it
        knew are back, or the window ended). Leases claimed meanwhile wait for the end."""
        self.recovering = True

    def end_recovery(self) -> list[Action]:
        """The recovery window ends: the verified claims get their leases back, the most
        recent lease first, as far as the rules allow; the others are told to yield."""
        if not self.recovering:
            return []
        self.recovering = False
        for s in sorted(
            (s for s in self.sessions.values() if s.claim), key=lambda s: s.claim, reverse=True
        ):
            lease, s.claim = s.claim, 0
            self._resume_or_yield(s, lease)
        return self._advance()

    def _resume_or_yield(self, s: SessionState, lease: int) -> None:
        """A verified claim (``s`` is queued): its lease back if the mode and memory allow,
        else a revoke."""
        others = self.used_bytes() - s.used
        if self._may_join_holders() and others + s.limit <= self.capacity:
            self.queue.remove(s.id)
            self.queue.appendleft(s.id)
            self._grant(s, resume=True)
        else:
            self._tell_to_yield(s, lease, verified=True)

    def _tell_to_yield(self, s: SessionState, lease: int, verified: bool) -> None:
        """It says it works on the GPU without a lease this node gives it: it is told to
        yield (its release answers), and past the grace period escalated. A verified
        claim (a lease a node did grant it) may be true: nothing more is granted on this
        GPU until it has yielded. An unverified one is not believed: it blocks no one."""
        s.yield_due, s.claim, s.escalated = True, 0, False
        s.revoke_deadline = self.clock.monotonic() + self.settings.grace_s
        s.revokes += 1
        self._told.add(s.id)
        if verified:
            self._blocking.add(s.id)
        self._event("revoke", s.id, lease=lease, reason="claim_not_honoured", swap_out_bytes=0)
        self._out.append(RevokeAction(s.id, lease, 0, self.settings.grace_s))

    def _clear_yield(self, s: SessionState) -> None:
        s.yield_due = False
        self._told.discard(s.id)
        self._blocking.discard(s.id)

    def detach(self, sid: int, *, reason: str = "closed") -> list[Action]:
        s = self._get(sid)
        now = self.clock.monotonic()
        if s.holding:  # its lease ends with it: a release, for whoever counts leases
            held = now - s.lease_start
            s.lease_s += held
            self.holders.remove(sid)
            self._event("release", sid, lease=s.lease, seconds=held, reason=reason)
        elif s.state is State.WAITING:
            self._end_wait(s, now)
            self.queue.remove(sid)
        if s.reserved:
            self._unreserve(s)
        del self.sessions[sid]
        self._asked.discard(sid)
        self._told.discard(sid)
        self._blocking.discard(sid)
        self._frozen_idle.discard(sid)
        self._recount(s, gone=True)
        self._weigh(s.weight, -1)
        if s.gang:
            g = self.gangs[s.gang]
            g.members.discard(sid)
            if not g.members:
                del self.gangs[s.gang]
                self._revoked_gangs.discard(s.gang)
        self._event("detach", sid, reason=reason, freed_bytes=s.resident)
        return self._advance()

    def acquire(self, sid: int) -> list[Action]:
        s = self._get(sid)
        if s.state is not State.IDLE:
            raise ArbiterError(f"session {sid} already has a burst open ({s.state})")
        now = self.clock.monotonic()
        s.bursts += 1
        idle = now - s.idle_since
        if s.bursts > 1:  # a gap between two bursts (not attach to the first)
            s.gap_last = min(idle, 2 * self.settings.anticipate_s)
            s.gap_ewma = s.gap_last if s.gap_ewma is None else _ewma(s.gap_ewma, s.gap_last)
        self._expire_reservation(now)  # a window that passed while nobody waited
        if s.reserved:  # back within its window: the rest of its quantum, at once
            self._unreserve(s)
            s.continued = True
            self._enqueue(s, front=True)
            return self._advance()
        rate = self.settings.turn_share * self._weight_share(s)
        s.credit = min(self.settings.turn_s, s.credit + rate * idle)
        if s.resume_s and now < s.front_until:  # its quantum was paused by a turn
            self._enqueue(s, front=True)
        elif self._may_take_turn(s, idle, now):
            s.turn = True
            self._enqueue(s, front=True)
        else:
            s.resume_s = 0.0
            self._enqueue(s)
        if s.gang and self.gangs[s.gang].revoked:
            # Its gang is yielding: a new ask waits as a parked member does (until the gang
            # has yielded, or the regroup), else ranks that take turns asking keep a revoked
            # gang holding for ever (seen: two processes of one GPUSHARE_GANG).
            g = self.gangs[s.gang]
            s.parked = True
            g.regroup_at = min(g.regroup_at, now + REGROUP_S)
        return self._advance()

    def release(
        self,
        sid: int,
        *,
        resident: int,
        swapped: int,
        again: bool = False,
        swapped_out: int = 0,
        seconds: float = 0.0,
        swapping_out: int = 0,
    ) -> list[Action]:
        """The burst ended, or the holder yielded (``again``). ``swapped_out`` bytes went
        on the way (older clients); ``swapping_out`` bytes are going now, after the release,
        reported as they go (:meth:`report`) and when done (:meth:`swap_done`): the GPU work
        has stopped, so the next holder's swap-in may overlap that swap-out."""
        s = self._get(sid)
        now = self.clock.monotonic()
        self._check_figures(s, "release", resident, swapped)
        _count("release: swapping_out", swapping_out, s.limit)
        _count("release: swapped_out", swapped_out, s.limit)
        _seconds("release: seconds", seconds)
        if s.state is State.WAITING and not again:
            # The burst ended before it was granted (the workload gave up waiting), or
            # the burst whose lease it claimed ended (the answer to the yield it was told).
            self.queue.remove(sid)
            self._end_wait(s, now)
            s.state, s.claim = State.IDLE, 0
            self._clear_yield(s)
            s.idle_since = now
            s.turn, s.resume_s, s.continued = False, 0.0, False
            s.debt = max(s.debt, 0.0)  # no credit banked while idle (a debt stays)
            s.prefetch_acked, s.prefetch_room = s.prefetch_seq, 0
            self._set_memory(s, resident, swapped)
            return self._advance()
        if s.state is State.WAITING and (s.frozen or s.yield_due):
            # The answer to a revoke that crossed the freeze, or to the yield it was told:
            # it waits already; keep the figures of what it swapped out on the way.
            if swapped_out:
                self._count_swap(s, "out", swapped_out, seconds)
            if s.yield_due:  # it worked until now: its wait begins, behind the others
                self._clear_yield(s)
                self.queue.remove(sid)
                self.queue.append(sid)
                s.wait_start = now
            self._set_memory(s, resident, swapped)
            return self._advance()
        if not s.holding:
            raise ArbiterError(f"session {sid} holds no lease to release ({s.state})")
        revoked = s.state is State.YIELDING
        held = now - s.lease_start
        s.lease_s += held
        s.burst_lease += max(0.0, now - s.gpu_since)  # GPU time: after the swap-in
        self.holders.remove(sid)
        turn = s.turn
        # An older client swapped out before it released: that copy is no GPU time.
        self._settle_quantum(s, now - (seconds if swapped_out else 0.0), revoked)
        if swapped_out:
            self._count_swap(s, "out", swapped_out, seconds)
        # The release answers the revoke's ask, whatever was done: what is still missing
        # is planned anew, so a short answer cannot leave the queue waiting on bytes.
        s.pending_out = 0
        s.room = 0
        s.swapping_in = False  # what it has is what it says now
        self._set_memory(s, resident, swapped)
        s.pending_out = min(swapping_out, s.resident)
        if s.pending_out:  # swapping out after the release, as a non-holder: a deadline
            self._set_swap_deadline(s, now + self.settings.grace_s)
        reason = "revoked" if revoked else ("yield" if again else "burst_end")
        lease, s.lease = s.lease, 0
        s.escalated = False
        window = 0.0
        if again:
            self._enqueue(s, front=s.resume_s > 0)  # paused by a turn: it goes on next
            if revoked and s.gang:  # its gang holds the GPU until every member yields
                s.parked = True
                g = self.gangs[s.gang]
                g.regroup_at = min(g.regroup_at, now + REGROUP_S)
        else:
            s.state = State.IDLE
            s.idle_since = now
            s.resume_s = 0.0
            s.debt = max(s.debt, 0.0)  # no credit banked while idle (a debt stays)
            s.burst_ewma = (
                s.burst_lease if s.burst_ewma is None else _ewma(s.burst_ewma, s.burst_lease)
            )
            s.burst_lease = 0.0
            self._recount(s)
            if not revoked and not turn:
                window = self._anticipation(s, now)
        fields: dict[str, Any] = {"anticipate_s": window} if window else {}
        self._event("release", sid, lease=lease, seconds=held, reason=reason, **fields)
        if window:
            self._reserve(s, now + window)
        return self._advance()

    def swap_done(
        self,
        sid: int,
        *,
        direction: Literal["in", "out"],
        nbytes: int,
        seconds: float,
        resident: int,
        swapped: int,
        error: str = "",
        prefetch: int = 0,
    ) -> list[Action]:
        """A swap ended (or failed: ``error``). ``prefetch``: the swap-in was the
        prefetch asked by that :class:`PrefetchAction` (its ``seq``), and the client is
        done with every ask up to it."""
        s = self._get(sid)
        if direction not in ("in", "out"):
            raise FieldError(f"swap_done: direction must be in or out, not {direction!r}")
        _count("swap_done: bytes", nbytes, s.limit)
        _seconds("swap_done: seconds", seconds)
        _count("swap_done: prefetch", prefetch, 2**63 - 1)
        if prefetch and (direction != "in" or prefetch > s.prefetch_seq):
            raise ArbiterError(f"no prefetch {prefetch} was asked of session {sid}")
        self._check_figures(s, "swap_done", resident, swapped)
        if len(error) > MAX_ERROR:
            raise FieldError(
                f"swap_done: error is {len(error)} characters, the most is {MAX_ERROR}"
            )
        if error:
            if direction == "out" or prefetch:
                if direction == "out":
                    s.pending_out = 0  # the planner will look for another way
                    self._set_swap_deadline(s, math.inf)
                s.swap_failed_until = self.clock.monotonic() + SWAP_RETRY_S
                self._retry_at(s)
            self._event(f"swap_{direction}", sid, bytes=0, seconds=seconds, error=error)
        elif prefetch:
            self._count_swap(s, direction, nbytes, seconds, prefetch=True)
        else:
            self._count_swap(s, direction, nbytes, seconds)
        if prefetch:
            if prefetch == s.prefetch_seq:  # no later ask is out: counted at what it has
                s.prefetch_acked, s.prefetch_room = prefetch, 0
        elif direction == "in":
            s.swapping_in = False
            if s.state is State.HOLDING:
                # The quantum is GPU time: it starts once the memory is back (or the
                # swap-in failed, and the workload gives the lease back).
                s.gpu_since = self.clock.monotonic()
                s.quantum_end = s.gpu_since + s.quantum_len
        self._set_memory(s, resident, swapped)
        return self._advance()

    def report(self, sid: int, *, resident: int, swapped: int) -> list[Action]:
        """The session's memory now. Resident bytes over its limit are the workload's own
        word that it broke the limit: escalated (once per stretch), the figures the node
        keeps unchanged."""
        s = self._get(sid)
        _count("report: resident", resident, 2**63 - 1)
        _count("report: swapped", swapped, s.limit)
        if resident > s.limit:
            self._check_limit(s, resident, "resident_bytes")
            return self._advance()
        self._check_figures(s, "report", resident, swapped)
        self._set_memory(s, resident, swapped)
        self._check_limit(s, resident, "resident_bytes")
        return self._advance()

    def over_limit(self, sid: int, *, used: int) -> list[Action]:
        """The GPU itself (NVML) says the session uses ``used`` bytes."""
        s = self._get(sid)
        _count("used", used, 2**63 - 1)
        self._check_limit(s, used, "used_bytes")
        return self._advance()

    def _check_figures(self, s: SessionState, what: str, resident: int, swapped: int) -> None:
        """A session's memory as it says it: bytes, together within its limit, and for a
        session without a lease (which cannot allocate) no more than the GPU has room for."""
        _count(f"{what}: resident", resident, s.limit)
        _count(f"{what}: swapped", swapped, s.limit)
        if resident + swapped > s.limit:
            raise FieldError(
                f"{what}: resident + swapped ({resident} + {swapped} bytes) exceed the"
                f" session's memory limit of {s.limit} bytes"
            )
        if not s.holding and resident > s.used:
            others = self.used_bytes() - s.used
            if others + resident > self.capacity:
                raise FieldError(
                    f"{what}: resident {resident} bytes do not fit beside the {others} bytes"
                    f" in use on GPU {self.gpu} ({self.capacity} usable) without a lease"
                )

    def _check_limit(self, s: SessionState, used: int, what: str) -> None:
        """Escalate once per stretch over the limit."""
        if used > s.limit and not s.over_limit:
            s.over_limit = True
            self._escalate(s, "over_memory_limit", {what: used, "limit_bytes": s.limit})
        elif used <= s.limit:
            s.over_limit = False

    def _escalate(
        self,
        s: SessionState,
        reason: str,
        fields: dict[str, Any],
        action: Escalation | None = None,
    ) -> Escalation:
        esc = action or self.settings.escalation
        s.escalations += 1
        self._event("escalate", s.id, reason=reason, action=esc, **fields)
        self._out.append(EscalateAction(s.id, esc, reason))
        return esc

    def set_config(self, change: Change) -> list[Action]:
        """A live change of this GPU's settings (any keys of :class:`Change`): TQ, mode,
        policy and escalation from the next quantum, the others from the next decision;
        a quantum running now that the change makes shorter ends no later than its start
        plus its new length (a longer one keeps its end). Every value is checked first:
        one bad value changes nothing. One ``config`` event names what was set."""
        try:
            changes = validate(**change)
        except SettingsError as e:
            raise ArbiterError(str(e)) from None
        # The quanta running now (and one waiting for its holder to ask again); a turn's
        # length is the turn's, not TQ's.
        ids = [*self.holders, *(() if self.reserved is None else (self.reserved,))]
        running = {sid: self.quantum(self.sessions[sid]) for sid in ids}
        for key, value in changes.items():
            setattr(self.settings, key, value)
        for sid, before in running.items():
            s = self.sessions[sid]
            cut = before - self.quantum(s)
            if cut > 0 and s.state is not State.YIELDING and not s.turn:
                if not math.isinf(s.quantum_end):
                    s.quantum_end -= cut
                s.quantum_len = max(0.0, s.quantum_len - cut)
        if changes:
            self._event("config", None, **changes)
        return self._advance()

    def tick(self) -> list[Action]:
        """Let time pass: quanta end, grace periods run out."""
        return self._advance()

    # --- queries --------------------------------------------------------------------

    def next_deadline(self) -> float | None:
        """When :meth:`tick` next has something to do (monotonic seconds), if ever."""
        times = self._holder_deadlines()
        if self.queue or any(self.sessions[h].room for h in self.holders):
            # a plan (or a filling holder) waiting on a failed swap: look again at retry
            retry = self._next_retry()
            if retry is not None:
                times.append(retry)
        return min(times, default=None)

    def _holder_deadlines(self) -> list[float]:
        """Every deadline but the swap retries' (those are kept in a heap)."""
        times = []
        for sid in self.holders:
            s = self.sessions[sid]
            if s.state is State.HOLDING:
                if not math.isinf(s.quantum_end):  # a filling holder's quantum waits
                    times.append(s.quantum_end)
            elif not s.escalated:
                times.append(s.revoke_deadline)
        # non-holders: a swap-out asked of them, a claimed lease they were told to yield
        times += [self.sessions[i].swap_out_deadline for i in self._asked]
        times += [
            self.sessions[i].revoke_deadline for i in self._told if not self.sessions[i].escalated
        ]
        if self.reserved is not None and self.queue:  # nobody waits: nothing to do then
            times.append(self.sessions[self.reserved].reserve_until)
        for key in self._revoked_gangs:  # parked members go on to their next safe point
            if not math.isinf(self.gangs[key].regroup_at):
                times.append(self.gangs[key].regroup_at)
        return times

    def quantum(self, s: SessionState) -> float:
        tq = self.settings.tq_s
        if self.settings.policy == "weighted":
            return tq * s.weight / self._largest_weight()
        return tq

    @property
    def last_lease(self) -> int:
        """The number of the last lease granted (leases are numbered on across restarts)."""
        return self._lease_seq

    def _largest_weight(self) -> float:
        if not self._top_weight:
            self._top_weight = max(self._weights)
        return self._top_weight

    def lease_seconds(self, s: SessionState) -> float:
        live = self.clock.monotonic() - s.lease_start if s.holding else 0.0
        return s.lease_s + live

    def wait_seconds(self, s: SessionState) -> float:
        live = self.clock.monotonic() - s.wait_start if s.state is State.WAITING else 0.0
        return s.wait_s + live

    def used_bytes(self) -> int:
        """Bytes the GPU must be able to hold now (holders at their limits, or at their
        rooms while filling)."""
        return self._used

    def verify(self) -> None:
        """Check the running totals against scans of every session (O(sessions): for
        tests, and for ``check_every_input``); AssertionError names the first that
        differs (raised, not asserted: it holds under ``python -O`` too)."""

        def check(ok: bool, what: str) -> None:
            if not ok:
                raise AssertionError(f"GPU {self.gpu}: {what}")

        for s in self.sessions.values():
            check(s.counted == s.used, f"session {s.id} counted {s.counted}, uses {s.used}")
        scan = sum(s.used for s in self.sessions.values())
        check(self._used == scan, f"used bytes: running total {self._used}, scan {scan}")
        weights = Counter(s.weight for s in self.sessions.values())
        check(self._weights == weights, f"weights {dict(self._weights)}, scan {dict(weights)}")
        top = max(weights, default=0.0)
        check(self._top_weight in (0.0, top), f"largest weight {self._top_weight}, scan {top}")
        asked = {s.id for s in self.sessions.values() if not math.isinf(s.swap_out_deadline)}
        check(self._asked == asked, f"asked to swap out {self._asked}, scan {asked}")
        told = {s.id for s in self.sessions.values() if s.yield_due}
        check(self._told == told, f"told to yield {self._told}, scan {told}")
        check(self._blocking <= told, f"blocking {self._blocking}, told {told}")
        reserved = [s.id for s in self.sessions.values() if s.reserved]
        kept_r = [] if self.reserved is None else [self.reserved]
        check(reserved == kept_r, f"quantum waiting for {kept_r}, scan {reserved}")
        times = self._holder_deadlines()
        if self.queue or any(self.sessions[h].room for h in self.holders):
            now = self._advanced  # retries due since the rules last ran are due still
            times += [
                s.swap_failed_until for s in self.sessions.values() if s.swap_failed_until > now
            ]
        scanned, kept = min(times, default=None), self.next_deadline()
        check(kept == scanned, f"next deadline {kept}, scan {scanned}")

    # --- the rules ------------------------------------------------------------------

    def _advance(self) -> list[Action]:
        now = self.clock.monotonic()
        self._advanced = now  # the plans below see every retry due by now
        if self._asked or self._told:
            self._overdue(now)
        self._expire_reservation(now)
        if self.reserved is not None and self.queue and self.sessions[self.queue[0]].turn:
            self._pause_reserved(self.sessions[self.reserved], now)
        self._grant_what_fits()
        self._preempt_for_turn(now)
        self._fill_rooms()
        for sid in list(self.holders):
            s = self.sessions[sid]
            if s.state is State.HOLDING and s.quantum_end <= now:
                if self._others_wait(s):
                    self._revoke(s, now)
                else:  # nobody waits: a new quantum, no needless switch
                    if s.turn:  # the turn is over; it holds on as anyone would
                        s.turn, s.credit = False, 0.0
                    s.quantum_len = self.quantum(s)
                    s.quantum_end = now + s.quantum_len
            elif s.state is State.YIELDING and not s.escalated and s.revoke_deadline <= now:
                s.escalated = True
                fields: dict[str, Any] = {"grace_s": self.settings.grace_s}
                if s.gang:  # the gang as a whole: all its members still holding, once
                    self.gangs[s.gang].escalated = True
                    fields["gang"] = s.gang
                esc = self._escalate(s, "no_yield_within_grace", fields)
                if esc == "freeze":
                    self._freeze(s, now)
                    self._grant_what_fits()
        self._plan_prefetch(now)
        out, self._out = self._out, []
        if self.check_every_input:
            self.verify()
        return out

    def _overdue(self, now: float) -> None:
        """Non-holders past their deadlines: a swap-out asked with no byte gone for a grace
        period, a claimed lease not yielded. Escalated as a holder that does not yield."""
        for sid in [i for i in self._asked if self.sessions[i].swap_out_deadline <= now]:
            s = self.sessions[sid]
            pending, s.pending_out = s.pending_out, 0
            self._set_swap_deadline(s, math.inf)
            s.swap_failed_until = now + SWAP_RETRY_S  # the planner looks for another way
            self._retry_at(s)
            if s.swap_escalated:
                continue
            s.swap_escalated = True
            fields = {"grace_s": self.settings.grace_s, "pending_bytes": pending}
            if self._escalate(s, "no_swap_out_within_grace", fields) == "freeze":
                self._freeze_waiting(s)
        for sid in [i for i in self._told if self.sessions[i].revoke_deadline <= now]:
            s = self.sessions[sid]
            if s.escalated:
                continue
            s.escalated = True
            fields = {"grace_s": self.settings.grace_s}
            if self._escalate(s, "no_yield_within_grace", fields) == "freeze":
                self._clear_yield(s)  # stopped: off the GPU until its grant thaws it
                self._freeze_waiting(s)
                self.queue.remove(sid)  # its turn comes after those who waited
                self.queue.append(sid)

    def _freeze_waiting(self, s: SessionState) -> None:
        """A non-holder stopped by the freeze escalation: its memory stays (pinned); in
        the queue it is thawed at its grant, outside at the next grant of anyone."""
        s.frozen = True
        if s.state is State.IDLE:
            self._frozen_idle.add(s.id)

    def _set_swap_deadline(self, s: SessionState, when: float) -> None:
        s.swap_out_deadline = when
        if math.isinf(when):
            self._asked.discard(s.id)
        else:
            self._asked.add(s.id)

    def _may_join_holders(self) -> bool:
        if self.recovering or self._blocking:
            return False  # nothing granted until the sessions it knew are back / yielded
        if self.peers is not None and self.peers.claimed(self.gpu):
            return False  # kept for a gang on several GPUs: its ranks only (_grant_gangs)
        if not self.holders and self.reserved is None:
            return True
        if self.settings.mode == "exclusive":
            return False
        # Do the limits of all who want the GPU fit (a quantum waiting for its holder
        # included; a gang's ranks all, as they may all ask at any time)? Stop at the
        # first that does not: the queue is long only when they do not.
        total = 0
        reserved = () if self.reserved is None else (self.reserved,)
        gangs: set[str] = set()
        for i in itertools.chain(self.holders, reserved, self.queue):
            s = self.sessions[i]
            if not s.gang:
                total += s.limit
            elif s.gang not in gangs:
                gangs.add(s.gang)
                total += sum(self.sessions[m].limit for m in self.gangs[s.gang].members)
            if total > self.capacity:
                return False
        return True

    def _grant_what_fits(self) -> None:
        now = self.clock.monotonic()
        if self._revoked_gangs:
            self._settle_gangs()
        if self.gangs:
            for g in self.gangs.values():  # (held on another GPU: counted when granted here)
                self._hold_gang(g, self.gang_here(g.key))
            self._grant_gangs(now)
        while self.queue and self._may_join_holders():
            head = self._head()
            if head is None:
                return
            if head.parked:  # its gang is yielding: the GPU is not free yet
                return
            # Fast path (the common case, on every handoff): it fits as things are. A
            # filling holder counts at its limit: a holder joining in mode auto may not
            # take what its room is to grow into (it could never fill).
            filling = sum(
                x.limit - x.room for x in map(self.sessions.get, self.holders) if x and x.room
            )
            # A rank's grant makes its gang hold: its peers then count at their limits.
            peers = self._peers_to_count(head)
            others = self.used_bytes() - head.used + filling + peers
            if others + head.limit <= self.capacity:
                self._grant(head)
                if head.gang:  # its peers that ask join it
                    self._grant_gangs(now)
                continue
            plan = plan_grant(self.capacity, self._views(gang_of=head if peers else None), head.id)
            if not plan.fits:
                for sid, n in plan.swap_outs:
                    self._ask_swap_out(sid, n)
                room = self.capacity - others
                if (
                    self.settings.overlap
                    and head.fills
                    and head.swapped
                    and not plan.shortfall
                    and room > head.resident
                ):
                    # Enough is on its way out: the head swaps in now, into what is free
                    # and then into what the swap-outs free (RoomActions), at once.
                    self._grant(head, room)
                    if head.gang:
                        self._grant_gangs(now)
                    continue
                if plan.shortfall and not plan.swap_outs and not self.holders:
                    # A frozen session's memory (a stopped process cannot swap) blocks the
                    # head, and thawing it would not help (it ignores revokes): the
                    # escalation goes one step further, or the queue waits forever.
                    for sid in [*self.queue, *self._frozen_idle]:
                        v = self.sessions[sid]
                        if v.frozen and not v.escalated:
                            v.escalated = True
                            self._escalate(
                                v, "frozen_memory_needed", {"resident_bytes": v.resident}, "kill"
                            )
                return
            self._grant(head)
            if head.gang:
                self._grant_gangs(now)

    def _freeze(self, s: SessionState, now: float) -> None:
        """The freeze escalation: the process is stopped; its lease goes to the next, and
        it waits for its turn (its memory stays where it is: a stopped process cannot
        swap)."""
        s.lease_s += now - s.lease_start
        self.holders.remove(s.id)
        self._event("release", s.id, lease=s.lease, seconds=now - s.lease_start, reason="frozen")
        s.lease = 0
        s.frozen = True
        s.escalated = False
        s.pending_out = 0
        self._set_swap_deadline(s, math.inf)
        s.room = 0
        s.turn, s.resume_s = False, 0.0
        self._enqueue(s)

    def _grant(self, s: SessionState, room: int = 0, resume: bool = False) -> None:
        now = self.clock.monotonic()
        if self.queue[0] == s.id:
            self.queue.popleft()
        else:  # a gang member joining its gang's lease, ahead of the queue
            self.queue.remove(s.id)
        regroup, s.parked = s.parked, False
        waited = self._end_wait(s, now)
        self._collect_credit(s)
        shared = bool(self.holders)
        self._lease_seq += 1
        s.lease = self._lease_seq
        s.state = State.HOLDING
        s.grants += 1
        self.grants_total += 1
        s.lease_start = now
        kind: dict[str, Any] = {}
        if s.continued:  # asked again within its window: what is left of its quantum
            q = max(0.0, s.quantum_end - now)
            s.continued = False
            s.continues += 1
            kind["continued"] = True
        elif s.turn:
            q = min(max(s.credit, TURN_MIN_S), self.settings.turn_s)
            s.turns += 1
            kind["turn"] = True
        elif s.resume_s:  # paused by a turn: the rest of it
            q, s.resume_s = s.resume_s, 0.0
            kind["resumed"] = True
        else:  # deficit accounting: a debt comes off this quantum, a credit adds to it
            q = self.quantum(s)
            take = max(-q, min(s.debt, q * PAYBACK))
            q -= take
            s.debt -= take
        g = self.gangs.get(s.gang) if s.gang else None
        if g is not None:  # the gang's quantum is its first holder's: no more than what is left
            self._hold_gang(g, True)
            ends = [
                m.quantum_end
                for m in map(self.sessions.__getitem__, g.members)
                if m is not s and (m.holding or m.reserved) and not math.isinf(m.quantum_end)
            ]
            if ends:
                q = min(q, max(0.0, min(ends) - now))
            kind["gang"] = s.gang
            if regroup:  # parked, its peers still holding: on to its next safe point
                kind["regroup"] = True
        s.quantum_len = q
        s.room = room
        s.swapping_in = bool(s.swapped)
        s.gpu_since = math.inf if s.swapping_in or room else now
        # A prefetch in flight is moot: the holder counts at its limit (or its room).
        s.prefetch_acked, s.prefetch_room = s.prefetch_seq, 0
        # The quantum starts when the swap-in is done (swap_done); a filling holder's
        # bound waits for its room too.
        s.quantum_end = math.inf if room else self._quantum_end(s)
        s.last_served = now
        self.holders.append(s.id)
        thaw, s.frozen = s.frozen, False
        s.escalated = False
        self._set_swap_deadline(s, math.inf)  # a holder's memory is not asked for
        s.swap_escalated = False
        self._clear_yield(s)
        for fid in list(self._frozen_idle):  # what froze them is past: continue them
            f = self.sessions[fid]
            f.frozen, f.escalated = False, False
            self._frozen_idle.discard(fid)
            self._out.append(ThawAction(fid))
        self._recount(s)
        self._event(
            "grant",
            s.id,
            lease=s.lease,
            wait_seconds=waited,
            swap_in_bytes=s.swapped,
            quantum_s=q,
            shared=shared,
            **({"room_bytes": room} if room else {}),
            **kind,
        )
        self._out.append(GrantAction(s.id, s.lease, s.swapped, q, shared, thaw, room, resume))
        # Its gang is on its way out: it goes on to its next safe point only.
        if g is not None and self._yielding(g):
            self._revoke(s, now, g.reason or "quantum")

    def _quantum_end(self, s: SessionState) -> float:
        """A quantum from now, after the swap-in at no less than the floor rate."""
        return self.clock.monotonic() + s.quantum_len + s.swapped / SWAP_FLOOR_BPS

    def _fill_rooms(self) -> None:
        """Grow each filling holder's room into what swap-outs have freed, and ask for
        more swap-outs where those under way will not do (one failed, say)."""
        for sid in self.holders:
            s = self.sessions[sid]
            if not s.room:
                continue
            free = self.capacity - (self.used_bytes() - s.room)
            if free >= s.limit:
                s.room = 0
                self._recount(s)
                self._out.append(RoomAction(s.id, s.limit))
                if math.isinf(s.quantum_end):  # bounded again, even if it never reports
                    s.quantum_end = self._quantum_end(s)
                continue
            if free > s.room:
                s.room = free
                self._recount(s)
                self._out.append(RoomAction(s.id, free))
            for vid, n in plan_grant(self.capacity, self._views_released(s.id), s.id).swap_outs:
                self._ask_swap_out(vid, n)

    def _revoke(self, s: SessionState, now: float, reason: str = "quantum") -> None:
        if s.gang:
            self._revoke_gang(self.gangs[s.gang], now, reason)
            return
        s.state = State.YIELDING
        s.revoke_deadline = now + self.settings.grace_s
        s.revoked_at = now
        s.revokes += 1
        # Plan the next grant as if this holder had already yielded, so that its swap-out
        # and everyone else's start now, in parallel with its wind-down.
        swap_out = 0
        if self._fits_after_release(s, self.sessions[self.queue[0]]):
            asks: list[tuple[int, int]] = []  # what the planner would say, without it
        else:
            asks = plan_grant(self.capacity, self._views_released(s.id), self.queue[0]).swap_outs
        if self.settings.mode == "exclusive" or len(self.holders) == 1:
            for sid, n in asks:
                if sid == s.id:  # its own share goes with its answer to the revoke
                    s.pending_out += n
                    swap_out = n
                else:
                    self._ask_swap_out(sid, n)
        self._event("revoke", s.id, lease=s.lease, reason=reason, swap_out_bytes=swap_out)
        self._out.append(RevokeAction(s.id, s.lease, swap_out, self.settings.grace_s))

    # --- gangs (core/gangs.py, docs/scheduling.md "Gangs") ------------------------------

    def _check_gang(self, key: str, g: Gang | None, limit: int, spans_nodes: bool) -> None:
        """A member the gang can hold the GPU with, or :class:`ArbiterError`."""
        if spans_nodes and self.settings.mode == "exclusive":
            raise ArbiterError(
                f"job {key} has ranks on other nodes, and one node cannot grant them"
                f" together: in mode exclusive its ranks would wait for each other; give it"
                f" GPUs of its own, or set mode auto on GPU {self.gpu}"
                f" (gpushare ctl mode auto --gpu {self.gpu})"
            )
        together = limit + (sum(self.sessions[m].limit for m in g.members) if g else 0)
        if together > self.capacity:
            raise ArbiterError(
                f"the ranks of job {key} on GPU {self.gpu} would need {together} bytes"
                f" together, more than its usable {self.capacity} bytes: they are granted"
                " together, so give each less (attach(memory=...), --memory or GPUSHARE_MEMORY)"
            )

    def gang_here(self, key: str) -> bool:
        """The GPU is the gang's: a member holds, or its quantum waits for it."""
        g = self.gangs.get(key)
        return g is not None and any(
            self.sessions[m].holding or self.sessions[m].reserved for m in g.members
        )

    def _hold_gang(self, g: Gang, held: bool) -> None:
        """While the gang holds the GPU its ranks count at their limits (they may ask at
        any time) and are never asked to swap out."""
        for m in map(self.sessions.__getitem__, g.members):
            if m.gang_held != held:
                m.gang_held = held
                self._recount(m)

    def _spread(self, g: Gang) -> bool:
        """The gang has ranks on other GPUs of the node too, granted with these."""
        return self.peers is not None and self.peers.spread(g.key)

    def _gang_active(self, g: Gang) -> bool:
        """The gang holds this GPU (or, with ranks on several, one of them)."""
        if self.gang_here(g.key):
            return True
        return self._spread(g) and self.peers is not None and self.peers.active(g.key)

    def _yielding(self, g: Gang) -> bool:
        if g.revoked:
            return True
        return self._spread(g) and self.peers is not None and self.peers.revoked(g.key)

    def _head(self) -> SessionState | None:
        """The queue's head for a grant on its own: not a rank of a gang on several GPUs
        (the gang starts on all of them at once, in _grant_gangs)."""
        if self.peers is None:
            return self.sessions[self.queue[0]]
        for sid in self.queue:
            s = self.sessions[sid]
            if not (s.gang and self._spread(self.gangs[s.gang])):
                return s
        return None

    def head_waiting_since(self) -> float | None:
        """When the session first in line for a grant on its own began to wait."""
        head = self._head() if self.queue else None
        return None if head is None else head.wait_start

    def _others_wait(self, s: SessionState) -> bool:
        """Someone not of ``s``'s job waits for the GPU (or, a gang with ranks on several
        GPUs, for one of them; or a gang on several GPUs waits to start here)."""
        if self.peers is not None:
            g = self.gangs.get(s.gang) if s.gang else None
            if g is not None and self._spread(g):
                return self.peers.others_wait(g.key)
            if self.peers.claimed(self.gpu):
                return True
        if not s.gang:
            return bool(self.queue)
        return any(self.sessions[q].gang != s.gang for q in self.queue)

    def _revoke_gang(self, g: Gang, now: float, reason: str) -> None:
        """Every holding member is revoked, with the gang's one deadline. Members keep
        their memory until all have yielded (a parked one may be granted again); the
        next holder's plan asks for it then."""
        if not g.revoked:
            g.revoked, g.reason, g.escalated = True, reason, False
            g.deadline = now + self.settings.grace_s
            self._revoked_gangs.add(g.key)
        for m in map(self.sessions.__getitem__, sorted(g.members)):
            if m.state is not State.HOLDING:
                continue
            if reason == "turn":
                m.resume_s = max(0.0, m.quantum_end - now)
            m.state = State.YIELDING
            m.revoke_deadline = g.deadline
            # Escalated once per revoke, not per regroup (nor at one at the deadline).
            m.escalated = g.escalated or now >= g.deadline
            m.revoked_at = now
            m.revokes += 1
            self._event("revoke", m.id, lease=m.lease, reason=reason, swap_out_bytes=0, gang=g.key)
            self._out.append(RevokeAction(m.id, m.lease, 0, max(0.0, g.deadline - now)))

    def _settle_gangs(self) -> None:
        """A revoked gang none of whose members holds has yielded: its parked members
        are plain waiting sessions again, in the queue where they joined it."""
        for key in list(self._revoked_gangs):
            g = self.gangs[key]
            if any(self.sessions[m].holding for m in g.members):
                continue
            if self._spread(g) and self.peers is not None and self.peers.holding(key):
                continue  # its ranks on another GPU have not all yielded yet
            self._revoked_gangs.discard(key)
            g.settle()
            for m in g.members:
                self.sessions[m].parked = False

    def _grant_gangs(self, now: float) -> None:
        """Members asking while their gang holds the GPU join it at once, when their
        memory fits (else the planner makes room, as for any grant). A parked member
        waits for its peers to yield, until the regroup: then it goes on to its next
        safe point (a peer may be blocked in a collective, waiting for it)."""
        for g in list(self.gangs.values()):
            if not self._gang_active(g) and not self._may_start(g):
                continue
            if not g.revoked and self.gang_here(g.key) and self._yielding(g):
                self._revoke_gang(g, now, "quantum")  # revoked on its other GPUs
            regroup = g.revoked and now >= g.regroup_at
            before = g.regroups
            for m in map(self.sessions.__getitem__, sorted(g.members)):
                if m.state is not State.WAITING or m.frozen or (m.parked and not regroup):
                    continue
                if not self._gang_active(g) and not self._may_start(g):
                    break
                peers = self._peers_to_count(m)
                if self.used_bytes() - m.used + peers + m.limit > self.capacity:
                    plan = plan_grant(
                        self.capacity, self._views(gang_of=m if peers else None), m.id
                    )
                    if not plan.fits:
                        for sid, n in plan.swap_outs:
                            self._ask_swap_out(sid, n)
                        continue
                if m.parked:
                    g.regroups += 1
                self._grant(m)
            if regroup:  # until a member parks again (or, none went on, a while)
                g.regroup_at = math.inf if g.regroups > before else now + REGROUP_S

    def _may_start(self, g: Gang) -> bool:
        """A gang on several GPUs starts on all at once: when it is the next to and none
        of its GPUs is held by another job (each was kept for it meanwhile)."""
        if self.peers is None or not self._spread(g):
            return False
        return self.peers.may_start(g.key)

    # --- scheduling (docs/scheduling.md) ----------------------------------------------

    def _settle_quantum(self, s: SessionState, now: float, revoked: bool) -> None:
        """A lease ends: a turn is paid from the credit; GPU time held past a quantum
        (the way to the safe point, a late answer) is owed, taken off later quanta; a
        quantum paused by a turn keeps what was left of it at the revoke."""
        if s.turn:  # its GPU time (its swap-in is a switch's cost, as anyone's)
            s.credit = max(0.0, s.credit - max(0.0, now - s.gpu_since))
            s.turn = False
        elif s.resume_s:
            s.resume_s = max(0.0, s.resume_s - (now - s.revoked_at))
            if s.resume_s < RESUME_MIN_S:
                s.resume_s = 0.0
        elif revoked and not math.isinf(s.quantum_end):
            s.debt += max(0.0, now - s.quantum_end)
            # What its next quantum cannot pay back is owed to those waiting instead (a
            # lighter session's quantum may be shorter than the way to its safe point).
            excess = s.debt - self.quantum(s) * PAYBACK
            if excess > 0:
                s.debt -= excess
                if not s.gang:  # a gang's members share one quantum: not each other's
                    self._owed += excess / self._weight_share(s)

    def _collect_credit(self, s: SessionState) -> None:
        """A session leaves the queue for a lease: what holders owed those waiting since
        it began to wait becomes its credit (bounded)."""
        owed = (self._owed - s.owed_mark) * self._weight_share(s)
        s.owed_mark = self._owed
        s.debt = max(s.debt - owed, -CREDIT_QUANTA * self.quantum(s))

    def _anticipation(self, s: SessionState, now: float) -> float:
        """How long the rest of ``s``'s quantum waits for it to ask again after its
        burst ended: within its quantum, at most ``anticipate_s``, and four of its usual
        gaps between bursts (at least the floor); none when its gaps are long (a session
        that is done for now is released early, as Kiwi does)."""
        left = s.quantum_end - now
        if math.isinf(left) or left <= 0 or s.frozen:
            return 0.0
        cap = self.settings.anticipate_s
        # Its usual gap, or the last one if shorter: one long pause (a data loader, a
        # start) does not cost the next few bursts their windows.
        g = None if s.gap_ewma is None else min(s.gap_ewma, s.gap_last)
        if g is not None and g > cap / 2:
            return 0.0
        return min(left, cap, max(ANTICIPATE_FLOOR_S, 4 * (g or 0.0)))

    def _reserve(self, s: SessionState, until: float) -> None:
        if self.reserved is not None:
            self._unreserve(self.sessions[self.reserved])
        self.reserved = s.id
        s.reserved, s.reserve_until = True, until
        self._recount(s)

    def _expire_reservation(self, now: float) -> None:
        """A quantum's holder did not ask again within its window: the GPU moves on. (The
        window's end is a deadline only while someone waits; otherwise it is seen here,
        at the next input.)"""
        if self.reserved is not None:
            r = self.sessions[self.reserved]
            if r.reserve_until <= now:
                self._unreserve(r)

    def _unreserve(self, s: SessionState) -> None:
        s.reserved, s.reserve_until = False, 0.0
        if self.reserved == s.id:
            self.reserved = None
        self._recount(s)

    def _pause_reserved(self, r: SessionState, now: float) -> None:
        """A turn comes while a quantum waits for its holder: the turn goes first; if the
        holder asks before its window (lengthened by a turn) is over, it goes next with
        what was left of its quantum."""
        r.resume_s = max(0.0, r.quantum_end - now)
        r.front_until = r.reserve_until + self.settings.turn_s
        self._unreserve(r)

    def _weight_share(self, s: SessionState) -> float:
        if self.settings.policy == "weighted":
            return s.weight / self._largest_weight()
        return 1.0

    def _may_take_turn(self, s: SessionState, idle: float, now: float) -> bool:
        """An interactive turn: the session asked (not for the first time) after idling
        longer than half of ``anticipate_s`` (away long enough that its quantum would not
        wait for it: no session falls between the two rules and waits two quanta), its
        credit covers its usual burst, the GPU is taken, and no one waiting has waited a
        whole round yet (the queue's length in quanta): turns never starve a queue."""
        st = self.settings
        if st.turn_s <= 0 or idle <= st.anticipate_s / 2 or s.frozen or s.burst_ewma is None:
            return False  # (no burst of its own yet: nothing says it asks briefly)
        if s.gang:  # a rank's turn alone would wait in its collectives for the others
            return False
        if self.peers is not None and self.peers.claimed(self.gpu):
            return False  # kept for a gang on several GPUs
        if not self.holders and self.reserved is None:
            return False  # nothing to go ahead of
        if s.credit < max(TURN_MIN_S, s.burst_ewma or 0.0):
            return False
        guard = st.tq_s * (len(self.holders) + len(self.queue) + 1)
        return all(now - self.sessions[q].wait_start < guard for q in self.queue)

    def _preempt_for_turn(self, now: float) -> None:
        """A turn at the front of the queue that cannot join the holders: they are
        revoked at once, each keeping what is left of its quantum for after the turn.
        Holders still swapping in are revoked once their memory is back."""
        if not self.queue or not self.sessions[self.queue[0]].turn:
            return
        for sid in list(self.holders):
            h = self.sessions[sid]
            if h.state is not State.HOLDING or h.turn or h.swapping_in or h.room:
                continue
            h.resume_s = max(0.0, h.quantum_end - now)
            self._revoke(h, now, reason="turn")

    def _expected_back(self, s: SessionState, now: float) -> bool:
        """An idle session that usually asks again soon (within twice its usual gap)."""
        g = s.gap_ewma
        return s.state is State.IDLE and g is not None and now - s.idle_since < max(2 * g, 1e-3)

    def _plan_prefetch(self, now: float) -> None:
        """While the GPU is held, the head of the queue swaps in (without the lease) what
        fits beside everyone's count (holders at their limits), in steps as memory frees;
        for the rest, idle sessions not expected back soon and waiting sessions further
        back in the queue (furthest first) swap out, only as much as needed."""
        st = self.settings
        if not (st.prefetch and self.queue) or (not self.holders and self.reserved is None):
            return
        h = self.sessions[self.queue[0]]
        if not h.prefetch or not h.swapped or h.frozen or h.pending_out or h.swapping_in:
            return
        if h.swap_failed_until > now:
            return
        want = h.resident + h.swapped
        have = max(h.resident, h.prefetch_room) if h.prefetching else h.resident
        free = self.capacity - self.used_bytes()
        more = min(free, want - have)
        if more > 0 and (more >= PREFETCH_STEP or have + more == want):
            have += more
            h.prefetch_room = have
            h.prefetch_seq += 1
            self._recount(h)
            self._event("prefetch", h.id, room_bytes=have, bytes=have - h.resident)
            self._out.append(PrefetchAction(h.id, have, h.prefetch_seq))
        need = want - have - sum(v.pending_out for v in self.sessions.values() if v is not h)
        if need <= 0:
            return
        idle = sorted(
            (v for v in self.sessions.values() if v.state is State.IDLE and not v.reserved),
            key=lambda v: (self._expected_back(v, now), v.last_served, v.id),
        )
        victims = [self._view(v) for v in idle if not self._expected_back(v, now)]
        victims += [self._view(self.sessions[q]) for q in reversed(self.queue) if q != h.id]
        for sid, n in take_from(victims, need)[0]:
            self._ask_swap_out(sid, n)

    # --- helpers --------------------------------------------------------------------

    def _fits_after_release(self, s: SessionState, head: SessionState) -> bool:
        """Would the planner find that ``head`` fits with holder ``s`` counted as if
        released (:meth:`_views_released`)? Its sum without scanning: holders count at
        their limits there (rooms here), ``s`` at what it has."""
        planned = self._used - head.used - s.used + s.resident + head.limit
        for h in self.holders:
            if h != s.id:
                v = self.sessions[h]
                planned += v.limit - v.used
        return planned <= self.capacity

    def _enqueue(self, s: SessionState, front: bool = False) -> None:
        """Join the queue: at its back, or (``front``) at its front, behind the sessions
        there already that go first: turns before paused quanta (docs/scheduling.md)."""
        s.state = State.WAITING
        s.wait_start = self.clock.monotonic()
        s.owed_mark = self._owed
        self._recount(s)
        if not front:
            self.queue.append(s.id)
            return
        i = 0
        for i, sid in enumerate(self.queue):  # noqa: B007  the place to insert at
            q = self.sessions[sid]
            if not (q.turn or (q.resume_s and not s.turn)):
                break
        else:
            i = len(self.queue)
        self.queue.insert(i, s.id)

    def _recount(self, s: SessionState, gone: bool = False) -> None:
        """The one place the running total of counted memory changes: after anything
        ``SessionState.used`` reads changed (state, room, swapping_in, memory), and when
        a session goes."""
        now = 0 if gone else s.used
        self._used += now - s.counted
        s.counted = now

    def _weigh(self, weight: float, k: int) -> None:
        """A session of ``weight`` came (k=1) or went (k=-1)."""
        self._weights[weight] += k
        if not self._weights[weight]:
            del self._weights[weight]
            if weight == self._top_weight:
                self._top_weight = 0.0  # found again when next needed
        elif k > 0 and self._top_weight:
            self._top_weight = max(self._top_weight, weight)

    def _retry_at(self, s: SessionState) -> None:
        self._next_retry()  # drop what has passed: the heap holds the last second's
        heapq.heappush(self._retries, (s.swap_failed_until, s.id))

    def _next_retry(self) -> float | None:
        """The earliest swap_failed_until the rules have not yet run at or after, if any:
        one that has passed since is due now (a tick plans with it). Each session's
        latest is in the heap; older entries, those of sessions gone and those the rules
        ran after are skipped."""
        now = self._advanced
        heap = self._retries
        while heap:
            t, sid = heap[0]
            s = self.sessions.get(sid)
            if t > now and s is not None and s.swap_failed_until == t:
                return t
            heapq.heappop(heap)
        return None

    def _end_wait(self, s: SessionState, now: float) -> float:
        waited = now - s.wait_start
        s.wait_s += waited
        s.wait_max_s = max(s.wait_max_s, waited)
        s.wait_counts[bisect.bisect_left(WAIT_BUCKETS, waited)] += 1
        s.recent_waits.append(waited)
        return waited

    def _count_swap(
        self, s: SessionState, direction: str, nbytes: int, seconds: float, prefetch: bool = False
    ) -> None:
        if direction == "out":  # pending_out went down with resident (_set_memory)
            s.swap_outs += 1
            s.swap_out_bytes += nbytes
            s.swap_out_s += seconds
        else:
            s.swap_ins += 1
            s.swap_in_bytes += nbytes
            s.swap_in_s += seconds
        fields = {"prefetch": True} if prefetch else {}
        self._event(f"swap_{direction}", s.id, bytes=nbytes, seconds=seconds, **fields)

    def _set_memory(self, s: SessionState, resident: int, swapped: int) -> None:
        """The figures, checked by the caller (before anything changed)."""
        # Bytes that left the GPU (swapped out as reported chunk by chunk, or freed) are
        # bytes no longer pending: a swap-out counts down as it goes.
        s.pending_out = max(0, min(s.pending_out - max(0, s.resident - resident), resident))
        if not s.pending_out:
            self._set_swap_deadline(s, math.inf)
        elif resident < s.resident and not s.holding:  # progress: a grace period more
            self._set_swap_deadline(s, self.clock.monotonic() + self.settings.grace_s)
            s.swap_escalated = False
        s.resident = resident
        s.swapped = swapped
        self._recount(s)

    def _view(self, s: SessionState) -> MemoryView:
        now = self.clock.monotonic()
        pinned = s.frozen or s.swap_failed_until > now or s.prefetching
        resident = s.resident if s.holding else s.used
        holding = s.holding or s.reserved or s.gang_held  # a quantum waiting for its holder
        keep = self._expected_back(s, now)
        return MemoryView(
            s.id, s.limit, resident, holding, s.last_served, s.pending_out, pinned, keep
        )

    def _views(self, gang_of: SessionState | None = None) -> list[MemoryView]:
        """Every session as the planner sees it; with ``gang_of`` (a rank whose grant
        makes its gang hold: its ``_peers_to_count`` is not 0), as that grant would make
        it: its peers at their limits, not victims."""
        views = [self._view(s) for s in self.sessions.values()]
        if gang_of is None:
            return views
        peers = self.gangs[gang_of.gang].members - {gang_of.id}
        return [
            MemoryView(v.id, v.limit, v.limit, True, v.last_served, v.pending_out)
            if v.id in peers
            else v
            for v in views
        ]

    def _peers_to_count(self, s: SessionState) -> int:
        """Bytes the count grows by beyond ``s``'s own limit when ``s``'s grant makes its
        gang hold (its peers counted at their limits: they may join at any time)."""
        if not s.gang or s.gang_held:
            return 0
        peers = (self.sessions[m] for m in self.gangs[s.gang].members if m != s.id)
        return sum(max(0, p.limit - p.used) for p in peers)

    def _views_released(self, sid: int) -> list[MemoryView]:
        """The planner's view with holder ``sid`` counted as if it had released: at what
        it has, and a possible victim (the revoked holder; a filling one, for itself)."""
        return [
            MemoryView(v.id, v.limit, v.resident, False, v.last_served, v.pending_out)
            if v.id == sid
            else self._view(v)
            for v in self.sessions.values()
        ]

    def _ask_swap_out(self, sid: int, n: int) -> None:
        s = self.sessions[sid]
        if not s.pending_out or math.isinf(s.swap_out_deadline):
            self._set_swap_deadline(s, self.clock.monotonic() + self.settings.grace_s)
        s.pending_out += n
        self._out.append(SwapOutAction(sid, n))

    def _get(self, sid: int) -> SessionState:
        try:
            return self.sessions[sid]
        except KeyError:
            raise ArbiterError(f"no session {sid} on GPU {self.gpu}") from None

    def _event(self, kind: str, sid: int | None, **fields: Any) -> None:
        rec: dict[str, Any] = {"ts": self.clock.wall(), "gpu": self.gpu, "event": kind}
        if sid is not None:
            rec["session"] = sid
        rec.update(fields)
        self._out.append(EventAction(rec))


def _ewma(old: float, sample: float) -> float:
    return old + EWMA * (sample - old)

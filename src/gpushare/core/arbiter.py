"""The arbiter: who holds each GPU, who waits, when a quantum ends, who swaps what.

Pure logic with no I/O: every input is a method call, every decision comes back as a
list of actions (messages for workloads, events for the log), and time is read from an
injected :class:`~gpushare.core.clock.Clock`. The daemon, the tests and the simulators drive
this same code. The rules are those of DESIGN.md "Arbitration rules".
"""

from __future__ import annotations

import bisect
import math
from collections import deque
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
)
from gpushare.core.clock import Clock
from gpushare.core.gangs import REGROUP_S, Gang, Peers
from gpushare.core.planner import MemoryView, plan_grant, take_from
from gpushare.core.sessions import WAIT_BUCKETS, SessionState, State
from gpushare.settings import Escalation, GpuSettings, Mode, Policy, SettingsError, validate

SWAP_RETRY_S = 1.0  # a session whose swap failed is not asked again for this long
# A quantum is GPU time: it starts when the swap-in is done. A swap-in slower than this
# (bytes/s) is taken for stuck, so the quantum starts anyway and a revoke can follow.
SWAP_FLOOR_BPS = 1e9
# docs/scheduling.md has the rules these figures belong to.
ANTICIPATE_FLOOR_S = 0.05  # the shortest wait of a quantum for its holder to ask again
EWMA = 0.3  # weight of the newest sample in a session's gap and burst averages
TURN_MIN_S = 0.02  # a turn shorter than this is not worth its two switches
RESUME_MIN_S = 0.01  # less left of a paused quantum than this: not resumed
PREFETCH_STEP = 2**30  # a prefetch asks for at least this much (or all that is left)


class ArbiterError(ValueError):
    """An input that is not valid in the session's current state."""


class Arbiter:
    """Decisions for one GPU of ``capacity`` usable bytes."""

    def __init__(
        self, gpu: int, capacity: int, clock: Clock, settings: GpuSettings | None = None
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
        self._lease_seq = 0
        self.reserved: int | None = None  # the session whose quantum waits for it to ask
        self.grants_total = 0  # on this GPU since the node started, sessions gone included
        self.gangs: dict[str, Gang] = {}  # by the node's key (core/gangs.py)
        self._revoked_gangs: set[str] = set()
        # The node's other GPUs, for gangs with ranks on several (core/coordinator.py).
        self.peers: Peers | None = None
        self._out: list[Action] = []

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
        fills: bool = False,
        prefetch: bool = False,
        gang: str = "",
        gang_size: int = 0,
        spans_nodes: bool = False,
    ) -> list[Action]:
        """A new session; ``resident``/``swapped``/``holding`` re-register a workload that
        outlived a node restart (it keeps its memory and, mid-burst, its lease). ``fills``:
        its client can swap in within a room, so its swap-in may overlap another's
        swap-out; ``prefetch``: it swaps in ahead of its grant when told. ``gang``: the
        node's key of the distributed job it is a rank of (``gang_size`` ranks on the
        node, as its client says; ``spans_nodes``: it has ranks elsewhere too)."""
        if sid in self.sessions:
            raise ArbiterError(f"session {sid} is already attached")
        if limit <= 0:
            raise ArbiterError("memory limit must be positive")
        if limit > self.capacity:
            raise ArbiterError(
                f"memory limit {limit} bytes exceeds GPU {self.gpu}'s usable {self.capacity}"
                " bytes: ask for less (attach(memory=...), --memory or GPUSHARE_MEMORY)"
            )
        if not (weight > 0 and math.isfinite(weight)):
            raise ArbiterError("weight must be a positive number")
        if resident < 0 or swapped < 0 or resident + swapped > limit:
            raise ArbiterError("re-registered memory must be within the memory limit")
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
        if holding:  # it was working when the node went away: it holds a lease again
            s.bursts += 1
            self._enqueue(s)
            self.queue.remove(sid)
            self.queue.appendleft(sid)
            self._grant(s)
        return self._advance()

    def detach(self, sid: int, *, reason: str = "closed") -> list[Action]:
        s = self._get(sid)
        now = self.clock.monotonic()
        if s.holding:
            s.lease_s += now - s.lease_start
            self.holders.remove(sid)
        elif s.state is State.WAITING:
            self._end_wait(s, now)
            self.queue.remove(sid)
        if s.reserved:
            self._unreserve(s)
        del self.sessions[sid]
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
        if swapping_out < 0:
            raise ArbiterError("swapping_out must not be negative")
        if s.state is State.WAITING and not again:
            # The burst ended before it was granted (the workload gave up waiting). Its
            # client stopped any prefetch before saying so (the same thread does both).
            self.queue.remove(sid)
            self._end_wait(s, now)
            s.state = State.IDLE
            s.idle_since = now
            s.turn, s.resume_s, s.continued = False, 0.0, False
            s.prefetch_acked, s.prefetch_room = s.prefetch_seq, 0
            self._set_memory(s, resident, swapped)
            return self._advance()
        if s.state is State.WAITING and s.frozen:
            # The answer to a revoke that crossed the freeze: it waits already; keep the
            # figures of what it swapped out on the way.
            if swapped_out:
                self._count_swap(s, "out", swapped_out, seconds)
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
        self._settle_quantum(s, now, revoked)
        if swapped_out:
            self._count_swap(s, "out", swapped_out, seconds)
        # The release answers the revoke's ask, whatever was done: what is still missing
        # is planned anew, so a short answer cannot leave the queue waiting on bytes.
        s.pending_out = 0
        s.room = 0
        s.swapping_in = False  # what it has is what it says now
        self._set_memory(s, resident, swapped)
        s.pending_out = min(swapping_out, s.resident)
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
            s.burst_ewma = (
                s.burst_lease if s.burst_ewma is None else _ewma(s.burst_ewma, s.burst_lease)
            )
            s.burst_lease = 0.0
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
        if prefetch and (direction != "in" or prefetch > s.prefetch_seq):
            raise ArbiterError(f"no prefetch {prefetch} was asked of session {sid}")
        if error:
            if direction == "out" or prefetch:
                if direction == "out":
                    s.pending_out = 0  # the planner will look for another way
                s.swap_failed_until = self.clock.monotonic() + SWAP_RETRY_S
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
        s = self._get(sid)
        self._set_memory(s, resident, swapped)
        self._check_limit(s, resident, "resident_bytes")
        return self._advance()

    def over_limit(self, sid: int, *, used: int) -> list[Action]:
        """The GPU itself (NVML) says the session uses ``used`` bytes."""
        self._check_limit(self._get(sid), used, "used_bytes")
        return self._advance()

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

    def configure(
        self,
        *,
        tq_s: float | None = None,
        mode: Mode | None = None,
        policy: Policy | None = None,
        escalation: Escalation | None = None,
    ) -> list[Action]:
        """Change TQ, mode, policy or escalation; quanta already running keep their
        length. Every value is checked first: one bad value changes nothing."""
        try:
            changes = validate(tq_s=tq_s, mode=mode, policy=policy, escalation=escalation)
        except SettingsError as e:
            raise ArbiterError(str(e)) from None
        for key, value in changes.items():
            setattr(self.settings, key, value)
        if changes:
            self._event("config", None, **changes)
        return self._advance()

    def tick(self) -> list[Action]:
        """Let time pass: quanta end, grace periods run out."""
        return self._advance()

    # --- queries --------------------------------------------------------------------

    def next_deadline(self) -> float | None:
        """When :meth:`tick` next has something to do (monotonic seconds), if ever."""
        times = []
        for sid in self.holders:
            s = self.sessions[sid]
            if s.state is State.HOLDING:
                if not math.isinf(s.quantum_end):  # a filling holder's quantum waits
                    times.append(s.quantum_end)
            elif not s.escalated:
                times.append(s.revoke_deadline)
        if self.reserved is not None:
            times.append(self.sessions[self.reserved].reserve_until)
        for key in self._revoked_gangs:  # parked members go on to their next safe point
            if not math.isinf(self.gangs[key].regroup_at):
                times.append(self.gangs[key].regroup_at)
        if self.queue or any(self.sessions[h].room for h in self.holders):
            # a plan (or a filling holder) waiting on a failed swap: look again at retry
            now = self.clock.monotonic()
            times += [
                s.swap_failed_until for s in self.sessions.values() if s.swap_failed_until > now
            ]
        return min(times, default=None)

    def quantum(self, s: SessionState) -> float:
        tq = self.settings.tq_s
        if self.settings.policy == "weighted":
            top = max(x.weight for x in self.sessions.values())
            return tq * s.weight / top
        return tq

    def lease_seconds(self, s: SessionState) -> float:
        live = self.clock.monotonic() - s.lease_start if s.holding else 0.0
        return s.lease_s + live

    def wait_seconds(self, s: SessionState) -> float:
        live = self.clock.monotonic() - s.wait_start if s.state is State.WAITING else 0.0
        return s.wait_s + live

    def used_bytes(self) -> int:
        """Bytes the GPU must be able to hold now (holders at their limits, or at their
        rooms while filling)."""
        return sum(v.used for v in self.sessions.values())

    # --- the rules ------------------------------------------------------------------

    def _advance(self) -> list[Action]:
        now = self.clock.monotonic()
        if self.reserved is not None:
            r = self.sessions[self.reserved]
            if r.reserve_until <= now:  # it did not ask again in time: the GPU moves on
                self._unreserve(r)
            elif self.queue and self.sessions[self.queue[0]].turn:
                self._pause_reserved(r, now)
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
        return out

    def _may_join_holders(self) -> bool:
        if self.peers is not None and self.peers.claimed(self.gpu):
            return False  # kept for a gang on several GPUs: its ranks only (_grant_gangs)
        if not self.holders and self.reserved is None:
            return True
        if self.settings.mode == "exclusive":
            return False
        wanting = {*self.holders, *self.queue}
        if self.reserved is not None:
            wanting.add(self.reserved)
        for key in {self.sessions[i].gang for i in wanting} - {""}:
            wanting |= self.gangs[key].members  # its ranks may all ask at any time
        return sum(self.sessions[i].limit for i in wanting) <= self.capacity

    def _grant_what_fits(self) -> None:
        now = self.clock.monotonic()
        if self._revoked_gangs:
            self._settle_gangs()
        if self.gangs:
            for g in self.gangs.values():
                held = self._gang_active(g)
                for m in g.members:
                    self.sessions[m].gang_held = held
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
            others = self.used_bytes() - head.used + filling
            if others + head.limit <= self.capacity:
                self._grant(head)
                if head.gang:  # its peers that ask join it
                    self._grant_gangs(now)
                continue
            plan = plan_grant(self.capacity, self._views(), head.id)
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
                    for sid in self.queue:
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
        s.room = 0
        s.turn, s.resume_s = False, 0.0
        self._enqueue(s)

    def _grant(self, s: SessionState, room: int = 0) -> None:
        now = self.clock.monotonic()
        if self.queue[0] == s.id:
            self.queue.popleft()
        else:  # a gang member joining its gang's lease, ahead of the queue
            self.queue.remove(s.id)
        regroup, s.parked = s.parked, False
        waited = self._end_wait(s, now)
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
        else:  # GPU time held past earlier quanta comes off this one, up to half of it
            q = self.quantum(s)
            take = min(s.debt, q / 2)
            q -= take
            s.debt -= take
        g = self.gangs.get(s.gang) if s.gang else None
        if g is not None:  # the gang's quantum is its first holder's: no more than what is left
            for m in g.members:
                self.sessions[m].gang_held = True
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
        self._out.append(GrantAction(s.id, s.lease, s.swapped, q, shared, thaw, room))
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
                self._out.append(RoomAction(s.id, s.limit))
                if math.isinf(s.quantum_end):  # bounded again, even if it never reports
                    s.quantum_end = self._quantum_end(s)
                continue
            if free > s.room:
                s.room = free
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
        plan = plan_grant(self.capacity, self._views_released(s.id), self.queue[0])
        if self.settings.mode == "exclusive" or len(self.holders) == 1:
            for sid, n in plan.swap_outs:
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
                others = self.used_bytes() - m.used
                if others + m.limit > self.capacity:
                    plan = plan_grant(self.capacity, self._views(), m.id)
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
            s.debt = min(s.debt + max(0.0, now - s.quantum_end), self.quantum(s))

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

    def _unreserve(self, s: SessionState) -> None:
        s.reserved, s.reserve_until = False, 0.0
        if self.reserved == s.id:
            self.reserved = None

    def _pause_reserved(self, r: SessionState, now: float) -> None:
        """A turn comes while a quantum waits for its holder: the turn goes first; if the
        holder asks before its window (lengthened by a turn) is over, it goes next with
        what was left of its quantum."""
        r.resume_s = max(0.0, r.quantum_end - now)
        r.front_until = r.reserve_until + self.settings.turn_s
        self._unreserve(r)

    def _weight_share(self, s: SessionState) -> float:
        if self.settings.policy == "weighted":
            return s.weight / max(x.weight for x in self.sessions.values())
        return 1.0

    def _may_take_turn(self, s: SessionState, idle: float, now: float) -> bool:
        """An interactive turn: the session asked (not for the first time) after idling at
        least ``anticipate_s``,
        its credit covers its usual burst, the GPU is taken, and no one waiting has waited
        a whole round yet (the queue's length in quanta): turns never starve a queue."""
        st = self.settings
        if st.turn_s <= 0 or idle < st.anticipate_s or s.frozen or s.burst_ewma is None:
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

    def _enqueue(self, s: SessionState, front: bool = False) -> None:
        """Join the queue: at its back, or (``front``) at its front, behind the sessions
        there already that go first: turns before paused quanta (docs/scheduling.md)."""
        s.state = State.WAITING
        s.wait_start = self.clock.monotonic()
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

    @staticmethod
    def _set_memory(s: SessionState, resident: int, swapped: int) -> None:
        if resident < 0 or swapped < 0:
            raise ArbiterError("memory figures must not be negative")
        # Bytes that left the GPU (swapped out as reported chunk by chunk, or freed) are
        # bytes no longer pending: a swap-out counts down as it goes.
        s.pending_out = max(0, min(s.pending_out - max(0, s.resident - resident), resident))
        s.resident = resident
        s.swapped = swapped

    def _view(self, s: SessionState) -> MemoryView:
        now = self.clock.monotonic()
        pinned = s.frozen or s.swap_failed_until > now or s.prefetching
        resident = s.resident if s.holding else s.used
        holding = s.holding or s.reserved or s.gang_held  # a quantum waiting for its holder
        keep = self._expected_back(s, now)
        return MemoryView(
            s.id, s.limit, resident, holding, s.last_served, s.pending_out, pinned, keep
        )

    def _views(self) -> list[MemoryView]:
        return [self._view(s) for s in self.sessions.values()]

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
        self.sessions[sid].pending_out += n
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

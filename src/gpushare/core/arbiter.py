"""The arbiter: who holds each GPU, who waits, when a quantum ends, who swaps what.

Pure logic with no I/O: every input is a method call, every decision comes back as a
list of actions (messages for workloads, events for the log), and time is read from an
injected :class:`~gpushare.core.clock.Clock`. The daemon, the tests and the simulators
drive this same code (docs/design.md "Arbitration rules").

The arbiter keeps the inputs and the decision loop (:meth:`Arbiter._decide`): grants,
revokes and the queue. Each rule of docs/scheduling.md lives beside its own state, in a
module named for it, and is called from here: the window a quantum waits for its holder
(core/window.py), prefetch (core/prefetch.py), interactive turns (core/turns.py),
shares and deficit accounting (core/shares.py), gangs (core/gangs.py), memory lent
above a request and given back (core/lending.py), families (core/families.py); and
beside them counted memory (core/ledger.py), deadlines (core/deadlines.py, and every
rule's next one in core/timers.py), escalation (core/escalation.py), recovery claims
(core/claims.py) and the checks of what a client says (core/checks.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from gpushare.core import caps, lending
from gpushare.core.actions import Action, Outbox
from gpushare.core.admission import Admission
from gpushare.core.attach import AttachRecord, Checked, check
from gpushare.core.caps import Caps
from gpushare.core.checks import (
    MAX_COUNT,
    ArbiterError,
    FieldError,
    check_error,
    count,
)
from gpushare.core.checks import seconds as _seconds
from gpushare.core.claims import Claims
from gpushare.core.clock import Clock
from gpushare.core.escalation import Escalation
from gpushare.core.events import Attach, Config, Detach, Release, SwapIn, SwapOut
from gpushare.core.families import Families
from gpushare.core.gangs import Gangs
from gpushare.core.leases import Leases
from gpushare.core.ledger import Ledger
from gpushare.core.prefetch import plan_prefetch
from gpushare.core.sessions import Memory, SessionState, State
from gpushare.core.shares import Shares
from gpushare.core.state import GpuState
from gpushare.core.timers import Timers
from gpushare.core.turns import Turns
from gpushare.core.window import Window
from gpushare.settings import Change, GpuSettings, SettingsError, validate

__all__ = ["Arbiter", "ArbiterError", "FieldError"]

EWMA = 0.3  # weight of the newest sample in a session's gap and burst averages


class Arbiter:
    """Decisions for one GPU of ``capacity`` usable bytes.

    Its cost per input does not grow with the sessions attached: what the rules need of
    all of them is kept as running totals (core/ledger.py, core/deadlines.py), and the
    planner runs only when the fast path fails. :meth:`verify` checks each against a
    scan of every session; with ``check_every_input`` set (the core's tests set it) it
    runs after every input.
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
        self.st = GpuState(
            gpu,
            capacity,
            clock,
            settings or GpuSettings(),
            Outbox(gpu, clock),
            Ledger(gpu, capacity),
        )
        self.shares = Shares(self.st)
        self.window = Window(self.st)
        self.turns = Turns(self.st, self.shares)
        self.escalation = Escalation(self.st)
        self.claims = Claims(self.st, self.escalation)
        self.gangs = Gangs(self.st)
        self.leases = Leases(
            self.st, self.shares, self.turns, self.gangs, self.claims, self.escalation, lease_base
        )
        self.caps = Caps(self.st)
        self.families = Families(self.st, self.gangs)
        self.admission = Admission(
            self.st, self.leases, self.gangs, self.claims, self.window, self.escalation, self.caps
        )
        self.timers = Timers(
            self.st, self.admission, self.claims, self.window, self.gangs, self.caps, self.turns
        )

    # --- what the rest of the node reads ----------------------------------------------

    @property
    def settings(self) -> GpuSettings:
        return self.st.settings

    # Read-only views of the state (the node, status and the coordinator read them; only
    # the arbiter's inputs change them).
    @property
    def sessions(self) -> Mapping[int, SessionState]:
        return self.st.sessions

    @property
    def queue(self) -> Sequence[int]:
        return self.st.queue

    @property
    def holders(self) -> Sequence[int]:
        return self.st.holders

    @property
    def recovering(self) -> bool:
        return self.claims.recovering

    @property
    def last_lease(self) -> int:
        """The number of the last lease granted (leases are numbered on across restarts)."""
        return self.leases.last_lease

    @property
    def grants_total(self) -> int:
        """Grants on this GPU since the node started, sessions gone included."""
        return self.leases.grants_total

    def used_bytes(self) -> int:
        """Bytes the GPU must be able to hold now (holders at their limits, or at their
        rooms while filling)."""
        return self.st.ledger.used

    def quantum(self, s: SessionState) -> float:
        return self.shares.quantum(s)

    def lease_seconds(self, s: SessionState) -> float:
        live = self.clock.monotonic() - s.lease.start if s.holding else 0.0
        return s.totals.lease_s + live

    def wait_seconds(self, s: SessionState) -> float:
        live = self.clock.monotonic() - s.lease.wait_start if s.state is State.WAITING else 0.0
        return s.totals.wait_s + live

    def compute_left(self, s: SessionState) -> float:
        """GPU seconds a session with a compute limit may hold now before it rests."""
        return caps.left(s, self.clock.monotonic()) if s.share.bucket is not None else 0.0

    def gang_here(self, key: str) -> bool:
        return self.gangs.here(key)

    def head_waiting_since(self) -> float | None:
        """When the session first in line for a grant on its own began to wait."""
        head = self.gangs.head() if self.st.queue else None
        return None if head is None else head.lease.wait_start

    # --- inputs ---------------------------------------------------------------------

    def attach(self, sid: int, rec: AttachRecord) -> list[Action]:
        """A new session, its figures in ``rec`` (core/attach.py says what each is). One
        back after a node restart keeps its memory (made again empty at its next grant
        where it was dropped) and, mid-burst, gets its lease back only when verified and
        the rules allow it (after the recovery window, if one is open); any other claim
        is told to yield (a revoke for its lease), and escalated like a holder's if it
        does not within the grace period. A member joining a family takes its memory out
        of that session's limit (core/families.py)."""
        st = self.st
        joining = self.families.joining(rec)  # a member: its part of its session's limit
        rec = joining.rec if joining is not None else rec
        used, attached = self.used_bytes(), sid in st.sessions
        c = check(sid, rec, attached=attached, used=used, capacity=self.capacity, gpu=self.gpu)
        self.families.check_gang(joining, rec, c.limit)
        s = self._new_session(sid, rec, c)
        if joining is not None:
            self.families.joined(joining, s)
        if rec.gang:
            self.gangs.join(s, rec.gang, rec.gang_size, rec.spans_nodes)
        st.out.emit(
            Attach(
                session=sid,
                name=rec.name,
                limit_bytes=c.limit,
                weight=c.weight,
                resumed=rec.resumed,
                request_bytes=s.memory.request or None,
                resident_bytes=rec.resident,
                swapped_bytes=rec.swapped,
                gang=rec.gang or None,
                gang_size=rec.gang_size if rec.gang else None,
                spans_nodes=rec.spans_nodes if rec.gang else None,
                family=s.rank.family or None,
            )
        )
        if rec.holding:  # it was working when the node went away
            self._claim_back(s, rec.lease, rec.verified)
        return self._decide()

    def _new_session(self, sid: int, rec: AttachRecord, c: Checked) -> SessionState:
        """The session's state, counted in the ledger and its compute bucket."""
        st, now = self.st, self.clock.monotonic()
        request = c.request if c.request < c.limit else 0  # Memory's 0: the limit
        mem = Memory(c.limit, request, rec.grows, fills=rec.fills)
        s = SessionState(id=sid, name=rec.name, weight=c.weight, memory=mem, sharing=rec.sharing)
        self.caps.join(s, rec.workload, c.compute_limit, now)
        s.attached = s.lease.idle_since = now
        s.prefetch.enabled = rec.prefetch
        s.share.credit = self.turns.first_credit()
        st.set_memory(s, rec.resident, rec.swapped)
        mem.discarded = rec.discarded  # in its bound (it comes back); dropped before: not counted
        st.sessions[sid] = s
        st.ledger.weigh(c.weight, 1)
        s.rank.family = rec.family if rec.family != sid else 0
        return s

    def _claim_back(self, s: SessionState, lease: int, verified: bool) -> None:
        """A session back mid-burst claims its lease: given back as the rules allow."""
        s.totals.bursts += 1
        self.leases.enqueue(s)
        if not (verified and lease):
            self.claims.tell_to_yield(s, lease, verified=False)
        elif self.claims.recovering:
            s.esc.claim = lease  # granted back at the window's end, if the rules allow
        else:
            self.admission.resume_or_yield(s, lease)

    def begin_recovery(self) -> None:
        """A node restarted: grant nothing until :meth:`end_recovery` (the sessions it
        knew are back, or the window ended). Leases claimed meanwhile wait for the end."""
        self.claims.recovering = True

    def end_recovery(self) -> list[Action]:
        """The recovery window ends: the verified claims get their leases back, the most
        recent lease first, as far as the rules allow; the others are told to yield."""
        if not self.claims.recovering:
            return []
        for s, lease in self.claims.end():
            self.admission.resume_or_yield(s, lease)
        return self._decide()

    def detach(self, sid: int, *, reason: str = "closed") -> list[Action]:
        st = self.st
        s = st.get(sid)
        now = self.clock.monotonic()
        if s.holding:  # its lease ends with it: a release, for whoever counts leases
            held = now - s.lease.start
            s.totals.lease_s += held
            st.holders.remove(sid)
            st.out.emit(Release(session=sid, lease=s.lease.number, seconds=held, reason=reason))
        elif s.state is State.WAITING:
            st.end_wait(s, now)
            st.queue.remove(sid)
        if s.share.window:
            self.window.close(s)
        self.caps.leave(s, now)
        del st.sessions[sid]
        st.deadlines.forget(sid)
        self.claims.forget(sid)
        self.escalation.forget(sid)
        st.ledger.recount(s, gone=True)
        st.ledger.weigh(s.weight, -1)
        if s.rank.gang:
            self.gangs.leave(s)
        self.families.left(s)  # what it took of its session's limit goes back
        st.out.emit(Detach(session=sid, reason=reason, freed_bytes=s.memory.resident))
        return self._decide()

    def acquire(self, sid: int) -> list[Action]:
        s = self.st.get(sid)
        if s.state is not State.IDLE:
            raise ArbiterError(f"session {sid} already has a burst open ({s.state})")
        now = self.clock.monotonic()
        s.totals.bursts += 1
        idle = now - s.lease.idle_since
        sh = s.share
        if s.totals.bursts > 1:  # a gap between two bursts (not attach to the first)
            sh.gap_last = min(idle, 2 * self.settings.anticipate_s)
            sh.gap_ewma = sh.gap_last if sh.gap_ewma is None else _ewma(sh.gap_ewma, sh.gap_last)
        self.turns.asked(s, now, idle)
        self.window.expire(now)  # a window that passed while nobody waited
        if sh.window:  # back within its window: the rest of its quantum, at once
            self.window.close(s)
            sh.continued = True
            self.leases.enqueue(s, front=True)
            return self._decide()
        if sh.resume_s and now < sh.front_until:  # its quantum was paused by a turn
            self.leases.enqueue(s, front=True)
        elif self.turns.may_take(
            s,
            idle,
            now,
            ahead=self._someone_to_go_ahead_of(s) and not self.admission.joins(s),
            kept=self.gangs.claimed(),
        ):
            sh.turn = True
            self.leases.enqueue(s, front=True)
        else:
            sh.resume_s = 0.0
            self.leases.enqueue(s)
        g = self.gangs.of(s)
        if g is not None and g.revoked:
            # Its gang is yielding: a new ask waits as a parked member does (until the gang
            # has yielded, or the regroup), else ranks that take turns asking keep a revoked
            # gang holding for ever (seen: two processes of one GPUSHARE_GANG).
            self.gangs.park(s, now)
        return self._decide()

    def _someone_to_go_ahead_of(self, s: SessionState) -> bool:
        """The GPU is held (or its quantum waits for its holder); or it is between holders
        and ``s`` went idle before the queue's head began to wait (a cell back after a
        while, not the holder that just left, whose memory the head may be waiting for),
        or the head is a quantum a turn paused."""
        if self.admission.taken():
            return True
        q = self.st.queue
        if not q:
            return False
        head = self.st.sessions[q[0]]
        # (a head coming back to a quantum a turn paused: a server's next request goes
        # first too, while the head's memory comes back)
        return s.lease.idle_since < head.lease.wait_start or head.share.resume_s > 0

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
        need: int = 0,
        discarded: int = 0,
        idle_s: float = 0.0,
    ) -> list[Action]:
        """The burst ended, or the holder yielded (``again``). ``swapped_out`` bytes went
        on the way (older clients); ``swapping_out`` bytes are going now, after the release,
        reported as they go (:meth:`report`) and when done (:meth:`swap_done`): the GPU work
        has stopped, so the next holder's swap-in may overlap that swap-out. ``need``
        (with ``again``, from a holder): an allocation needs room for this many bytes,
        more than its bound: it asks again, ahead of the queue with the rest of its
        quantum, and is granted when that fits (docs/scheduling.md). ``idle_s`` (a burst's
        end): the seconds it held with no work at its end, an implicit burst's idle
        release, believed up to the idle release its grant told and the lease's GPU time:
        not counted in its burst (core/turns.py: its usual burst is its work's)."""
        s = self.st.get(sid)
        now = self.clock.monotonic()
        self.st.ledger.check_figures(s, "release", resident, swapped + discarded)
        count("release: discarded", discarded, s.memory.limit)
        count("release: swapping_out", swapping_out, s.memory.limit)
        count("release: swapped_out", swapped_out, s.memory.limit)
        count("release: need", need, s.memory.limit)
        if need and not (again and s.holding and s.memory.grows):
            raise FieldError(
                "release: need is for a holder that asks again, with a client that grows"
            )
        took = _seconds("release: seconds", seconds)
        tail = _seconds("release: idle_s", idle_s)
        if tail and again:
            raise FieldError("release: idle_s is for a burst's end, not with again")
        waiting = s.state is State.WAITING
        if not (s.holding or (waiting and (not again or s.esc.frozen or s.esc.yield_due))):
            raise ArbiterError(f"session {sid} holds no lease to release ({s.state})")
        self.st.set_discarded(s, discarded)  # (the input checked whole: now it may change)
        if waiting and not again:
            self._end_burst_waiting(s, now, resident, swapped)
        elif waiting:
            self._answer_while_waiting(s, now, resident, swapped, swapped_out, took)
        else:
            s.memory.need = max(s.memory.need, need)
            grow = bool(need)
            self._release_lease(
                s, now, resident, swapped, again, swapped_out, took, swapping_out, grow, tail
            )
        return self._decide()

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
        discarded: int = 0,
    ) -> list[Action]:
        """A swap ended (or failed: ``error``). ``prefetch``: the swap-in was the
        prefetch asked by that :class:`PrefetchAction` (its ``seq``), and the client is
        done with every ask up to it. ``discarded``: discardable bytes it holds dropped
        now (a swap-out drops them first, copying nothing; a swap-in makes them again)."""
        st = self.st
        s = st.get(sid)
        if direction not in ("in", "out"):
            raise FieldError(f"swap_done: direction must be in or out, not {direction!r}")
        count("swap_done: bytes", nbytes, s.memory.limit)
        took = _seconds("swap_done: seconds", seconds)
        count("swap_done: prefetch", prefetch, MAX_COUNT)
        if prefetch and (direction != "in" or prefetch > s.prefetch.seq):
            raise ArbiterError(f"no prefetch {prefetch} was asked of session {sid}")
        st.ledger.check_figures(s, "swap_done", resident, swapped + discarded)
        count("swap_done: discarded", discarded, s.memory.limit)
        check_error(error)
        now = self.clock.monotonic()
        st.set_discarded(s, discarded)  # first: its swap_out event counts these drops too
        if error:
            if direction == "out" or prefetch:
                if direction == "out":
                    s.memory.pending_out = 0  # the planner will look for another way
                    st.deadlines.set_swap_out(s, math.inf)
                st.deadlines.retry_after_failure(s, now, st.sessions)
            swap = SwapOut if direction == "out" else SwapIn
            st.out.emit(swap(session=sid, bytes=0, seconds=took, error=error))
        else:
            dropped = st.take_dropped(s) if direction == "out" else 0
            st.count_swap(s, direction, nbytes, took, prefetch=bool(prefetch), dropped=dropped)
        if prefetch:
            if prefetch == s.prefetch.seq:  # no later ask is out: counted at what it has
                s.prefetch.moot()
        elif direction == "in":
            s.memory.swapping_in = False
            if s.state is State.HOLDING:
                # The quantum is GPU time: it starts once the memory is back (or the
                # swap-in failed, and the workload gives the lease back).
                s.lease.gpu_since = now
                s.lease.quantum_end = now + s.lease.quantum_len
        st.set_memory(s, resident, swapped)
        return self._decide()

    def report(self, sid: int, *, resident: int, swapped: int, discarded: int = 0) -> list[Action]:
        """The session's memory now (``discarded``: discardable bytes it dropped, neither
        on the GPU nor in host memory). Resident bytes over its limit are the workload's
        own word that it broke the limit: escalated (once per stretch), the figures the
        node keeps unchanged. A holder past its grant's bound: core/lending.py."""
        s = self.st.get(sid)
        count("report: resident", resident, MAX_COUNT)
        count("report: swapped", swapped, s.memory.limit)
        if resident <= s.memory.limit:
            self.st.ledger.check_figures(s, "report", resident, swapped + discarded)
            count("report: discarded", discarded, s.memory.limit)
            lending.past_bound(self.st, s, resident, self.leases.revoke)
            self.st.set_discarded(s, discarded)
            self.st.set_memory(s, resident, swapped)
        self.escalation.check_limit(s, resident, "resident_bytes")
        return self._decide()

    def over_limit(self, sid: int, *, used: int) -> list[Action]:
        """The GPU itself (NVML) says the session uses ``used`` bytes."""
        s = self.st.get(sid)
        count("used", used, MAX_COUNT)
        self.escalation.check_limit(s, used, "used_bytes")
        return self._decide()

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
        w = self.window.holder
        ids = [*self.st.holders, *(() if w is None else (w,))]
        running = {sid: self.quantum(self.st.sessions[sid]) for sid in ids}
        for key, value in changes.items():
            setattr(self.settings, key, value)
        for sid, before in running.items():
            s = self.st.sessions[sid]
            cut = before - self.quantum(s)
            if cut > 0 and s.state is not State.YIELDING and not s.share.turn:
                if not math.isinf(s.lease.quantum_end):
                    s.lease.quantum_end -= cut
                s.lease.quantum_len = max(0.0, s.lease.quantum_len - cut)
        if changes:
            self.st.out.emit(Config(**changes))
        return self._decide()

    def tick(self) -> list[Action]:
        """Let time pass: quanta end, grace periods run out."""
        return self._decide()

    def _end_burst_waiting(self, s: SessionState, now: float, resident: int, swapped: int) -> None:
        """The burst ended before it was granted (the workload gave up waiting), or the
        burst whose lease it claimed ended (the answer to the yield it was told)."""
        st = self.st
        st.queue.remove(s.id)
        st.end_wait(s, now)
        s.state, s.esc.claim = State.IDLE, 0
        self.claims.clear(s)
        s.lease.idle_since = now
        s.share.turn, s.share.resume_s, s.share.continued = False, 0.0, False
        Shares.went_idle(s)
        s.prefetch.moot()
        st.set_memory(s, resident, swapped)

    def _answer_while_waiting(
        self, s: SessionState, now: float, resident: int, swapped: int, out: int, took: float
    ) -> None:
        """The answer to a revoke that crossed the freeze, or to the yield it was told: it
        waits already; keep the figures of what it swapped out on the way."""
        st = self.st
        if out:
            st.count_swap(s, "out", out, took)
        if s.esc.yield_due:  # it worked until now: its wait begins, behind the others
            self.claims.clear(s)
            st.queue.remove(s.id)
            st.queue.append(s.id)
            s.lease.wait_start = now
        st.set_memory(s, resident, swapped)

    def _release_lease(
        self,
        s: SessionState,
        now: float,
        resident: int,
        swapped: int,
        again: bool,
        out: int,
        took: float,
        swapping_out: int,
        grow: bool = False,
        tail: float = 0.0,
    ) -> None:
        st, ls, m = self.st, s.lease, s.memory
        caps.settle(s, now)  # (holding still: its GPU time spent from the bucket)
        revoked = s.state is State.YIELDING
        held = now - ls.start
        s.totals.lease_s += held
        gpu = max(0.0, now - ls.gpu_since)  # GPU time: after the swap-in
        s.share.burst_lease += gpu
        tail = min(tail, ls.idle_release, gpu)  # (no more than it was told, or held)
        st.holders.remove(s.id)
        turn = s.share.turn
        # An older client swapped out before it released: that copy is no GPU time.
        ended = now - (took if out else 0.0)
        if not self.turns.settle(s, ended) and revoked:
            self.shares.settle(s, ended)
        if out:
            st.count_swap(s, "out", out, took)
        # The release answers the revoke's ask, whatever was done: what is still missing
        # is planned anew, so a short answer cannot leave the queue waiting on bytes.
        m.pending_out = 0
        m.room = 0
        m.swapping_in = False  # what it has is what it says now
        st.set_memory(s, resident, swapped)
        m.pending_out = min(swapping_out, m.resident)
        if m.pending_out:  # swapping out after the release, as a non-holder: a deadline
            st.deadlines.set_swap_out(s, now + self.settings.grace_s)
        reason = "revoked" if revoked else ("grow" if grow else ("yield" if again else "burst_end"))
        lease, ls.number = ls.number, 0
        s.esc.escalated = False
        window = 0.0
        lending.returned(m)
        if grow and not revoked and not s.share.resume_s:  # yielded to grow: the rest of its
            left = ls.quantum_end - now  # quantum next, ahead of the queue
            s.share.resume_s = max(0.0, left) if math.isfinite(left) else ls.quantum_len
        if again:
            self._asks_again(s, now, revoked, turn)
        else:
            window = self._went_idle(s, now, revoked or turn, tail)
        fields: dict[str, Any] = {"anticipate_s": window} if window else {}
        st.out.emit(Release(session=s.id, lease=lease, seconds=held, reason=reason, **fields))
        if window:
            self.window.open(s, now + window)

    def _asks_again(self, s: SessionState, now: float, revoked: bool, turn: bool) -> None:
        """It yielded and asks again: in the queue (first, a quantum a turn paused); a
        turn that ran out waits for its next one (core/turns.py); a gang's member parks."""
        self.leases.enqueue(s, front=s.share.resume_s > 0)  # paused: it goes on next
        if revoked:
            self.turns.went_on(s, now, turn=turn)
        if revoked and s.rank.gang:  # its gang holds the GPU until every member yields
            self.gangs.park(s, now)

    def _went_idle(self, s: SessionState, now: float, windowless: bool, tail: float) -> float:
        """Its burst ended: idle, its burst's work (less its idle ``tail``) counted; the
        window its quantum waits for it (none after a revoke or a turn)."""
        s.state = State.IDLE
        s.lease.idle_since = now
        s.memory.need = 0
        s.share.resume_s = 0.0
        Shares.went_idle(s)
        self.st.ledger.recount(s)
        window = 0.0 if windowless else self.window.length(s, now)
        work = max(0.0, s.share.burst_lease - tail)
        self.turns.burst_ended(s, now, work, windowed=window > 0)
        s.share.burst_lease = 0.0
        return window

    # --- queries --------------------------------------------------------------------

    def next_deadline(self) -> float | None:
        """When :meth:`tick` next has something to do (monotonic seconds), if ever."""
        return self.timers.next()

    def verify(self) -> None:
        """Check the running totals against scans of every session (O(sessions): for
        tests, and for ``check_every_input``); AssertionError names the first that
        differs (raised, not asserted: it holds under ``python -O`` too)."""
        st = self.st
        wrong = st.ledger.verify(st.sessions.values())
        wrong += st.deadlines.verify(st.sessions)
        wrong += self.claims.verify()
        wrong += self.window.verify()
        wrong += self.caps.verify()
        wrong += self.timers.verify()
        if wrong:
            raise AssertionError(f"GPU {self.gpu}: {wrong[0]}")

    # --- the decision loop ----------------------------------------------------------

    def _decide(self) -> list[Action]:
        st = self.st
        now = self.clock.monotonic()
        st.deadlines.advanced = now  # the plans below see every retry due by now
        if st.deadlines.asked or self.claims.told:
            self.escalation.overdue_swap_outs(now)
            self.claims.overdue(now)
        self.turns.reconsider(now)  # refused servers whose credit now covers a turn
        self.window.expire(now)
        if self.window.holder is not None and self.turns.due():
            self.window.pause(now)
        self.admission.grant_what_fits()
        if self.turns.due():  # a turn first in line that cannot join the holders
            for sid in list(st.holders):
                h = st.sessions[sid]
                if self.turns.preempts(h):
                    h.share.resume_s = max(0.0, h.lease.quantum_end - now)
                    self.leases.revoke(h, now, reason="turn")
        self.leases.fill_rooms()
        self._end_quanta(now)
        plan_prefetch(st, now, taken=self.admission.taken())
        out = st.out.take()
        if self.check_every_input:
            self.verify()
        return out

    def _end_quanta(self, now: float) -> None:
        """Quanta that ended: revoked where someone waits, else renewed (no needless
        switch); holders past their grace period escalated."""
        st = self.st
        for sid in list(st.holders):
            s = st.sessions[sid]
            if s.state is State.HOLDING and s.lease.quantum_end <= now:
                if self.gangs.others_wait(s) and not self.caps.all_resting(now):
                    if not self.turns.renew(s, now):  # (a turn goes on while its credit does)
                        self.leases.revoke(s, now)
                elif caps.dry(s, now):  # its compute limit: it rests, the GPU idle or not
                    self.leases.revoke(s, now, reason="compute_limit")
                else:  # nobody waits: a new quantum, no needless switch
                    Turns.over(s)
                    s.lease.quantum_len = caps.capped_quantum(s, self.quantum(s), now)
                    s.lease.quantum_end = now + s.lease.quantum_len
            elif (
                s.state is State.YIELDING and not s.esc.escalated and s.lease.revoke_deadline <= now
            ):
                self._escalate_holder(s, now)

    def _escalate_holder(self, s: SessionState, now: float) -> None:
        """A holder that did not yield within its grace period."""
        s.esc.escalated = True
        fields: dict[str, Any] = {"grace_s": self.settings.grace_s}
        g = self.gangs.of(s)
        if g is not None:  # the gang as a whole: all its members still holding, once
            g.escalated = True
            fields["gang"] = g.key
        if self.escalation.escalate(s, "no_yield_within_grace", fields) == "freeze":
            self.leases.freeze(s, now)
            self.admission.grant_what_fits()


def _ewma(old: float, sample: float) -> float:
    return old + EWMA * (sample - old)

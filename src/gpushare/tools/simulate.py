"""``gpushare simulate``: a policy study on the real arbiter, under a virtual clock.

Model workloads drive :class:`~gpushare.core.arbiter.Arbiter` as the client runtime does
(``gpushare.client.lease``): a burst asks and waits; a grant's swap-in comes back chunk
by chunk within the room the node gives, then the work runs in steps with a safe point
after each; a revoke is answered at the next safe point with a release, then the
swap-out it asked; swap-outs asked of idle or waiting sessions, and prefetches asked of
the next holder, run one at a time per session. Copies book the lanes of one modelled
PCIe link (:func:`gpushare.simlink.book`: the timing model of the simulated GPUs), apart
from compute, as a GPU's copy engines are. Several holders at once (mode ``auto``) share
the GPU's compute: a step takes as many times longer as there are sessions working.

Workloads: ``batch`` (one long burst), ``short`` (bursts of 100 ms of work, 1 ms apart),
``interactive`` (notebook cells of 50-200 ms of work, 0.5-1.5 s of thinking between),
``server`` (requests in Poisson arrivals, each of a fixed GPU time, served one after
another, from the end of its start, the first burst, as a server is sent requests once
it has loaded its model; its burst ends ``idle_release`` after the last (or what its
grant says: a session the node takes for a server is told a short one), as the client's
implicit bursts do, its release saying that idle time; memory it can drop rather than
swap, ``discard``, is freed and made again without a copy). A server's wait is a
request's, from its arrival to its answer.
For each TQ the study runs the mix, the same sessions as batch jobs (the ideal: one switch
per quantum), and the mix's batch jobs alone (what the others cost them), and reports
goodput (GPU seconds of work per second), waits and batch loss. Deterministic: the same
mix, settings and seed give the same figures.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from gpushare.core.actions import (
    Action,
    GrantAction,
    PrefetchAction,
    RevokeAction,
    RoomAction,
    SwapOutAction,
)
from gpushare.core.arbiter import Arbiter
from gpushare.core.attach import AttachRecord
from gpushare.core.clock import ManualClock
from gpushare.settings import GpuSettings
from gpushare.simlink import IN, OUT, book
from gpushare.units import parse_size

Kind = Literal["batch", "short", "interactive", "server"]
KINDS: tuple[Kind, ...] = ("batch", "short", "interactive", "server")
GiB = 2**30
CHUNK = 256 * 2**20  # the swap granularity of the client's backends
STEP_S = 0.005  # work between two safe points
Task = Callable[[Callable[[], None]], None]  # runs, then calls its argument when done


@dataclass(frozen=True)
class Workload:
    kind: Kind
    memory: int
    weight: float = 1.0
    name: str = ""
    rate: float = 1.0  # server: requests per second (Poisson arrivals)
    service_s: float = 0.2  # server: a request's GPU time
    discard: int = 0  # server: bytes of its memory it drops rather than swaps (a cache)
    # Its memory limit, above SIZE (its request, what it holds): packed by the request in
    # mode auto (docs/scheduling.md 6). 0: SIZE is both.
    limit: int = 0

    @classmethod
    def parse(cls, text: str) -> Workload:
        """``KIND:SIZE[@WEIGHT]``, e.g. ``batch:30GiB``, ``interactive:10GiB@0.5``; any
        takes ``,limit=SIZE`` (SIZE is then its request: ``batch:20GiB,limit=60GiB``); a
        server takes ``,rate=R`` (requests/s), ``,service=S`` (GPU s of each) and
        ``,discard=SIZE``: ``server:20GiB@1,rate=2,service=0.17,discard=8GiB``."""
        head, *opts = text.split(",")
        kind, _, rest = head.partition(":")
        size, _, weight = rest.partition("@")
        if kind not in KINDS or not size:
            raise ValueError(
                f"workload {text!r}: write KIND:SIZE[@WEIGHT], KIND one of {', '.join(KINDS)}"
            )
        try:
            w = float(weight) if weight else 1.0
        except ValueError:
            w = math.nan
        if not (w > 0 and math.isfinite(w)):
            raise ValueError(f"workload {text!r}: the weight must be a positive number")
        memory = parse_size(size)
        extra = _options(text, kind, memory, opts)
        return cls(kind, memory, w, **extra)  # type: ignore[arg-type]


def _options(text: str, kind: str, memory: int, opts: list[str]) -> dict[str, float | int]:
    """A workload's options (``limit``; a server's ``rate``, ``service``, ``discard``)."""
    extra: dict[str, float | int] = {}
    for opt in opts:
        key, _, value = opt.partition("=")
        if key == "limit" and value:
            extra["limit"] = parse_size(value)
            if extra["limit"] < memory:
                raise ValueError(
                    f"workload {text!r}: its limit is below its request (SIZE):"
                    " give a limit at least as large"
                )
            continue
        if kind != "server" or key not in ("rate", "service", "discard") or not value:
            raise ValueError(
                f"workload {text!r}: options are limit=SIZE, and for a server rate=R,"
                " service=SECONDS, discard=SIZE"
            )
        if key == "discard":
            extra["discard"] = parse_size(value)
            if extra["discard"] > memory:
                raise ValueError(f"workload {text!r}: discard is more than its memory")
            continue
        try:
            x = float(value)
        except ValueError:
            x = math.nan
        if not (x > 0 and math.isfinite(x)):
            raise ValueError(f"workload {text!r}: {key} must be a positive number")
        extra["rate" if key == "rate" else "service_s"] = x
    return extra


MIXES: dict[str, tuple[Kind, ...]] = {
    "batch": ("batch", "batch", "batch"),
    "short": ("short", "short", "short"),
    "interactive": ("batch", "batch", "interactive"),
    "mixed": ("batch", "short", "interactive"),
}


def preset(mix: str, oversubscribed: bool, capacity: int) -> list[Workload]:
    """Three sessions: 3/8 of the GPU each (together over its memory) or 1/4 each."""
    share = capacity * 3 // 8 if oversubscribed else capacity // 4
    return [Workload(k, share) for k in MIXES[mix]]


@dataclass
class SessionFigures:
    name: str
    kind: Kind
    work_s: float = 0.0
    bursts: int = 0
    waits: list[float] = field(default_factory=list)
    swapped_in: int = 0
    swapped_out: int = 0
    discarded: int = 0  # bytes dropped instead of swapped out (a server's cache)
    requests: int = 0  # a server's requests answered


@dataclass
class Run:
    seconds: float
    sessions: list[SessionFigures]
    grants: int
    switches: int  # grants to another session than the last

    @property
    def goodput(self) -> float:
        return sum(s.work_s for s in self.sessions) / self.seconds

    def work(self, kind: Kind | None = None) -> float:
        return sum(s.work_s for s in self.sessions if kind is None or s.kind == kind)

    def waits(self, kind: Kind) -> list[float]:
        return [w for s in self.sessions if s.kind == kind for w in s.waits]


class _Client:
    def __init__(self, sim: Simulation, sid: int, w: Workload, rng: random.Random) -> None:
        self.sim, self.sid, self.w, self.rng = sim, sid, w, rng
        self.fig = SessionFigures(w.name or f"{w.kind}-{sid}", w.kind)
        self.resident, self.swapped = w.memory, 0
        self.phase = "idle"  # idle, asking, swapping_in, holding, yielding
        self.lease = 0
        self.grant: GrantAction | None = None
        self.revoke: RevokeAction | None = None
        self.room = 0  # while swapping in: the most it may have (0: no bound)
        self.parked: Callable[[], None] | None = None  # a swap-in waiting for room
        self.pf_room = self.pf_seq = self.pf_done = 0
        self.pf_running = False
        self.tasks: deque[Task] = deque()
        self.busy = False
        self.burst_left = 0.0
        self.asked_at = 0.0
        self.waiting_since: float | None = None  # the burst's ask, until it works
        # a server: its requests' arrivals, the one in progress and what is left of it;
        # tail: holding with none to serve, until idle_release passes (gen: that wait)
        self.pending: deque[float] = deque()
        self.current: float | None = None
        self.req_left = 0.0
        self.tail = False
        self.tail_s = 0.0  # its grant's idle release (0: the node's), as the client's
        self.tail_at = 0.0  # when the tail began (its release says how long it idled)
        self.gen = 0
        self.dropped = 0  # discardable bytes dropped (not on the GPU, not in host memory)
        self.arriving = False  # a server's requests come once its start has ended

    # --- a server's requests -----------------------------------------------------------
    def arrive(self) -> None:
        self.pending.append(self.sim.now)
        self.sim.at(self.rng.expovariate(self.w.rate), self.arrive)
        if self.phase == "idle":
            self.ask()
        elif self.tail:  # in its idle release: served at once, in the same lease
            self.tail = False
            self.gen += 1
            self.serve(0.0)

    def serve(self, seconds: float) -> None:
        """``seconds`` of the request in progress done (a safe point): answer it when
        it is, take the next, yield to a revoke, or wait idle_release for another."""
        self.req_left -= seconds
        if self.current is not None and self.req_left <= 1e-12:
            if self.fig.bursts > 1:  # (its first burst is its start, as anyone's: no turn)
                self.fig.waits.append(self.sim.now - self.current)
            self.fig.requests += 1
            self.current = None
        if self.revoke is not None and self.revoke.lease == self.lease:
            if self.current is None and not self.pending:
                return self.end_burst()
            return self.yield_lease()
        if self.current is None and self.pending:
            self.current, self.req_left = self.pending.popleft(), self.w.service_s
        if self.current is None:
            self.tail, self.tail_at = True, self.sim.now
            self.gen += 1
            gen = self.gen
            tail = self.tail_s or self.sim.arb.settings.anticipate_s
            self.sim.at(tail, lambda: self.tail_end(gen))
            return
        self.burst_left = self.req_left
        self.sim.work(self)

    def tail_end(self, gen: int) -> None:
        if self.tail and gen == self.gen:
            self.end_burst()

    def on_revoke(self) -> None:
        """A revoke while it waits for a request: nothing is running, it yields now."""
        if self.tail:
            self.end_burst()

    def end_burst(self) -> None:
        idle = self.sim.now - self.tail_at if self.tail else 0.0
        self.tail = False
        self.gen += 1
        self.phase, self.lease, self.revoke = "idle", 0, None
        arb = self.sim.arb
        self.sim.apply(
            arb.release(self.sid, resident=self.resident, swapped=self.swapped, idle_s=idle)
        )
        if self.w.kind == "server" and not self.arriving:  # started: it is sent requests
            self.arriving = True
            self.sim.at(self.rng.expovariate(self.w.rate), self.arrive)

    # --- the burst -------------------------------------------------------------------
    def ask(self) -> None:
        self.fig.bursts += 1
        if self.w.kind == "server":
            self.burst_left = 0.0
        elif self.w.kind == "batch":
            self.burst_left = math.inf
        elif self.w.kind == "short":
            self.burst_left = 0.1
        else:
            self.burst_left = self.rng.uniform(0.05, 0.2)
        self.waiting_since = self.sim.now
        self.phase = "asking"
        self.sim.apply(self.sim.arb.acquire(self.sid))

    def think(self) -> float:
        return 0.001 if self.w.kind == "short" else self.rng.uniform(0.5, 1.5)

    def on_grant(self, g: GrantAction) -> None:
        if self.phase not in ("asking", "yielding") or self.grant is not None:
            return  # not asked for (crossed a release): the release gives it back
        self.grant, self.lease = g, g.lease
        self.tail_s = g.idle_release_s
        self.room = g.room if g.room < self.w.memory else 0
        self.serial(self._take_grant)

    def _take_grant(self, done: Callable[[], None]) -> None:
        g, self.grant = self.grant, None
        assert g is not None
        self.phase = "swapping_in"
        moved, t0 = self.swapped, self.sim.now

        def finished() -> None:
            if self.room:  # work may grow the session to its limit: room first
                self.parked = finished
                return
            if moved:
                self.swap_done("in", moved, self.sim.now - t0)
            done()
            self.phase = "holding"
            if self.waiting_since is not None and self.w.kind != "server":
                # not its first burst: a session's start (a real one allocates in it), never
                # a turn, waits its turn in the queue (docs/scheduling.md)
                if self.fig.bursts > 1:
                    self.fig.waits.append(self.sim.now - self.waiting_since)
                self.waiting_since = None
            if self.w.kind == "server":
                self.serve(0.0)
            else:
                self.sim.work(self)

        self.copy_in(lambda: self.room, finished)

    def step_done(self, seconds: float) -> None:
        """A safe point after ``seconds`` of work."""
        self.fig.work_s += seconds
        if self.w.kind == "server":
            return self.serve(seconds)
        self.burst_left -= seconds
        arb = self.sim.arb
        if self.burst_left <= 1e-12:  # the burst's end
            self.phase, self.lease, self.revoke = "idle", 0, None
            self.sim.apply(arb.release(self.sid, resident=self.resident, swapped=self.swapped))
            self.sim.at(self.think(), self.ask)
        elif self.revoke is not None and self.revoke.lease == self.lease:
            self.yield_lease()
        else:
            self.sim.work(self)

    def yield_lease(self) -> None:
        """At a safe point, revoked: release and ask again, then swap out what it asked."""
        assert self.revoke is not None
        n = min(self.revoke.swap_out, self.resident)
        self.revoke, self.lease = None, 0
        self.waiting_since = self.sim.now
        self.phase = "yielding" if n else "asking"
        self.sim.apply(
            self.sim.arb.release(
                self.sid,
                resident=self.resident,
                swapped=self.swapped,
                again=True,
                swapping_out=n,
            )
        )
        if n:
            self.serial(lambda done: self.copy_out(n, done, rejoin=True))

    # --- swaps (one at a time, as under the client's swap lock) ----------------------
    def serial(self, task: Task) -> None:
        self.tasks.append(task)
        if not self.busy:
            self._next()

    def _next(self) -> None:
        if not self.tasks:
            self.busy = False
            return
        self.busy = True
        self.tasks.popleft()(self._next)

    def copy_chunk_in(self, k: int, then: Callable[[], None]) -> None:
        """``k`` bytes back on the copy-in lane: on the GPU at once (the copy holds its
        destination), reported when the copy ends, then ``then``."""
        if self.dropped:  # made again empty, not copied
            k = min(k, self.dropped)
            self.dropped -= k
            self.resident += k
            self.swapped -= k
            self.sim.at(0.0, self.report_then(then))
            return
        self.resident += k
        self.swapped -= k
        self.fig.swapped_in += k
        end = self.sim.book(IN, k)
        self.sim.at(end - self.sim.now, self.report_then(then))

    def copy_in(self, room: Callable[[], int], finished: Callable[[], None]) -> None:
        """Chunks back while ``room()`` allows (0: no bound); parks when it does not."""

        def chunk() -> None:
            if not self.swapped:
                return finished()
            k = min(CHUNK, self.swapped)
            r = room()
            if r and self.resident + k > r:
                self.parked = chunk
                return
            self.copy_chunk_in(k, chunk)

        chunk()

    def copy_out(self, n: int, done: Callable[[], None], rejoin: bool = False) -> None:
        left, t0 = min(n, self.resident), self.sim.now
        moved = left

        def chunk() -> None:
            nonlocal left
            if left <= 0:
                self.swap_done("out", moved, self.sim.now - t0)
                if rejoin and self.phase == "yielding":
                    self.phase = "asking"
                return done()
            k = min(CHUNK, left)
            drop = min(k, self.w.discard - self.dropped)  # its cache goes first, uncopied
            if drop > 0:
                k = drop
            end = self.sim.now if drop > 0 else self.sim.book(OUT, k)

            def freed() -> None:  # GPU memory is freed as its copy ends
                nonlocal left
                left -= k
                self.resident -= k
                self.swapped += k
                if drop > 0:
                    self.dropped += k
                    self.fig.discarded += k
                else:
                    self.fig.swapped_out += k
                self.report_then(chunk)()

            self.sim.at(end - self.sim.now, freed)

        chunk()

    def report_then(self, then: Callable[[], None]) -> Callable[[], None]:
        def go() -> None:
            self.sim.apply(
                self.sim.arb.report(self.sid, resident=self.resident, swapped=self.swapped)
            )
            then()

        return go

    def swap_done(
        self, direction: Literal["in", "out"], n: int, s: float, pf: int = 0, error: str = ""
    ) -> None:
        self.sim.apply(
            self.sim.arb.swap_done(
                self.sid,
                direction=direction,
                nbytes=n,
                seconds=s,
                resident=self.resident,
                swapped=self.swapped,
                prefetch=pf,
                error=error,
            )
        )

    def on_room(self, room: int) -> None:
        self.room = 0 if room >= self.w.memory else room
        if self.parked is not None:
            go, self.parked = self.parked, None
            go()

    def on_swap_out(self, n: int) -> None:
        if self.phase in ("holding", "swapping_in") or self.grant is not None:
            self.swap_done("out", 0, 0.0, error="session holds the GPU")
            return
        self.serial(lambda done: self.copy_out(n, done))

    def on_prefetch(self, a: PrefetchAction) -> None:
        if self.phase not in ("asking", "yielding") or self.grant is not None:
            return
        self.pf_room, self.pf_seq = a.room, a.seq
        if not self.pf_running:
            self.pf_running = True
            self.serial(self._prefetch)

    def _prefetch(self, done: Callable[[], None]) -> None:
        t0, before = self.sim.now, self.resident

        def stop() -> None:
            self.pf_running = False
            seq = self.pf_seq
            self.pf_done = seq
            self.swap_done("in", self.resident - before, self.sim.now - t0, pf=seq)
            done()

        def chunk() -> None:
            k = min(CHUNK, self.swapped)
            if not k or self.grant is not None or self.resident + k > self.pf_room:
                return stop()
            self.copy_chunk_in(k, chunk)

        chunk()


class Simulation:
    """One GPU, its arbiter and model workloads, on a virtual clock."""

    def __init__(
        self,
        workloads: Sequence[Workload],
        capacity: int,
        settings: GpuSettings,
        bandwidth: float = 55e9,
        step_s: float = STEP_S,
        seed: int = 1,
    ) -> None:
        self.clock = ManualClock(start=0.0)
        self.arb = Arbiter(0, capacity, self.clock, settings)
        self.bandwidth, self.step_s = bandwidth, step_s
        self.lanes = [0.0, 0.0]
        self.heap: list[tuple[float, int, Callable[[], None]]] = []
        self.seq = itertools.count()
        self.clients: dict[int, _Client] = {}
        self.working: set[int] = set()
        self.grants = self.switches = 0
        self._last_holder = 0
        rng = random.Random(seed)
        for sid, w in enumerate(workloads, start=1):
            c = _Client(self, sid, w, random.Random(rng.random()))
            self.clients[sid] = c
            # its memory made: on the GPU as far as it fits, the rest in host memory (the
            # node refuses a session whose memory could not be there)
            c.resident = min(w.memory, max(0, capacity - self.arb.used_bytes()))
            c.swapped = w.memory - c.resident
            c.dropped = min(w.discard, c.swapped)  # a cache not made yet
            figures = AttachRecord(
                name=c.fig.name,
                memory_limit=w.limit or w.memory,
                # the model holds its request and never more: it never needs to ask
                memory_request=w.memory if w.limit else None,
                grows=True,
                weight=w.weight,
                resident=c.resident,
                swapped=c.swapped,
                fills=True,
                prefetch=True,
            )
            self.apply(self.arb.attach(sid, figures))
            # a notebook's first cell comes after its user has thought too; a server starts
            # (its model loaded, its memory made) before the others, as one does before its
            # first request: its start, like anyone's, is no turn and not counted
            start = 0.0 if w.kind == "server" else 0.001 * sid
            self.at(start + (c.think() if w.kind == "interactive" else 0.0), c.ask)

    @property
    def now(self) -> float:
        return self.clock.monotonic()

    def at(self, delay: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self.heap, (self.now + max(delay, 0.0), next(self.seq), fn))

    def book(self, lane: int, nbytes: int) -> float:
        return book(self.lanes, lane, nbytes, self.bandwidth, self.now)

    def work(self, c: _Client) -> None:
        """One step of ``c``'s work, slower while others work beside it (mode auto)."""
        self.working.add(c.sid)
        step = min(self.step_s, c.burst_left)
        share = len(self.working)

        def end() -> None:
            self.working.discard(c.sid)
            c.step_done(step)

        self.at(step * share, end)

    def apply(self, actions: list[Action]) -> None:
        for a in actions:
            if isinstance(a, GrantAction):
                self.grants += 1
                if a.session != self._last_holder:
                    self.switches += 1
                    self._last_holder = a.session
                self.clients[a.session].on_grant(a)
            elif isinstance(a, RevokeAction):
                c = self.clients[a.session]
                if a.lease == c.lease:
                    c.revoke = a
                    c.on_revoke()
            elif isinstance(a, RoomAction):
                self.clients[a.session].on_room(a.room)
            elif isinstance(a, SwapOutAction):
                self.clients[a.session].on_swap_out(a.bytes)
            elif isinstance(a, PrefetchAction):
                self.clients[a.session].on_prefetch(a)
            # events and escalations: the model's workloads always yield in time

    def run(self, seconds: float) -> Run:
        end = self.now + seconds
        while True:
            t_ev = self.heap[0][0] if self.heap else math.inf
            t_dl = self.arb.next_deadline()
            t = min(t_ev, math.inf if t_dl is None else t_dl)
            if t > end:
                self.clock.set(end)
                break
            self.clock.set(max(t, self.now))
            if t_ev <= t:
                heapq.heappop(self.heap)[2]()
            else:
                self.apply(self.arb.tick())
        return Run(seconds, [c.fig for c in self.clients.values()], self.grants, self.switches)


# --- the study -------------------------------------------------------------------------

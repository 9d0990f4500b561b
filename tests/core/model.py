"""A discrete-event model of workloads driving a real Arbiter on a ManualClock.

Model clients obey the protocol as the real client does (swap in after a grant, answer
a revoke after a delay, swap out when asked), with swap times from a bandwidth. Clients
that ``fill`` (the current client) release first and then swap out chunk by chunk,
reporting each, and swap in chunk by chunk within the room the arbiter gives; the others
(older clients) swap out before releasing and swap in all at once. Clients that
``prefetch`` swap in ahead of their grant, within the room a prefetch ask gives, and say
when they are done with it. The model tracks the
bytes each client really has on the GPU, in flight included, so tests can check the
arbiter's invariants against what would physically be there.

Clients of kind ``ddp`` are the ranks of a distributed job (``job``): while holding they
work in steps of ``step_s``, each ending in a collective that waits for every rank of the
job; a rank has a safe point after each collective, where it yields to a revoke. They
tell the arbiter their job (as a gang) unless ``send_gang`` is off, as a client that
does not know it is a rank.

Clients of kind ``server`` answer requests: ``arrivals`` gives each request's gap after
the one before and its GPU time. A request that finds it idle asks for the lease; while
it holds, requests are served one after another, and ``tail_s`` after the last (the
client's idle release) the burst ends. A revoke is answered between decoding steps
(after its delay): the request in progress keeps what is left of it for the next grant.
``latencies`` holds each request's arrival and the time from it to its answer, ``waits``
to the start of its service.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
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
from gpushare.core.arbiter import Arbiter
from gpushare.core.attach import AttachRecord
from gpushare.core.clock import ManualClock
from gpushare.settings import GpuSettings

GiB = 2**30
CHUNK = 4 * GiB  # the fill clients' swap granularity (coarse: the test runs many)
Task = Callable[[Callable[[], None]], None]  # runs, then calls its argument when done


def actions_of(actions, kind):
    """The actions of one kind among an arbiter's answer."""
    return [a for a in actions if isinstance(a, kind)]


def events_of(actions, name):
    """The event records named ``name`` among an arbiter's answer."""
    return [a.record for a in actions if getattr(a, "record", {}).get("event") == name]


@dataclass
class Client:
    sid: int
    limit: int
    weight: float = 1.0
    kind: str = "batch"  # batch: always wants; bursty: bursts then think time
    burst_s: float = 1.0
    think_s: float = 1.0
    yield_delay: float = 0.01
    delays: Iterator[float] | None = None  # one per revoke, where given (else yield_delay)
    stuck: bool = False  # never answers a revoke (the escalation must deal with it)
    on_gpu: int = 0  # bytes physically on the GPU now (swap-outs in flight count)
    in_host: int = 0
    holding: bool = False
    swapping_in: bool = False
    fills: bool = False
    prefetch: bool = False
    room: int = 0  # while filling: the most it may have on the GPU
    pf_room: int = 0  # the latest prefetch ask: the most it may have on the GPU
    pf_seq: int = 0
    pf_running: bool = False
    parked: Callable[[], None] | None = None  # a fill waiting for room
    busy: bool = False  # the real client does one swap at a time, under its lock
    tasks: deque[Task] = field(default_factory=deque)
    wants: bool = False
    lease: int = 0
    grant_times: list[float] = field(default_factory=list)
    want_since: float = 0.0
    waits: list[float] = field(default_factory=list)
    work_since: float | None = None  # holding with its memory back: GPU time
    work: list[tuple[float, float]] = field(default_factory=list)
    # ddp ranks
    job: str = ""
    send_gang: bool = True
    step_s: float = 0.05
    pos: str = "safe"  # safe (at a safe point), step (working), barrier (in the collective)
    steps: int = 0  # collectives completed
    revoked_lease: int = 0  # the revoke seen (acted on at the next safe point)
    frozen: bool = False
    # servers
    arrivals: Iterator[tuple[float, float]] | None = None
    tail_s: float = 0.5
    # [arrival, GPU s left, begun (1.0) or not]
    pending: deque[list[float]] = field(default_factory=deque)
    serving: tuple[float, float, float] | None = None  # arrival, started, GPU s left then
    gen: int = 0  # the server's scheduled step; a newer one cancels it
    latencies: list[tuple[float, float]] = field(default_factory=list)
    request_waits: list[tuple[float, float]] = field(default_factory=list)


def drive(
    clock: ManualClock,
    heap: list[tuple[float, int, Callable[[], None]]],
    until: float,
    deadline: Callable[[], tuple[float, int]],
    tick: Callable[[int], None],
) -> None:
    """Run ``until`` seconds: the model's events in time order, and the arbiters' ticks
    at their deadlines (``deadline``: the next one and its GPU)."""
    end = clock.monotonic() + until
    while True:
        t_ev = heap[0][0] if heap else float("inf")
        t_dl, gpu = deadline()
        t = min(t_ev, t_dl)
        if t > end:
            clock.set(end)
            return
        clock.set(max(t, clock.monotonic()))
        if t_ev <= t_dl:
            _, _, fn = heapq.heappop(heap)
            fn()
        else:
            tick(gpu)


class Model:
    def __init__(
        self,
        capacity: int,
        settings: GpuSettings | None = None,
        bandwidth: float = 55e9,
        check: Callable[[Model], None] | None = None,
    ) -> None:
        self.clock = ManualClock()
        self.arb = Arbiter(0, capacity, self.clock, settings or GpuSettings())
        self.capacity = capacity
        self.bw = bandwidth
        self.clients: dict[int, Client] = {}
        self.heap: list[tuple[float, int, Callable[[], None]]] = []
        self.seq = itertools.count()
        self.events: list[dict[str, object]] = []
        self.grants: list[int] = []
        self.check = check
        self.max_holders = 0
        self.max_on_gpu = 0
        # what the clients do on each kind of action in an arbiter's answer
        self._handlers: dict[type[Action], Callable[[Any], None]] = {
            EventAction: self._on_event,
            GrantAction: lambda a: self._on_grant(self.clients[a.session], a),
            RevokeAction: self._on_revoke,
            EscalateAction: self._on_escalate,
            SwapOutAction: self._on_swap_out,
            PrefetchAction: self._on_prefetch,
            RoomAction: self._on_room,
        }

    # --- plumbing -------------------------------------------------------------------
    def at(self, delay: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self.heap, (self.clock.monotonic() + delay, next(self.seq), fn))

    def apply(self, actions: list[Action]) -> None:
        """Act on an arbiter's answer as the clients would, then check what is on the GPU."""
        for a in actions:
            handle = self._handlers.get(type(a))
            if handle is not None:  # the others (thaw, limits) change nothing modelled
                handle(a)
        self._observe()

    def _on_event(self, a: EventAction) -> None:
        self.events.append(a.record)

    def _on_revoke(self, a: RevokeAction) -> None:
        c = self.clients[a.session]
        if c.kind == "ddp":  # seen after its delay, acted on at its next safe point
            assert not a.swap_out, "a gang member asked to swap out as it yields"
            # A revoke right behind its grant (a regroup) is read with it.
            soon = c.lease == a.lease and c.grant_times[-1] == self.clock.monotonic()
            delay = 0.0 if soon else c.yield_delay
            self.at(delay, lambda c=c, a=a: self._ddp_revoked(c, a.lease))
        elif not c.stuck:
            delay = c.yield_delay if c.delays is None else next(c.delays)
            self.at(delay, lambda c=c, a=a: self._yield(c, a))

    def _on_escalate(self, a: EscalateAction) -> None:
        if a.escalation == "freeze":  # SIGSTOP: it issues no GPU work
            self._stop_work(self.clients[a.session])
            self.clients[a.session].holding = False
            self.clients[a.session].frozen = True
        elif a.escalation == "kill":
            self.at(0.0, lambda sid=a.session: self.kill(sid) if sid in self.clients else None)

    def _on_swap_out(self, a: SwapOutAction) -> None:
        c = self.clients[a.session]
        assert not c.holding, "the planner asked a holder to swap out"
        assert not c.pf_running, "the planner asked a prefetching session to swap out"
        self._swap_out(c, a.bytes)

    def _on_prefetch(self, a: PrefetchAction) -> None:
        c = self.clients[a.session]
        assert c.prefetch, "a prefetch asked of a client that cannot"
        assert c.wants and not c.holding, "a prefetch asked of a holder or idle session"
        assert a.seq > c.pf_seq and a.room > c.pf_room, "a prefetch ask went back"
        c.pf_room, c.pf_seq = a.room, a.seq
        if not c.pf_running:
            c.pf_running = True
            self.serial(c, lambda done, c=c: self._prefetch(c, done))

    def _on_room(self, a: RoomAction) -> None:
        c = self.clients[a.session]
        assert a.room > c.room or not c.room, "a room shrank"
        c.room = 0 if a.room >= c.limit else a.room
        if c.parked:
            go, c.parked = c.parked, None
            self.at(0.0, go)

    def _observe(self) -> None:
        # Holders of different jobs (a gang is one job): one at most in mode exclusive.
        exclusive = len({c.job or c.sid for c in self.clients.values() if c.holding})
        self.max_holders = max(self.max_holders, exclusive)
        on_gpu = sum(c.on_gpu for c in self.clients.values())
        self.max_on_gpu = max(self.max_on_gpu, on_gpu)
        assert on_gpu <= self.capacity, f"GPU over capacity: {on_gpu} > {self.capacity}"
        # What the arbiter counts (holders at their limits) fits too: what it promised.
        counted = self.arb.used_bytes()
        assert counted <= self.capacity, f"counted over capacity: {counted} > {self.capacity}"
        if self.check:
            self.check(self)

    def run(self, until: float) -> None:
        drive(
            self.clock,
            self.heap,
            until,
            lambda: (self.arb.next_deadline() or float("inf"), 0),
            lambda _gpu: self.apply(self.arb.tick()),
        )

    # --- clients --------------------------------------------------------------------
    def add(self, c: Client, start: float = 0.0) -> Client:
        self.clients[c.sid] = c
        self.apply(
            self.arb.attach(
                c.sid,
                AttachRecord(
                    name=f"s{c.sid}",
                    memory_limit=c.limit,
                    weight=c.weight,
                    fills=c.fills,
                    prefetch=c.prefetch,
                    gang=c.job if c.job and c.send_gang else "",
                ),
            )
        )
        if c.kind == "server":
            assert c.fills and c.arrivals is not None, "a model server fills and has arrivals"
            first = next(c.arrivals)
            self.at(start + first[0], lambda: self._arrive(c, first[1]))
        else:
            self.at(start, lambda: self._want(c))
        return c

    # --- servers --------------------------------------------------------------------
    def _arrive(self, c: Client, service: float) -> None:
        if c.sid not in self.clients:
            return
        c.pending.append([self.clock.monotonic(), service, 0.0])
        assert c.arrivals is not None
        nxt = next(c.arrivals, None)
        if nxt is not None:
            self.at(nxt[0], lambda: self._arrive(c, nxt[1]))
        if not c.wants:
            self._want(c)
        elif c.holding and not c.swapping_in and c.serving is None:
            self._serve(c)  # in its idle release: served at once

    def _serve(self, c: Client) -> None:
        if c.sid not in self.clients or not c.holding or c.swapping_in or c.serving:
            return
        now = self.clock.monotonic()
        c.gen += 1
        gen = c.gen
        if c.pending:
            arrival, left, started = c.pending.popleft()
            if not started:
                c.request_waits.append((arrival, now - arrival))
            c.serving = (arrival, now, left)
            self.at(left, lambda: self._served(c, gen))
        else:
            self.at(c.tail_s, lambda: self._tail_end(c, gen))

    def _served(self, c: Client, gen: int) -> None:
        if c.sid not in self.clients or gen != c.gen or c.serving is None:
            return
        arrival = c.serving[0]
        c.latencies.append((arrival, self.clock.monotonic() - arrival))
        c.serving = None
        self._serve(c)

    def _tail_end(self, c: Client, gen: int) -> None:
        if c.sid not in self.clients or gen != c.gen or not c.holding or c.serving:
            return
        self._stop_work(c)
        c.holding = c.wants = False
        self.apply(self.arb.release(c.sid, resident=c.on_gpu, swapped=c.in_host))

    def _server_pause(self, c: Client) -> None:
        """A revoke reached a safe point: the request in progress keeps what is left."""
        c.gen += 1
        if c.serving is not None:
            arrival, started, left = c.serving
            done = self.clock.monotonic() - started
            c.pending.appendleft([arrival, max(0.0, left - done), 1.0])
            c.serving = None

    def _want(self, c: Client) -> None:
        if c.sid not in self.clients:
            return
        c.wants = True
        c.want_since = self.clock.monotonic()
        self.apply(self.arb.acquire(c.sid))

    def _on_grant(self, c: Client, a: GrantAction) -> None:
        now = self.clock.monotonic()
        c.lease = a.lease
        c.grant_times.append(now)
        c.waits.append(now - c.want_since)
        self.grants.append(c.sid)
        c.holding = True
        c.swapping_in = True
        c.frozen = False  # a grant thaws
        c.pf_room = 0  # a prefetch in flight stops at its next chunk
        assert not a.room or c.fills, "a room for a client that cannot fill"
        c.room = a.room
        self.serial(c, lambda done: self._swap_in(c, done))
        if c.kind == "bursty":
            lease = c.lease
            self.at(c.burst_s, lambda: self._burst_end(c, lease))

    def _swap_in(self, c: Client, done: Callable[[], None]) -> None:
        """The grant's swap-in, once the client's earlier swaps are done: all at once for
        an older client, chunk by chunk within its room for one that fills."""
        back = c.in_host
        t0 = self.clock.monotonic()

        def finished() -> None:
            if c.room and c.sid in self.clients:  # as the real client: the burst
                c.parked = finished  # waits until its whole limit has room
                return
            self._swapped_in(c, back, t0, done)

        if not c.fills:  # all at once: the bytes land as the copy starts
            c.on_gpu += back
            c.in_host = 0
            self._observe()
            self.at(back / self.bw, finished)
            return

        def chunk() -> None:
            if c.sid not in self.clients:
                return done()
            if not c.in_host:
                return finished()
            k = min(CHUNK, c.in_host)
            if c.room and c.on_gpu + k > c.room:
                c.parked = chunk  # until a RoomAction
                return
            self._copy_in(c, k, chunk)

        chunk()

    def _swapped_in(self, c: Client, back: int, t0: float, done: Callable[[], None]) -> None:
        """The swap-in of ``back`` bytes begun at ``t0`` is done: the client works, says
        so, grows to its limit while it holds, and goes on as its kind does."""
        c.swapping_in = False
        if c.holding and c.work_since is None:
            c.work_since = self.clock.monotonic()
        done()
        if c.sid not in self.clients:
            return
        self._say_swapped(c, "in", back, t0)
        if c.holding:  # the workload grows to its limit while it holds
            assert not c.room, "grew past its room"
            c.on_gpu = c.limit
            self.apply(self.arb.report(c.sid, resident=c.on_gpu, swapped=c.in_host))
        if c.kind == "ddp":
            self._ddp_go(c)
        elif c.kind == "server":
            self._serve(c)

    def _burst_end(self, c: Client, lease: int) -> None:
        if c.sid not in self.clients or not c.holding or c.lease != lease:
            return
        if c.swapping_in:  # as the real client: the burst begins once the memory is back
            self.at(0.001, lambda: self._burst_end(c, lease))
            return
        self._stop_work(c)
        c.holding = False
        c.wants = False
        self.apply(self.arb.release(c.sid, resident=c.on_gpu, swapped=c.in_host))
        self.at(c.think_s, lambda: self._want(c))

    def _yield(self, c: Client, a: RevokeAction) -> None:
        if c.sid not in self.clients or c.lease != a.lease or not c.holding:
            return
        if c.swapping_in:  # as the real client: no checkpoint before the swap-in is done
            self.at(0.001, lambda: self._yield(c, a))
            return
        moved = min(a.swap_out, c.on_gpu)
        self._stop_work(c)
        c.holding = False
        c.want_since = self.clock.monotonic()
        if c.kind == "server":
            self._server_pause(c)
        again = c.kind == "batch" or (c.kind == "server" and bool(c.pending))
        if not again:
            c.wants = False
        if c.fills:  # release first, then swap out chunk by chunk
            self.apply(
                self.arb.release(
                    c.sid, resident=c.on_gpu, swapped=c.in_host, again=again, swapping_out=moved
                )
            )
            self._swap_out(c, moved)
            if not again and c.kind != "server":  # (a server asks at its next request)
                self.at(c.think_s, lambda: self._want(c))
            return

        # the copy takes moved/bw; the release is sent when it is done
        def done() -> None:
            if c.sid not in self.clients:
                return
            c.on_gpu -= moved
            c.in_host += moved
            self.apply(
                self.arb.release(
                    c.sid,
                    resident=c.on_gpu,
                    swapped=c.in_host,
                    again=again,
                    swapped_out=moved,
                    seconds=moved / self.bw,
                )
            )
            if not again:
                self.at(c.think_s, lambda: self._want(c))

        self.at(moved / self.bw, done)

    # --- ddp ranks ------------------------------------------------------------------
    def _ddp_revoked(self, c: Client, lease: int) -> None:
        if c.sid in self.clients and c.lease == lease:
            c.revoked_lease = lease
            if c.pos == "safe":  # waiting at its safe point (its swap-in): yields there
                self._ddp_go(c)

    def _ddp_go(self, c: Client) -> None:
        """At a safe point: yield to a revoke, or work the next step."""
        if c.sid not in self.clients or not c.holding or c.swapping_in or c.pos != "safe":
            return
        if c.revoked_lease == c.lease:
            c.holding = False
            c.want_since = self.clock.monotonic()
            self.apply(self.arb.release(c.sid, resident=c.on_gpu, swapped=c.in_host, again=True))
            return
        c.pos = "step"
        self.at(c.step_s, lambda: self._ddp_step_done(c))

    def _ddp_step_done(self, c: Client) -> None:
        if c.sid not in self.clients:
            return
        if c.frozen:  # stopped: the step goes on once it is thawed
            self.at(0.01, lambda: self._ddp_step_done(c))
            return
        c.pos = "barrier"
        self._ddp_barrier(c.job)

    def _ddp_barrier(self, job: str) -> None:
        ranks = [x for x in self.clients.values() if x.job == job]
        if ranks and all(x.pos == "barrier" for x in ranks):
            for x in ranks:
                x.steps += 1
                x.pos = "safe"
                self.at(0.0, lambda x=x: self._ddp_go(x))

    def _prefetch(self, c: Client, done: Callable[[], None]) -> None:
        """Swap in (no lease) chunk by chunk within the latest ask's room; then say which
        ask it is done with. A grant meanwhile ends it: the grant's swap-in goes on."""
        t0 = self.clock.monotonic()
        moved = [0]

        def finished() -> None:
            c.pf_running = False
            c.pf_room = 0  # done with every ask so far: the next may be for less
            done()
            if c.sid in self.clients:
                self.apply(
                    self.arb.swap_done(
                        c.sid,
                        direction="in",
                        nbytes=moved[0],
                        seconds=self.clock.monotonic() - t0,
                        resident=c.on_gpu,
                        swapped=c.in_host,
                        prefetch=c.pf_seq,
                    )
                )

        def chunk() -> None:
            if c.sid not in self.clients:
                c.pf_running = False
                return done()
            k = min(CHUNK, c.in_host, c.pf_room - c.on_gpu)
            if c.holding or k <= 0:
                return finished()
            moved[0] += k
            self._copy_in(c, k, chunk)

        chunk()

    def _say_swapped(self, c: Client, direction: Literal["in", "out"], n: int, t0: float) -> None:
        """The client tells the arbiter its swap of ``n`` bytes begun at ``t0`` is done."""
        secs = self.clock.monotonic() - t0
        self.apply(
            self.arb.swap_done(
                c.sid,
                direction=direction,
                nbytes=n,
                seconds=secs,
                resident=c.on_gpu,
                swapped=c.in_host,
            )
        )

    def _copy_in(self, c: Client, k: int, then: Callable[[], None]) -> None:
        """``k`` bytes from host memory to the GPU: on the GPU at once (the copy holds its
        destination), reported to the arbiter when the copy lands, then ``then``."""
        c.on_gpu += k
        c.in_host -= k
        self._observe()

        def landed() -> None:
            if c.sid in self.clients:
                self.apply(self.arb.report(c.sid, resident=c.on_gpu, swapped=c.in_host))
            then()

        self.at(k / self.bw, landed)

    def _swap_out(self, c: Client, n: int) -> None:
        def swap_out(done: Callable[[], None]) -> None:
            moved = min(n, c.on_gpu)
            t0 = self.clock.monotonic()
            left = [moved]

            def finished() -> None:
                done()
                if c.sid in self.clients:
                    self._say_swapped(c, "out", moved, t0)

            def chunk() -> None:
                if c.sid not in self.clients:
                    return done()
                if not left[0]:
                    return finished()
                k = min(CHUNK if c.fills else left[0], left[0])

                def freed() -> None:  # bytes leave the GPU when their copy is done
                    if c.sid not in self.clients:
                        return done()
                    left[0] -= k
                    c.on_gpu -= k
                    c.in_host += k
                    if c.fills and left[0]:
                        self.apply(self.arb.report(c.sid, resident=c.on_gpu, swapped=c.in_host))
                    chunk()

                self.at(k / self.bw, freed)

            chunk()

        self.serial(c, swap_out)

    def serial(self, c: Client, task: Task) -> None:
        """Run ``task`` once the client's earlier swaps are done."""
        c.tasks.append(task)
        if not c.busy:
            self._next_task(c)

    def _next_task(self, c: Client) -> None:
        if not c.tasks:
            c.busy = False
            return
        c.busy = True
        task = c.tasks.popleft()
        task(lambda: self._next_task(c))

    def kill(self, sid: int) -> None:
        c = self.clients.pop(sid)
        c.on_gpu = 0
        self.apply(self.arb.detach(sid, reason="killed"))
        if c.job:  # its peers' collective no longer waits for it
            self._ddp_barrier(c.job)

    def _stop_work(self, c: Client) -> None:
        if c.work_since is not None:
            c.work.append((c.work_since, self.clock.monotonic()))
            c.work_since = None

    def work(self, sid: int, t0: float, t1: float) -> float:
        """Seconds of GPU time session ``sid`` had between ``t0`` and ``t1`` (holding,
        its memory back)."""
        c = self.clients[sid]
        spans = [*c.work, *([(c.work_since, t1)] if c.work_since is not None else [])]
        return sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in spans)

    def lease_seconds(self) -> dict[int, float]:
        return {sid: self.arb.lease_seconds(s) for sid, s in self.arb.sessions.items()}

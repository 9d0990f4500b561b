"""Gangs with ranks on several GPUs of a node (core/coordinator.py): granted on all their
GPUs at once, revoked together, never holding one GPU while waiting for another."""

from __future__ import annotations

import heapq
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpushare.core.actions import EscalateAction, GrantAction, RevokeAction
from gpushare.core.arbiter import Arbiter
from gpushare.core.attach import AttachRecord
from gpushare.core.clock import ManualClock
from gpushare.core.coordinator import Coordinator
from gpushare.settings import GpuSettings
from tests.core.model import GiB, drive
from tests.profiles import examples


class Node:
    """Two exclusive GPUs and their coordinator, ticked as the node's decisions are
    (node/decide/decisions.py): after a GPU's decisions, the GPUs that share a gang with it,
    until none decides anything more."""

    def __init__(self, clock: ManualClock, coordinate: bool = True) -> None:
        self.clock = clock
        self.arbs = [
            Arbiter(i, 80 * GiB, clock, GpuSettings(mode="exclusive", tq_s=1, grace_s=2))
            for i in (0, 1)
        ]
        self.coord = Coordinator(self.arbs) if coordinate else None
        self.granted: list[int] = []
        self.revoked: list[int] = []

    def do(self, gpu: int, call: str, *args, **kw) -> None:
        if call == "attach":
            args, kw = (*args, AttachRecord(**kw)), {}
        todo, ticks = [(gpu, getattr(self.arbs[gpu], call)(*args, **kw))], 0
        while todo:
            g, out = todo.pop(0)
            ticks += 1
            assert ticks < 1000, "the linked GPUs never settle"
            self.granted += [a.session for a in out if isinstance(a, GrantAction)]
            self.revoked += [a.session for a in out if isinstance(a, RevokeAction)]
            self.check()
            if self.coord and (out or g == gpu):
                todo += [(o.gpu, o.tick()) for o in self.coord.linked(g)]

    def check(self) -> None:
        for a in self.arbs:  # one job at most holds each GPU
            assert len({a.sessions[h].rank.gang or h for h in a.holders}) <= 1, a.holders

    def holders(self) -> list[list[int]]:
        return [sorted(a.holders) for a in self.arbs]


def two_jobs(n: Node) -> None:
    """Jobs A (sessions 1 on GPU 0, 2 on GPU 1) and B (3 on GPU 0, 4 on GPU 1)."""
    for sid, gpu, job in ((1, 0, "A"), (2, 1, "A"), (3, 0, "B"), (4, 1, "B")):
        n.do(gpu, "attach", sid, name=f"s{sid}", memory_limit=10 * GiB, gang=job, gang_size=2)


def test_a_gang_on_two_gpus_holds_both_or_neither():
    n = Node(ManualClock())
    two_jobs(n)
    n.do(0, "acquire", 1)  # A starts: GPU 1 is kept for it, though rank 2 has not asked
    n.do(1, "acquire", 4)  # B's rank on GPU 1 waits: GPU 1 is A's
    n.do(0, "acquire", 3)
    assert n.holders() == [[1], []]
    n.do(1, "acquire", 2)  # A's second rank joins it
    assert n.holders() == [[1], [2]]
    n.clock.advance(1)
    n.do(0, "tick")  # the quantum ends: both of A's ranks are revoked
    assert sorted(n.revoked) == [1, 2]
    n.do(0, "release", 1, resident=10 * GiB, swapped=0, again=True)
    assert n.holders() == [[], [2]]  # A still holds GPU 1: B waits for both
    n.do(1, "release", 2, resident=10 * GiB, swapped=0, again=True)
    assert n.holders() == [[3], [4]]  # B starts on both at once


def test_without_the_coordinator_two_gangs_each_hold_what_the_other_waits_for():
    """Issue 14's multi-GPU deadlock, as the per-GPU arbiters alone would decide it."""
    n = Node(ManualClock(), coordinate=False)
    two_jobs(n)
    n.do(0, "acquire", 1)
    n.do(1, "acquire", 4)
    assert n.holders() == [[1], [4]]  # A's rank 1 waits for GPU 1, B's rank 3 for GPU 0


def test_gangs_on_several_gpus_start_in_the_order_they_asked():
    n = Node(ManualClock())
    two_jobs(n)
    n.do(1, "attach", 5, name="solo", memory_limit=10 * GiB)
    n.do(1, "acquire", 5)  # a solo session holds GPU 1
    n.do(1, "acquire", 4)  # B asks first (on GPU 1), then A (on GPU 0)
    n.do(0, "acquire", 1)
    assert n.holders() == [[], [5]]  # GPU 0 is kept for B, the next, though idle
    n.clock.advance(1)
    n.do(1, "tick")  # the solo session's quantum ends: B waits
    assert 5 in n.revoked
    n.do(1, "release", 5, resident=0, swapped=0)
    assert n.holders() == [[], [4]]  # B holds both of its GPUs (its rank on 0 is idle)
    n.do(0, "acquire", 3)
    assert n.holders() == [[3], [4]]
    n.clock.advance(1)
    n.do(0, "tick")
    n.do(0, "release", 3, resident=0, swapped=0, again=True)
    n.do(1, "release", 4, resident=0, swapped=0, again=True)
    assert n.holders() == [[1], []]  # then A


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_a_parked_rank_on_one_gpu_regroups_while_one_holds_on_another(order):
    n = Node(ManualClock())
    two_jobs(n)
    n.do(0, "acquire", 1)
    n.do(1, "acquire", 2)
    n.do(0, "acquire", 3)
    n.clock.advance(1)
    n.do(0, "tick")
    first, _ = order
    n.do(first, "release", 1 if first == 0 else 2, resident=0, swapped=0, again=True)
    n.granted.clear()
    n.clock.set(n.arbs[first].next_deadline())
    n.do(first, "tick")  # its peer is still holding on the other GPU: it goes on
    assert n.granted == [1 if first == 0 else 2]


class Rank:
    """A client: a DDP rank (``job``: steps of ``step`` seconds, each ending in a
    collective of all the job's ranks, on whatever GPU; a safe point after each) or a
    solo batch session (``job`` ""), answering revokes ``latency`` seconds after."""

    def __init__(self, sid: int, gpu: int, job: str, step: float, latency: float) -> None:
        self.sid, self.gpu, self.job, self.step, self.latency = sid, gpu, job, step, latency
        self.holding, self.lease, self.revoked_lease = False, 0, 0
        self.pos, self.steps, self.grants = "safe", 0, 0


class MultiModel:
    """Ranks of jobs on several GPUs driving real arbiters and their coordinator, ticked
    as the node's decisions are, on one ManualClock."""

    def __init__(self, gpus: int, settings: GpuSettings) -> None:
        self.clock = ManualClock()
        self.arbs = [
            Arbiter(i, 80 * GiB, self.clock, GpuSettings(**vars(settings))) for i in range(gpus)
        ]
        self.coord = Coordinator(self.arbs)
        self.ranks: dict[int, Rank] = {}
        self.heap: list[tuple[float, int, Callable[[], None]]] = []
        self.seq = 0
        self.escalations = 0

    def at(self, delay: float, fn) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (self.clock.monotonic() + delay, self.seq, fn))

    def apply(self, gpu: int, actions) -> None:
        todo, ticks = [(gpu, actions)], 0
        while todo:
            g, out = todo.pop(0)
            ticks += 1
            assert ticks < 1000, "the linked GPUs never settle"
            self.deliver(out)
            if out or g == gpu:  # what it decided may let its linked GPUs decide
                todo += [(o.gpu, o.tick()) for o in self.coord.linked(g)]

    def deliver(self, actions) -> None:
        for a in actions:
            if isinstance(a, GrantAction):
                r = self.ranks[a.session]
                r.holding, r.lease, r.grants = True, a.lease, r.grants + 1
                self.at(0.0, lambda r=r: self.go(r))
            elif isinstance(a, RevokeAction):
                r = self.ranks[a.session]
                self.at(r.latency, lambda r=r, lease=a.lease: self.seen(r, lease))
            elif isinstance(a, EscalateAction):
                self.escalations += 1
        self.check()

    def check(self) -> None:
        for a in self.arbs:
            assert len({a.sessions[h].rank.gang or h for h in a.holders}) <= 1, (a.gpu, a.holders)
        for r in self.ranks.values():  # a job holding one of its GPUs holds them all
            if r.job and r.holding:
                gpus = {x.gpu for x in self.ranks.values() if x.job == r.job}
                for a in self.arbs:
                    if a.gpu in gpus:
                        assert {a.sessions[h].rank.gang for h in a.holders} <= {r.job}, (
                            r.job,
                            a.gpu,
                        )

    def add(self, r: Rank) -> None:
        self.ranks[r.sid] = r
        a = self.arbs[r.gpu]
        self.apply(
            r.gpu, a.attach(r.sid, AttachRecord(name=f"s{r.sid}", memory_limit=GiB, gang=r.job))
        )
        self.at(0.001 * r.sid, lambda: self.apply(r.gpu, a.acquire(r.sid)))

    def seen(self, r: Rank, lease: int) -> None:
        if r.lease == lease and r.holding:
            r.revoked_lease = lease
            if r.pos == "safe" or not r.job:
                self.go(r)

    def go(self, r: Rank) -> None:
        """At a safe point: yield to a revoke seen, or work."""
        if not r.holding or r.pos != "safe":
            return
        if r.revoked_lease == r.lease:
            r.holding = False
            a = self.arbs[r.gpu]
            self.apply(r.gpu, a.release(r.sid, resident=0, swapped=0, again=True))
        elif r.job:
            r.pos = "step"
            self.at(r.step, lambda: self.arrive(r))

    def arrive(self, r: Rank) -> None:
        r.pos = "barrier"
        job = [x for x in self.ranks.values() if x.job == r.job]
        if all(x.pos == "barrier" for x in job):
            for x in job:
                x.pos, x.steps = "safe", x.steps + 1
                self.at(0.0, lambda x=x: self.go(x))

    def run(self, until: float) -> None:
        drive(
            self.clock,
            self.heap,
            until,
            lambda: min((a.next_deadline() or float("inf"), a.gpu) for a in self.arbs),
            lambda gpu: self.apply(gpu, self.arbs[gpu].tick()),
        )


@settings(
    max_examples=examples(60, dev=4), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    gpus=st.integers(2, 3),
    jobs=st.lists(
        st.tuples(
            st.sets(st.integers(0, 2), min_size=1, max_size=3),  # its GPUs (a rank each)
            st.floats(0.005, 0.1),  # step
        ),
        min_size=1,
        max_size=4,
    ),
    solo=st.lists(st.integers(0, 2), max_size=3),  # a solo batch session on that GPU
    tq=st.floats(0.2, 2.0),
    latency=st.floats(0.0, 0.05),
)
def test_gangs_on_several_gpus_never_deadlock(gpus, jobs, solo, tq, latency):
    """Never two jobs on a GPU, a job holding one of its GPUs holds them all, and every
    job goes on: its ranks complete collectives, solo sessions are granted, with no
    escalation."""
    m = MultiModel(gpus, GpuSettings(mode="exclusive", tq_s=tq, grace_s=2.0))
    sid = 1
    for j, (where, step) in enumerate(jobs):
        for k, gpu in enumerate(sorted({g % gpus for g in where})):
            m.add(Rank(sid, gpu, f"job{j}", step, latency * k))
            sid += 1
    for gpu in solo:
        m.add(Rank(sid, gpu % gpus, "", 0.0, latency))
        sid += 1
    m.run(30)
    before = {r.sid: (r.steps, r.grants) for r in m.ranks.values()}
    m.run(30)
    for r in m.ranks.values():
        if r.job:
            assert r.steps > before[r.sid][0], (r.sid, r.job, r.steps)
        else:  # granted again, or holding on (no one else wants its GPU)
            assert r.grants > before[r.sid][1] or r.holding, (r.sid, r.grants)
    assert m.escalations == 0

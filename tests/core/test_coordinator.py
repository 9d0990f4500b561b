"""Gangs with ranks on several GPUs of a node (core/coordinator.py): granted on all their
GPUs at once, revoked together, never holding one GPU while waiting for another."""

from __future__ import annotations

import pytest

from gpushare.core.actions import GrantAction, RevokeAction
from gpushare.core.arbiter import Arbiter
from gpushare.core.clock import ManualClock
from gpushare.core.coordinator import Coordinator
from gpushare.settings import GpuSettings
from tests.core.model import GiB


class Node:
    """Two exclusive GPUs and their coordinator, ticked as the node's dispatch does:
    after a GPU's decisions, the GPUs that share a gang with it."""

    def __init__(self, clock: ManualClock, coordinate: bool = True) -> None:
        self.clock = clock
        self.arbs = [
            Arbiter(i, 80 * GiB, clock, GpuSettings(mode="exclusive", tq_s=1, grace_s=2))
            for i in (0, 1)
        ]
        self.coord = Coordinator(self.arbs) if coordinate else None
        self.granted: list[int] = []
        self.revoked: list[int] = []

    def do(self, gpu: int, call: str, *args, depth: int = 0, **kw) -> None:
        arb = self.arbs[gpu]
        out = getattr(arb, call)(*args, **kw)
        self.granted += [a.session for a in out if isinstance(a, GrantAction)]
        self.revoked += [a.session for a in out if isinstance(a, RevokeAction)]
        if self.coord and depth < 4:
            for other in self.coord.linked(gpu):
                self.do(other.gpu, "tick", depth=depth + 1)
        self.check()

    def check(self) -> None:
        for a in self.arbs:  # one job at most holds each GPU
            assert len({a.sessions[h].gang or h for h in a.holders}) <= 1, a.holders

    def holders(self) -> list[list[int]]:
        return [sorted(a.holders) for a in self.arbs]


def two_jobs(n: Node) -> None:
    """Jobs A (sessions 1 on GPU 0, 2 on GPU 1) and B (3 on GPU 0, 4 on GPU 1)."""
    for sid, gpu, job in ((1, 0, "A"), (2, 1, "A"), (3, 0, "B"), (4, 1, "B")):
        n.do(gpu, "attach", sid, name=f"s{sid}", limit=10 * GiB, gang=job, gang_size=2)


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
    n.do(1, "attach", 5, name="solo", limit=10 * GiB)
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

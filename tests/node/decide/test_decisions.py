"""The node's decisions (node/decide/decisions.py): an input's actions delivered, then the GPUs
linked through a gang ticked until none decides anything more (no depth cut), and a
loop that never settles stopped at a bound, loudly."""

from __future__ import annotations

import asyncio
import logging

from gpushare.core.actions import Action, EventAction, GrantAction
from gpushare.core.arbiter import Arbiter
from gpushare.core.attach import AttachRecord
from gpushare.core.clock import ManualClock
from gpushare.core.coordinator import Coordinator
from gpushare.node.decide.decisions import Decisions
from gpushare.settings import GpuSettings

GiB = 2**30


class Sink:
    """Dispatch as far as decisions sees it: what was delivered, per GPU, in order."""

    def __init__(self) -> None:
        self.delivered: list[tuple[int, Action]] = []

    def deliver(self, arb: Arbiter, actions: list[Action]) -> None:
        self.delivered += [(arb.gpu, a) for a in actions]


class Chatty:
    """A GPU whose next ``left`` ticks each decide something (an event), then nothing."""

    def __init__(self, gpu: int, left: int) -> None:
        self.gpu, self.left, self.ticks = gpu, left, 0

    def tick(self) -> list[Action]:
        self.ticks += 1
        if self.left == 0:
            return []
        self.left -= 1
        return [EventAction({"gpu": self.gpu, "event": "x"})]

    def next_deadline(self) -> float | None:
        return None


def test_linked_gpus_are_ticked_until_none_decides_anything_more():
    # Each GPU decides something at each of its next 20 ticks: the old recursion (cut at
    # depth 4) left most of that undecided until a timer; now it goes on to the end.
    gpus = [Chatty(i, 20) for i in range(3)]
    sink = Sink()
    d = Decisions(sink, ManualClock(), linked=lambda g: [x for x in gpus if x.gpu != g])
    d.act(gpus[0], [EventAction({"gpu": 0, "event": "first"})])
    assert [x.left for x in gpus] == [0, 0, 0]
    assert len(sink.delivered) == 1 + 60  # the old one: at most 2 + 4 + 8 + 16 ticks
    assert all(x.tick() == [] for x in gpus)  # nothing more follows
    assert d.limit_hit == 0


def test_a_loop_that_never_settles_stops_at_the_bound_and_says_so(caplog):
    gpus = [Chatty(i, 10**9) for i in range(2)]
    d = Decisions(Sink(), ManualClock(), linked=lambda g: [gpus[1 - g]], follow_limit=50)
    with caplog.at_level(logging.ERROR, logger="gpushare.node.decide.decisions"):
        d.act(gpus[0], [])
    assert d.limit_hit == 1
    assert gpus[0].ticks + gpus[1].ticks == 50
    (rec,) = caplog.records
    assert "still decided something after 50 ticks" in rec.getMessage()
    assert "bug" in rec.getMessage()


def test_a_gang_on_three_gpus_starts_on_all_of_them_from_one_release():
    asyncio.run(gang_on_three_gpus())  # the GPUs' timers are set on a running loop


async def gang_on_three_gpus() -> None:
    # Jobs A and B, a rank of each on GPUs 0, 1 and 2 (exclusive): A holds all three;
    # when A's last rank releases (on GPU 2), B starts on every GPU from that one input:
    # its grants on GPUs 0 and 1 come from the linked GPUs ticked after GPU 2's.
    clock = ManualClock()
    settings = GpuSettings(mode="exclusive", tq_s=1, grace_s=2)
    arbs = [Arbiter(i, 80 * GiB, clock, GpuSettings(**vars(settings))) for i in range(3)]
    coord = Coordinator(arbs)
    sink = Sink()
    d = Decisions(sink, clock, linked=coord.linked)
    a_ranks, b_ranks = {0: 1, 1: 2, 2: 3}, {0: 4, 1: 5, 2: 6}
    for job, ranks in (("A", a_ranks), ("B", b_ranks)):
        for gpu, sid in ranks.items():
            d.act(
                arbs[gpu],
                arbs[gpu].attach(
                    sid, AttachRecord(name=f"s{sid}", memory_limit=GiB, gang=job, gang_size=3)
                ),
            )
    for gpu, sid in a_ranks.items():
        d.act(arbs[gpu], arbs[gpu].acquire(sid))
    for gpu, sid in b_ranks.items():
        d.act(arbs[gpu], arbs[gpu].acquire(sid))
    assert [sorted(a.holders) for a in arbs] == [[1], [2], [3]]
    clock.advance(1)
    for a in arbs:
        d.act(a, a.tick())  # A's quantum ends: revoked on all three
    for gpu in (0, 1):
        d.act(arbs[gpu], arbs[gpu].release(a_ranks[gpu], resident=0, swapped=0, again=True))
    assert [sorted(a.holders) for a in arbs] == [[], [], [3]]  # A still holds GPU 2
    sink.delivered.clear()
    d.act(arbs[2], arbs[2].release(3, resident=0, swapped=0, again=True))
    granted = sorted((gpu, a.session) for gpu, a in sink.delivered if isinstance(a, GrantAction))
    assert granted == [(0, 4), (1, 5), (2, 6)]
    assert [sorted(a.holders) for a in arbs] == [[4], [5], [6]]
    assert all(a.tick() == [] for a in arbs)  # nothing was left to follow
    d.close()

"""Growth above a request takes only free memory or waits for the rotation of quanta,
never a neighbour's memory inside its quantum (issue 38 item 2, docs/scheduling.md 6)."""

from __future__ import annotations

from gpushare.core.actions import SwapOutAction
from gpushare.core.arbiter import Arbiter
from gpushare.core.attach import AttachRecord
from gpushare.settings import GpuSettings
from tests.core.model import GiB, actions_of


def test_a_grower_does_not_take_a_neighbours_memory_inside_its_quantum(clock):
    a = Arbiter(0, 80 * GiB, clock, GpuSettings(mode="auto", tq_s=3.0))
    a.attach(1, AttachRecord(name="h", memory_limit=40 * GiB, memory_request=40 * GiB, grows=True))
    a.attach(2, AttachRecord(name="g", memory_limit=79 * GiB, memory_request=1 * GiB, grows=True))
    a.acquire(1)
    a.report(1, resident=38 * GiB, swapped=0)
    a.acquire(2)
    a.report(2, resident=1 * GiB, swapped=0)
    assert list(a.holders) == [1, 2]
    out = []
    for _ in range(10):  # H's 0.2 s bursts, G asking to grow at each boundary
        clock.advance(0.2)
        out += a.release(1, resident=38 * GiB, swapped=0)
        if 2 in a.holders:
            out += a.release(2, resident=1 * GiB, swapped=0, again=True, need=78 * GiB)
        clock.advance(0.1)  # past H's anticipation window
        out += a.tick()
        out += a.acquire(1)
        a.verify()
        # H (at its request) is never asked for its bytes inside its quantum (3 s), and
        # its next burst starts beside the waiting grower
        assert not [x for x in actions_of(out, SwapOutAction) if x.session == 1]
        assert 1 in a.holders and list(a.queue) == [2]
    # The rotation of quanta: G has waited one (3 s); at H's next burst end H's bytes go.
    clock.advance(0.5)
    out = a.release(1, resident=38 * GiB, swapped=0)
    clock.advance(0.1)
    out += a.tick()
    assert [x.bytes for x in actions_of(out, SwapOutAction) if x.session == 1] == [36 * GiB]
    a.swap_done(
        1, direction="out", nbytes=36 * GiB, seconds=1.0, resident=2 * GiB, swapped=36 * GiB
    )
    assert 2 in a.holders and a.sessions[2].memory.held == 78 * GiB
    a.verify()

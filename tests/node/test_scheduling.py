"""The scheduling rules (docs/scheduling.md) through a whole node, in process on virtual
time: raw workload connections say what the client runtime says, and the node answers
with the protocol's messages."""

from __future__ import annotations

import asyncio

import pytest

from gpushare import protocol as p
from gpushare.core.window import ANTICIPATE_FLOOR_S
from tests.node.harness import G, InProcessNode, Workload, in_process


async def holding(node: InProcessNode, **hello) -> Workload:
    w = await node.workload(**hello)
    await w.send(p.Acquire())
    await w.expect(p.Grant)
    return w


@in_process(mode="exclusive", tq=5)
async def test_a_burst_end_with_the_next_burst_at_once_keeps_the_quantum(node):
    a = await holding(node, memory_limit=G, name="short")
    b = await node.workload(memory_limit=G, name="waits")
    await b.send(p.Acquire())
    left = 5.0
    for _ in range(10):  # bursts of 0.1 s, a millisecond apart
        await asyncio.sleep(0.1)  # virtual time: a burst's GPU work
        await a.send(p.Release(resident=G, swapped=0))
        await asyncio.sleep(0.001)  # virtual: the gap before the next burst
        await a.send(p.Acquire())
        g = await a.expect(p.Grant)
        assert g.quantum_s == pytest.approx(left - 0.101)  # the rest of the same quantum
        left = g.quantum_s
    assert node.node.status().gpus[0].queue == [b.session]
    grants = node.events("grant")
    assert [e["session"] for e in grants] == [a.session] * 11
    assert all(e.get("continued") for e in grants[1:])
    # the quantum still ends on time, and b gets the GPU
    await a.expect(p.Revoke)
    await a.send(p.Release(resident=G, swapped=0, again=True))
    await b.expect(p.Grant)


@in_process(mode="exclusive", tq=5)
async def test_a_session_that_does_not_ask_again_hands_over_after_its_window(node):
    a = await holding(node, memory_limit=G)
    b = await node.workload(memory_limit=G)
    await b.send(p.Acquire())
    t0 = node.clock.monotonic()
    await a.send(p.Release(resident=G, swapped=0))
    await b.expect(p.Grant)
    assert node.clock.monotonic() - t0 == pytest.approx(ANTICIPATE_FLOOR_S)
    (rel,) = node.events("release")
    assert rel["anticipate_s"] == ANTICIPATE_FLOOR_S


@in_process(mode="exclusive", tq=5, memory="40GiB")
async def test_the_next_holder_is_told_to_prefetch_and_switches_without_a_swap(node):
    a = await holding(node, memory_limit=20 * G, name="holder")
    await a.send(p.Report(resident=20 * G, swapped=0))
    b = await node.workload(
        memory_limit=20 * G, name="next", resident=0, swapped=20 * G, prefetch=True
    )
    await b.send(p.Acquire())
    pf = await b.expect(p.Prefetch)
    assert (pf.room, pf.seq) == (20 * G, 1)
    (ev,) = node.events("prefetch")
    assert (ev["session"], ev["room_bytes"], ev["bytes"]) == (b.session, 20 * G, 20 * G)
    await b.send(
        p.SwapDone(
            direction="in", bytes=20 * G, seconds=0.4, resident=20 * G, swapped=0, prefetch=1
        )
    )
    r = await a.expect(p.Revoke)
    assert r.swap_out == 0  # both fit: the switch is a handoff
    await a.send(p.Release(resident=20 * G, swapped=0, again=True))
    g = await b.expect(p.Grant)
    assert (g.swap_in, g.room) == (0, 0)
    s = {x.id: x for x in node.node.status().gpus[0].sessions}[b.session]
    assert (s.resident_bytes, s.swap_in_bytes_total) == (20 * G, 20 * G)


@in_process(mode="exclusive", tq=5, memory="40GiB")
async def test_a_prefetch_ack_never_asked_is_answered_and_changes_nothing(node):
    w = await node.workload(memory_limit=G, prefetch=True)
    await w.send(
        p.SwapDone(direction="in", bytes=G, seconds=0.1, resident=G, swapped=0, prefetch=4)
    )
    err = await w.expect(p.Error)
    assert err.code == "state" and "no prefetch 4" in err.message
    (s,) = node.node.status().gpus[0].sessions
    assert (s.resident_bytes, s.swap_in_bytes_total) == (0, 0)


@in_process(mode="exclusive", tq=30, turn=1.0)
async def test_a_notebook_cell_takes_a_turn_at_the_holders_next_safe_point(node):
    cells = await holding(node, memory_limit=G, name="notebook")  # its first cell, alone
    await cells.send(p.Release(resident=G, swapped=0))
    batch = await node.workload(memory_limit=G, name="batch")
    await batch.send(p.Acquire())
    await batch.expect(p.Grant)  # once the notebook's window is over
    t0 = node.clock.monotonic()
    await asyncio.sleep(3.0)  # virtual time: the batch job's 3 s before the next cell
    await cells.send(p.Acquire())
    r = await batch.expect(p.Revoke)  # at once: the cell goes first
    assert node.clock.monotonic() == pytest.approx(t0 + 3.0)
    assert node.events("revoke")[-1]["reason"] == "turn"
    await batch.send(p.Release(resident=G, swapped=0, again=True, swapping_out=r.swap_out))
    g = await cells.expect(p.Grant)
    assert g.quantum_s == pytest.approx(1.0)
    assert node.events("grant")[-1]["turn"] is True
    await asyncio.sleep(0.2)  # virtual time: the cell's work
    await cells.send(p.Release(resident=G, swapped=0))
    g = await batch.expect(p.Grant)  # the batch job goes on with the rest of its quantum
    assert node.events("grant")[-1]["resumed"] is True
    assert g.quantum_s == pytest.approx(30 - 3.0, abs=0.01)

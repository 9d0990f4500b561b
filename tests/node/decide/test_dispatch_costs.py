"""What dispatch costs per message, in process on virtual time: the GPU's timer is set
again only when the next deadline moves earlier (a timer that fires before anything is
due does not tick the arbiter), a round's frames leave in one write per connection,
and a peer that stops reading is refused and closed without holding up anyone else."""

from __future__ import annotations

import asyncio
import socket

import pytest

from gpushare import protocol as p
from gpushare.core.actions import RevokeAction, SwapOutAction
from tests.node.harness import G, in_process


@in_process(mode="exclusive", tq=5)
async def test_grants_within_the_set_timer_set_no_timer_and_an_early_one_does_not_tick(
    node, monkeypatch
):
    arb = node.node.arbiters[0]
    ticks: list[float] = []
    real_tick = arb.tick
    monkeypatch.setattr(arb, "tick", lambda: (ticks.append(node.clock.monotonic()), real_tick())[1])
    a = await node.workload(memory_limit=G, name="a")
    t0 = node.clock.monotonic()
    await a.send(p.Acquire())
    await a.expect(p.Grant)
    assert node.node.decisions.timers_set == 1  # for t0 + 5
    for _ in range(40):  # short bursts back to back: the rest of the same quantum each time
        await asyncio.sleep(0.05)  # virtual time: a burst's work
        await a.send(p.Release(resident=0, swapped=0), p.Acquire())
        await a.expect(p.Grant)
    # nobody waits: the windows at the bursts' ends set no timer either
    assert node.node.decisions.timers_set == 1  # not one per message
    await a.send(p.Release(resident=0, swapped=0))
    await asyncio.sleep(1.0)  # past its window: the next burst is a new quantum
    await a.send(p.Acquire())
    await a.expect(p.Grant)
    last_grant = node.clock.monotonic()
    assert last_grant - t0 == pytest.approx(3.0)
    assert node.node.decisions.timers_set == 1
    # At t0 + 5 the timer fires early for the new quantum: nothing is due, no tick
    await node.until(lambda: node.clock.monotonic() > t0 + 5)
    assert node.node.decisions.timers_set == 2  # set again, for the new quantum's end
    assert ticks == []
    b = await node.workload(memory_limit=G, name="b")
    await b.send(p.Acquire())
    await a.expect(p.Revoke)  # a was told nothing between
    assert node.clock.monotonic() == pytest.approx(last_grant + 5)
    assert ticks == [pytest.approx(last_grant + 5)]  # the arbiter ticked when it was due
    kinds = [e["event"] for e in node.events()]
    assert kinds == ["attach", "grant", *["release", "grant"] * 41, "attach", "revoke"]
    grants = [e for e in node.events() if e["event"] == "grant"]
    assert [bool(e.get("continued")) for e in grants] == [False, *[True] * 40, False]


@in_process(mode="exclusive", tq=60)
async def test_a_deadline_earlier_than_the_set_timer_sets_it_again(node):
    a = await node.workload(memory_limit=G, name="a")
    t0 = node.clock.monotonic()
    await a.send(p.Acquire())
    await a.expect(p.Grant)  # its timer: t0 + 60
    await node.ask(p.SetConfig(tq_s=2))
    await a.send(p.Release(resident=0, swapped=0), p.Acquire())
    await a.expect(p.Grant)  # a 2 s quantum, ending before the timer set
    b = await node.workload(memory_limit=G, name="b")
    await b.send(p.Acquire())
    await a.expect(p.Revoke)
    assert node.clock.monotonic() == pytest.approx(t0 + 2)  # not t0 + 60


@in_process()
async def test_a_rounds_frames_for_one_connection_leave_in_one_write(node, monkeypatch):
    # Several frames for one session in one round are rare (auto mode: the revokes of
    # holders whose quanta end together may each ask the same idle session for room),
    # so the round is given here as the arbiter would return it.
    a = await node.workload(memory_limit=G, name="a")
    b = await node.workload(memory_limit=G, name="b")
    writes: list[bytes] = []
    conn = node.node.conns[b.session]
    real = conn.write
    monkeypatch.setattr(conn, "write", lambda data: (writes.append(data), real(data)))
    round_ = [
        RevokeAction(a.session, 1, 0, 5.0),
        SwapOutAction(b.session, G),
        RevokeAction(a.session, 2, 0, 5.0),
        SwapOutAction(b.session, 2 * G),
    ]
    node.node.dispatch.deliver(node.node.arbiters[0], round_)
    assert len(writes) == 1
    assert [(await b.recv()).bytes, (await b.recv()).bytes] == [G, 2 * G]  # in order
    assert [(await a.recv()).lease, (await a.recv()).lease] == [1, 2]


@in_process(mode="exclusive", tq=5)
async def test_a_peer_that_stops_reading_is_refused_and_the_others_go_on(node):
    slow = await node.workload(memory_limit=G, name="slow")
    other = await node.workload(memory_limit=G, name="other")
    slow.writer.transport.pause_reading()  # (its asyncio reader would buffer for it)
    conn = node.node.conns[slow.session]
    # a small kernel buffer on the node's side, so the node's own buffer fills soon
    conn.writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    node.node.dispatch.write_limit = 4096
    for _ in range(400):  # each pair is answered with a Grant the peer never reads
        try:
            await slow.send(p.Acquire(), p.Release(resident=0, swapped=0))
        except ConnectionError:
            break  # the node closed it
        await node.settle()
    await node.until(lambda: slow.session not in node.node.conns)  # detached
    (r,) = node.events("refused")
    assert (r["code"], r["session"]) == ("slow", slow.session)
    assert "unread" in r["reason"] and "4096" in r["reason"]
    assert node.events("detach")[-1]["session"] == slow.session
    assert conn.unread_bytes() <= 4096 + 1024  # held no more than the limit and a round
    await other.send(p.Acquire())
    await other.expect(p.Grant)


@in_process(memory="10GiB", mode="exclusive", tq=5)
async def test_a_failed_swap_out_is_asked_again_when_its_retry_time_comes(node):
    """Regression: the timer set for a failed swap's retry found, when it fired, that
    the retry time had passed (next_deadline no longer named it) and did not tick: both
    sessions waited for ever, the GPU held by no one."""
    a = await node.workload(memory_limit=6 * G, name="a")
    await a.send(p.Acquire())
    await a.expect(p.Grant)
    await a.send(p.Report(resident=6 * G, swapped=0), p.Release(resident=6 * G, swapped=0))
    b = await node.workload(memory_limit=6 * G, name="b")
    await b.send(p.Acquire())
    ask = await a.expect(p.SwapOut)  # room for b, once a's quantum stops waiting for a
    await a.send(
        p.SwapDone(direction="out", bytes=0, seconds=0.0, resident=6 * G, swapped=0, error="x")
    )
    failed = node.clock.monotonic()
    again = await a.expect(p.SwapOut, timeout=10)
    assert again.bytes == ask.bytes
    assert node.clock.monotonic() == pytest.approx(failed + 1.0, abs=0.01)  # SWAP_RETRY_S
    await a.send(
        p.SwapDone(direction="out", bytes=2 * G, seconds=0.0, resident=4 * G, swapped=2 * G)
    )
    await b.expect(p.Grant)

"""Bursts and floods of one user against another's (issue 24), in process on virtual time.

Users are modelled through the kernel's word the node reads (SO_PEERCRED): a test
connection bound to the abstract name ``\\0uid-N-...`` is taken for one of uid N, so
one test process plays several users. Everything else is the real node."""

from __future__ import annotations

import asyncio
import itertools
import socket
from typing import Any

import pytest

from gpushare import protocol as p
from gpushare.node import guard
from gpushare.node.guard import LINE_FACTOR
from gpushare.node.host.identity import Peer as Cred
from gpushare.node.host.identity import peer_credentials
from tests.node.harness import G, InProcessNode, Peer, Workload, in_process

_names = itertools.count()


@pytest.fixture(autouse=True)
def uids(monkeypatch: pytest.MonkeyPatch) -> None:
    def credentials(sock: socket.socket) -> Cred:
        real = peer_credentials(sock)
        name = sock.getpeername()
        if isinstance(name, bytes) and name.startswith(b"\0uid-"):
            return Cred(real.pid, int(name.split(b"-")[1]), real.gid)
        return real

    monkeypatch.setattr(guard, "peer_credentials", credentials)


async def connect_as(node: InProcessNode, uid: int) -> Peer:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(f"\0uid-{uid}-{next(_names)}")
    s.connect(node.socket)
    s.setblocking(False)
    return Peer(*await asyncio.open_unix_connection(sock=s))


async def attach_as(node: InProcessNode, uid: int, name: str = "") -> Workload:
    peer = await connect_as(node, uid)
    w = Workload(peer.reader, peer.writer)
    await w.send(p.Hello(version=p.PROTOCOL_VERSION, memory_limit=G, name=name))
    w.welcome = await w.expect(p.Welcome)
    return w


@in_process(max_pending_per_uid=4, hello_timeout=30)
async def test_a_burst_beyond_the_pending_bound_waits_in_line_and_is_all_welcomed(node):
    # Before: past max_pending_per_uid a hello was refused `busy` at once (a burst of
    # attaches on a slow node became errors, or retries that cost the node more).
    n = 4 + LINE_FACTOR * 4
    burst = [await connect_as(node, 1000) for _ in range(n)]
    for i, b in enumerate(burst):
        await b.send(p.Hello(version=p.PROTOCOL_VERSION, memory_limit=G, name=f"b{i}"))
    welcomed = [await b.expect(p.Welcome, timeout=10) for b in burst]
    assert sorted(w.name for w in welcomed) == sorted(f"b{i}" for i in range(n))
    assert not node.events("refused")
    assert node.node.guard.waiting == 0 and node.node.guard.pending_total == 0


@in_process(max_pending_per_uid=4, hello_timeout=30)
async def test_another_uids_attach_is_answered_at_once_behind_a_silent_flood(node):
    flood = [await connect_as(node, 1000) for _ in range(4 + LINE_FACTOR * 4 + 20)]
    await node.settle()  # 4 wait for their hello, the line is full, the rest refused
    assert node.node.guard.pending == {1000: 4}
    assert node.node.guard.waiting == LINE_FACTOR * 4
    t0 = node.clock.monotonic()
    w = await attach_as(node, 2000, name="other")
    assert node.clock.monotonic() - t0 < 1.0  # not behind the flood's 30 s
    assert w.welcome.name == "other"
    for f in flood:
        f.close()


@in_process(max_pending_per_uid=4, hello_timeout=30, max_pending=6)
async def test_room_for_hellos_goes_to_one_uid_after_another(node):
    # Every uid's line waits for the room all uids share: it is handed out in turn.
    holders = [await connect_as(node, 1000) for _ in range(4)]
    holders += [await connect_as(node, 3000) for _ in range(2)]
    a = [await connect_as(node, 1000) for _ in range(6)]  # in line first
    b = await connect_as(node, 2000)  # after all of them
    await node.settle()
    assert node.node.guard.pending_total == 6 and node.node.guard.waiting == 7
    for x in [*a, b]:
        await x.send(p.Hello(version=p.PROTOCOL_VERSION, memory_limit=G))
    holders.pop().close()  # one room: uid 1000 has all it may, so uid 2000's turn
    got = await b.expect(p.Welcome, timeout=10)
    assert got.session and node.node.guard.lines.get(1000) is not None
    for x in [*holders, *a]:
        x.close()


@in_process(max_messages_per_s=100_000, max_messages_per_s_per_user=1_000)
async def test_one_users_message_flood_does_not_delay_another_users_attach(node):
    # A uid's 40 sessions each write 1,000 frames at once (within each connection's
    # allowance). Before: each connection's frames were read in one go, so another
    # user's hello waited behind all 40,000 (seconds of the node's loop).
    handled: dict[int, int] = {}
    server = node.node.workloads
    real = server._message

    def counted(arb: Any, sid: int, msg: p.Message) -> Any:
        handled[sid] = handled.get(sid, 0) + 1
        return real(arb, sid, msg)

    server._message = counted  # type: ignore[method-assign]
    flooders = [await attach_as(node, 1000, name=f"f{i}") for i in range(40)]
    frames = p.encode(p.Report(resident=0, swapped=0)) * 1000
    for f in flooders:
        f.writer.write(frames)
    await asyncio.gather(*(f.writer.drain() for f in flooders))
    other = await attach_as(node, 2000, name="other")
    before = sum(handled.values())
    assert other.welcome.name == "other"
    assert before < 10_000, before  # its user's budget and bursts, not all 40,000
    t0 = node.clock.monotonic()
    await node.until(lambda: sum(handled.values()) == 40_000, timeout=600)
    # the rest read at the user's rate, all 40 connections together
    took = node.clock.monotonic() - t0
    assert 0.9 * (40_000 - before - 2_000) / 1_000 <= took <= 10 * 40_000 / 1_000
    for f in [*flooders, other]:
        f.close()


@in_process(max_pending_per_uid=2, hello_timeout=30)
async def test_a_stopping_node_ends_the_connections_waiting_in_line(node):
    waiting = [await connect_as(node, 1000) for _ in range(2 + LINE_FACTOR * 2)]
    await node.settle()
    assert node.node.guard.waiting == LINE_FACTOR * 2
    t0 = node.clock.monotonic()
    await node.node.stop()
    for w in waiting:  # ended at once, not after their 30 s
        assert await w.closed(timeout=5)
    assert node.clock.monotonic() - t0 < 5
    handlers = [t for t in asyncio.all_tasks() if "handle" in repr(t.get_coro())]
    assert handlers == []

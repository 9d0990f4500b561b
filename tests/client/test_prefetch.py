"""Prefetch (docs/scheduling.md): a session waiting for the GPU swaps in ahead of its grant
when the node says, within the room it gives, without the lease; against a fake node
(tests/client/fakenode.py), each test checks the messages the client sent."""

from __future__ import annotations

import threading

import pytest

from gpushare import protocol as p
from gpushare.client.lease import Phase
from gpushare.errors import GpushareError
from tests.client.fakenode import Burst, FakeNode, G, fake_session, hold
from tests.client.test_races import PIECE, give_up_waiting, swapped_out
from tests.support import wait_until


def until_swap_done(node: FakeNode) -> tuple[list[p.Report], p.SwapDone]:
    """The reports the client sent, up to its SwapDone."""
    reports = []
    while not isinstance(m := node.recv(), p.SwapDone):
        assert isinstance(m, p.Report), m
        reports.append(m)
    return reports, m


def waiting(s, node: FakeNode) -> Burst:
    b = Burst(s)
    assert node.recv() == p.Acquire(ask=2)
    return b


def test_a_waiting_session_swaps_in_ahead_of_its_grant_without_the_lease():
    with fake_session(memory_limit=4 * G) as (s, node):
        m = swapped_out(s, node, 2 * G)
        b = waiting(s, node)
        node.send(p.Prefetch(room=2 * G, seq=1))
        reports, done = until_swap_done(node)
        assert (done.direction, done.bytes, done.prefetch) == ("in", 2 * G, 1)
        assert (done.resident, done.swapped) == (2 * G, 0)
        assert reports == []  # its progress is not the node's concern: the SwapDone says
        # memory only: still no lease, no GPU work allowed, the burst still waits
        assert s._lease.phase is Phase.ACQUIRING and not s.holding
        with pytest.raises(GpushareError, match="outside a lease"):
            m.verify(7)
        node.send(p.Grant(lease=2, swap_in=0, quantum_s=30.0))
        b.granted()
        assert m.verify(7)  # the bytes that came back early are the right ones
        assert node.said(s) == []  # nothing left to swap in at the grant
        b.exit()


def test_a_prefetch_stops_at_its_room_and_goes_on_with_more():
    with fake_session(memory_limit=4 * G) as (s, node):
        swapped_out(s, node, 2 * G)
        b = waiting(s, node)
        node.send(p.Prefetch(room=G, seq=1))
        _, done = until_swap_done(node)
        assert (done.bytes, done.resident, done.prefetch) == (G, G, 1)
        node.send(p.Prefetch(room=G + G // 2, seq=2))
        _, done = until_swap_done(node)
        assert (done.resident, done.prefetch) == (G + G // 2, 2)
        assert s._lease.phase is Phase.ACQUIRING
        node.send(p.Grant(lease=2, swap_in=G // 2, quantum_s=30.0))
        _, done = until_swap_done(node)  # the grant's swap-in: the rest
        assert (done.resident, done.swapped, done.prefetch) == (2 * G, 0, 0)
        b.granted()
        b.exit()


def test_a_grant_ends_a_prefetch_and_its_swap_in_brings_the_rest():
    with fake_session(memory_limit=4 * G) as (s, node):
        m = swapped_out(s, node, 2 * G)
        b = waiting(s, node)
        lease = s._lease
        # the grant comes while the prefetch is under way: hold the prefetch at its
        # first piece until the grant has been read
        first = threading.Event()
        real_wait_room = lease.wait_room

        def wait_room(resident):
            if lease.prefetching and resident > PIECE:
                first.wait(10)
            real_wait_room(resident)

        s.backend.wait_room = wait_room
        node.send(p.Prefetch(room=2 * G, seq=1))
        wait_until(lambda: s.backend.resident_bytes == PIECE, what="one piece in")
        node.send(p.Grant(lease=2, swap_in=2 * G - PIECE, quantum_s=30.0))
        node.sync(s)
        first.set()
        _, done = until_swap_done(node)
        assert (done.prefetch, done.resident) == (1, PIECE)  # it stopped there
        _, done = until_swap_done(node)
        assert (done.prefetch, done.resident, done.swapped) == (0, 2 * G, 0)
        b.granted()
        assert m.verify(7)
        b.exit()


def test_a_prefetch_crossing_a_withdrawal_is_not_taken():
    with fake_session(memory_limit=4 * G) as (s, node):
        swapped_out(s, node, 2 * G)
        give_up_waiting(s)
        assert node.said(s) == [p.Acquire(ask=2), p.Release(resident=0, swapped=2 * G)]
        node.send(p.Prefetch(room=2 * G, seq=1))
        node.sync(s)
        assert node.said(s) == []  # no swap, no answer: the node counts it no longer
        assert s.backend.swapped_bytes == 2 * G


def test_a_prefetch_stops_when_the_node_goes_away_and_the_next_node_hears_the_figures():
    with fake_session(memory_limit=4 * G) as (s, node):
        swapped_out(s, node, 2 * G)
        b = waiting(s, node)
        gate = threading.Event()
        real_wait_room = s._lease.wait_room

        def wait_room(resident):
            if resident > PIECE:
                gate.wait(10)
            real_wait_room(resident)

        s.backend.wait_room = wait_room
        node.send(p.Prefetch(room=2 * G, seq=1))
        wait_until(lambda: s.backend.resident_bytes == PIECE, what="one piece in")
        node.drop()
        hello = node.take()  # it reconnects: its hello says what it has
        gate.set()
        assert (hello.resident, hello.swapped) in ((PIECE, 2 * G - PIECE), (0, 2 * G))
        wait_until(lambda: not s._lease.prefetching, what="the prefetch to stop")
        msgs = node.said(s)
        assert p.Acquire(ask=3) in msgs  # it asks the new node, which numbers its own asks
        assert not any(isinstance(x, p.SwapDone) and x.prefetch for x in msgs)
        assert s._lease.prefetch_seq == 0
        node.send(p.Grant(lease=1, swap_in=0, quantum_s=30.0))
        b.granted()
        b.exit()


def test_a_holder_takes_no_prefetch():
    with fake_session() as (s, node):
        b = hold(s, node, lease=1)
        node.send(p.Prefetch(room=G, seq=1))
        node.sync(s)
        assert s._lease.prefetch_seq == 0 and node.said(s) == []
        b.exit()

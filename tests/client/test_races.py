"""Races between the node's messages and the workload's threads, played in a chosen order
against a fake node (tests/client/fakenode.py): each test checks the exact messages the
client sent and the state it is left in."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from gpushare import protocol as p
from gpushare.client.lease import Phase
from gpushare.client.transport import Link
from gpushare.errors import DaemonUnavailableError, GpushareError
from tests.client.fakenode import Burst, FakeNode, G, fake_session, hold
from tests.support import wait_until

PIECE = 256 * 2**20  # the sim backend's swap granularity


def grant(
    lease: int, swap_in: int = 0, room: int = 0, resume: bool = False, ask: int = 0
) -> p.Grant:
    return p.Grant(lease=lease, swap_in=swap_in, quantum_s=30.0, room=room, resume=resume, ask=ask)


def swapped_out(s, node: FakeNode, nbytes: int = 2 * G, seed: int = 7):
    """The session's memory, filled and then all in host memory (the node asked)."""
    b = hold(s, node, lease=1)
    m = s.backend.allocate(nbytes)
    m.fill(seed)
    b.exit()
    assert [type(x) for x in node.said(s)] == [p.Report, p.Release]
    node.send(p.SwapOut(bytes=nbytes))
    msgs = [node.recv() for _ in range(nbytes // PIECE + 1)]
    assert msgs[-1] == p.SwapDone(
        direction="out", bytes=nbytes, seconds=msgs[-1].seconds, resident=0, swapped=nbytes
    )
    return m


def give_up_waiting(s) -> None:
    """A burst that waits, interrupted (a signal handler raises, as Ctrl-C would)."""

    def give_up(*_):
        raise TimeoutError("gave up waiting")

    old = signal.signal(signal.SIGALRM, give_up)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(TimeoutError), s.gpu():
            pass
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_a_grant_crossing_a_withdrawal_is_not_taken():
    with fake_session() as (s, node):
        give_up_waiting(s)
        # it asked, then withdrew; the node had granted meanwhile
        assert node.said(s) == [p.Acquire(ask=1), p.Release(resident=0, swapped=0)]
        node.send(grant(1))
        node.sync(s)
        assert s._lease.phase is Phase.IDLE and s._lease.grant is None and not s.holding
        assert node.said(s) == []  # its release gave that lease back already
        # the next burst asks anew and holds its own grant only
        b = hold(s, node, lease=2)
        assert s._lease.lease == 2 and s.grants == 1
        b.exit()


def test_a_crossed_grant_after_asking_again_is_not_taken():
    # A cell interrupted while it waits, and run again at once: the grant of the first
    # ask crossed the withdrawal. Taken as the answer to the second ask, the session
    # held a lease the node had ended when it read the release (two holders).
    with fake_session() as (s, node):
        give_up_waiting(s)
        assert node.said(s) == [p.Acquire(ask=1), p.Release(resident=0, swapped=0)]
        b = Burst(s)  # and asks again at once
        assert node.recv() == p.Acquire(ask=2)
        node.send(grant(1, ask=1))  # sent before the node read the release: it crossed it
        node.sync(s)
        b.thread.join(0.2)  # it waits on for the grant of its new ask
        assert b.thread.is_alive() and not s.holding and s._lease.grant is None
        node.send(grant(2, ask=2))
        b.granted()
        assert s.holding and s._lease.lease == 2
        b.exit()
        assert node.said(s) == [p.Release(resident=0, swapped=0)]


def test_a_thaw_grant_after_a_revoke_keeps_the_burst_going():
    with fake_session() as (s, node):
        b = hold(s, node, lease=1)
        node.send(p.Revoke(lease=1, swap_out=0, grace_s=0.1))
        node.sync(s)
        assert not s._lease.ready
        # no safe point within the grace: frozen, its lease released, then thawed and
        # granted again in its turn (SIGSTOP/SIGCONT: nothing the client sees)
        node.send(grant(2))
        node.sync(s)
        assert s._lease.lease == 2 and s._lease.ready
        s.checkpoint()  # not a yield: the revoke was for lease 1
        node.send(p.Revoke(lease=1, swap_out=0, grace_s=0.1))  # stale: ignored
        node.sync(s)
        assert s._lease.ready
        assert node.said(s) == []
        b.exit()
        assert node.said(s) == [p.Release(resident=0, swapped=0)]


def test_a_safe_point_reads_a_thaw_grant_already_sent_before_yielding():
    # Thawed, the workload reaches a checkpoint before the reader thread has handled the
    # grant the node sent at the thaw: yielding to the old revoke would give up lease 2.
    with fake_session() as (s, node):
        b = hold(s, node, lease=1)
        node.send(p.Revoke(lease=1, swap_out=0, grace_s=0.1))
        node.sync(s)
        reading, go = threading.Event(), threading.Event()
        handle = s._lease.on_message

        def slow_reader(msg):
            if isinstance(msg, p.Grant):
                reading.set()
                go.wait(10)
            handle(msg)

        s._lease.on_message = slow_reader
        caught_up = threading.Event()
        catch_up = s._link.catch_up

        def spy(*a):
            caught_up.set()
            catch_up(*a)

        s._link.catch_up = spy
        node.send(grant(2))
        assert reading.wait(10)
        t = threading.Thread(target=s.checkpoint)
        t.start()
        assert caught_up.wait(10), "the checkpoint yielded without reading what was sent"
        go.set()
        t.join(10)
        assert not t.is_alive()
        assert node.said(s) == []  # no release: lease 2 goes on
        assert s._lease.lease == 2 and s.holding and s.grants == 1
        b.exit()


def test_a_swap_in_stops_when_the_node_goes_and_finishes_under_the_next():
    with fake_session() as (s, node):
        m = swapped_out(s, node)
        b = Burst(s)
        assert node.recv() == p.Acquire(ask=2)
        node.send(grant(2, swap_in=2 * G, room=G))  # the last holder still swaps out
        wait_until(lambda: s.backend.resident_bytes == G, what="1 GiB in, then a wait for room")
        node.drop()  # the node dies in the overlapped switch
        hello = node.take()
        assert (hello.resident, hello.swapped, hello.holding) == (G, G, False)
        assert node.recv() == p.Acquire(ask=3)  # asks the new node, its figures said by the hello
        assert s.backend.resident_bytes == G  # nothing moved in without a node's grant
        node.send(grant(1, swap_in=G))
        b.granted()
        msgs = node.said(s)
        assert msgs[-1] == p.SwapDone(
            direction="in", bytes=G, seconds=msgs[-1].seconds, resident=2 * G, swapped=0
        )
        assert all(isinstance(x, p.Report) for x in msgs[:-1])
        assert m.verify(7) and s.holding
        b.exit()


def test_a_swap_without_a_room_stops_at_the_next_piece_when_the_node_goes():
    with fake_session() as (s, node):
        m = swapped_out(s, node)
        pieces, at_third, go = 0, threading.Event(), threading.Event()
        wait_room = s.backend.wait_room

        def third_piece_waits(resident):
            nonlocal pieces
            pieces += 1
            if pieces == 3:
                at_third.set()
                go.wait(10)
            wait_room(resident)

        s.backend.wait_room = third_piece_waits
        b = Burst(s)
        assert node.recv() == p.Acquire(ask=2)
        node.send(grant(2, swap_in=2 * G))  # no room bound: it would go straight through
        assert at_third.wait(10)
        node.drop()
        hello = node.take()
        go.set()
        assert (hello.resident, hello.swapped) == (2 * PIECE, 2 * G - 2 * PIECE)
        assert not hello.holding
        assert node.recv() == p.Acquire(ask=3)
        assert s.backend.resident_bytes == 2 * PIECE  # stopped before the third piece
        node.send(grant(1, swap_in=2 * G - 2 * PIECE))
        b.granted()
        assert m.verify(7) and s.backend.resident_bytes == 2 * G
        b.exit()


def test_a_room_growing_while_swapping_in():
    with fake_session() as (s, node):
        m = swapped_out(s, node)
        rooms = []
        wait_room = s.backend.wait_room

        def spy(resident):
            wait_room(resident)
            rooms.append((resident, s._lease.room))

        s.backend.wait_room = spy
        b = Burst(s)
        assert node.recv() == p.Acquire(ask=2)
        node.send(grant(2, swap_in=2 * G, room=2 * PIECE))
        # (a swap-in's progress is not reported: the holder counts at its room)
        wait_until(lambda: s.backend.resident_bytes == 2 * PIECE, what="two pieces in")
        node.send(p.SwapOut(bytes=G))  # stale (sent before the grant): a holder keeps its memory
        assert node.recv() == p.SwapDone(
            direction="out",
            bytes=0,
            seconds=0.0,
            resident=2 * PIECE,
            swapped=2 * G - 2 * PIECE,
            error="session holds the GPU",
        )
        node.send(p.Room(room=G))
        wait_until(lambda: s.backend.resident_bytes == G, what="1 GiB in")
        node.send(p.Room(room=2 * G))  # its limit: no bound
        b.granted()
        msgs = node.said(s)
        assert not [x for x in msgs if isinstance(x, p.Report)]
        assert msgs[-1] == p.SwapDone(
            direction="in", bytes=2 * G, seconds=msgs[-1].seconds, resident=2 * G, swapped=0
        )
        # every piece came in within the room the node had given at the time
        assert all(room == 0 or resident <= room for resident, room in rooms), rooms
        assert m.verify(7)
        b.exit()


def test_a_swap_out_asked_of_a_holder_is_refused():
    with fake_session() as (s, node):
        b = hold(s, node, lease=1)
        m = s.backend.allocate(G)
        m.fill(3)
        assert node.said(s) == [p.Report(resident=G, swapped=0)]
        node.send(p.SwapOut(bytes=G))
        assert node.recv() == p.SwapDone(
            direction="out",
            bytes=0,
            seconds=0.0,
            resident=G,
            swapped=0,
            error="session holds the GPU",
        )
        assert s.backend.resident_bytes == G and m.verify(3)
        b.exit()


def test_a_session_ended_mid_burst_stops_at_its_next_safe_point():
    with fake_session() as (s, node):
        b = hold(s, node, lease=1)
        s.checkpoint()
        node.send(p.Error(code="ended", message="session ended: maintenance"))
        node.sync(s)
        assert s._link.state is Link.ENDED and not s.holding and s._fatal
        with pytest.raises(DaemonUnavailableError, match=r"ended this session: .*maintenance"):
            s.checkpoint()
        with pytest.raises(GpushareError, match="outside a lease"):
            s.backend.allocate(1)
        b.exit()
        with pytest.raises(DaemonUnavailableError, match="maintenance"), s.gpu():
            pass
        assert not node.unread()  # nothing said to a node that ended the session
        node.drop()
        s._link._reader.join(10)
        assert node.connects == 1  # and no coming back


def test_a_reconnecting_hello_says_the_request_filled_in():
    """Issue 37: back at a node, the session says its request as it was told it (here by
    a node older than issue 37, whose welcome left it out for "the limit"): filled in,
    not left out again for "the limit"."""
    with fake_session() as (s, node):
        assert s.memory_request == s.memory_limit == 2 * G
        node.drop()
        hello = node.take()
        assert (hello.memory_request, hello.memory_limit) == (2 * G, 2 * G)


def test_a_refused_reconnect_ends_the_session():
    with fake_session() as (s, node):
        node.refuse = 2  # the node restarts: nothing listens for a while
        node.answers.append(
            p.Error(code="attach", message="memory limit 2 GiB exceeds GPU 0's usable 1 GiB")
        )
        node.drop()
        hello = node.take()
        assert hello.memory_limit == 2 * G and not hello.holding
        wait_until(lambda: s._link.state is Link.ENDED, what="the refusal")
        assert node.connects == 4  # the attach, two refused, the refusal
        with pytest.raises(DaemonUnavailableError, match="refused on reconnecting: memory limit"):
            s.checkpoint()


def test_a_burst_waiting_when_the_node_goes_asks_the_next():
    with fake_session() as (s, node):
        b = Burst(s)
        assert node.recv() == p.Acquire(ask=1)
        node.drop()
        hello = node.take()
        assert not hello.holding
        assert node.recv() == p.Acquire(ask=2)  # the new node has not heard it ask
        node.send(grant(1))
        b.granted()
        assert s.grants == 1 and s.id == 2
        b.exit()


def test_a_holder_reconnecting_takes_the_resumed_lease_only():
    with fake_session() as (s, node):
        b = hold(s, node, lease=5)
        node.drop()
        hello = node.take()
        assert hello.holding  # it re-registers its lease
        wait_until(lambda: s._link.generation == 1, what="the reconnect")
        b.exit()  # the burst ends before the node's resumed grant is read
        assert node.recv() == p.Release(resident=0, swapped=0)
        b2 = Burst(s)
        assert node.recv() == p.Acquire(ask=2)
        node.send(grant(1, resume=True))  # the lease the hello claimed, given back before
        node.sync(s)  # the release came
        assert not s.holding and s._lease.phase is Phase.ACQUIRING
        node.send(grant(2))  # the answer to the acquire
        b2.granted()
        assert s._lease.lease == 2
        b2.exit()


def test_a_burst_ending_while_reconnecting_gives_back_the_lease_it_claimed():
    with fake_session() as (s, node):
        b = hold(s, node, lease=5)
        node.go_away()  # its reconnect waits once its hello is made
        b.exit()  # the release cannot be sent: no node
        node.gate.set()  # it comes back
        hello = node.take()
        assert hello.holding  # made before the burst ended
        assert node.recv() == p.Release(resident=0, swapped=0)  # so it gives that lease back
        node.send(grant(1, resume=True))  # granted for the hello, before the release was read
        node.sync(s)
        assert not s.holding and s._lease.phase is Phase.IDLE
        assert node.said(s) == []


def test_a_burst_goes_on_while_the_node_is_away_and_a_new_one_waits():
    with fake_session() as (s, node):
        b = hold(s, node, lease=1)
        node.go_away()
        assert s._link.state is Link.AWAY
        with s.gpu():  # a nested burst joins at once
            s.checkpoint()
            s.backend.allocate(G)
        b.exit()  # the release reaches no one
        s.reconnect_timeout = 0.2
        with pytest.raises(DaemonUnavailableError, match=r"away for 0\.2 s"), s.gpu():
            pass
        node.gate.set()  # it comes back
        hello = node.take()  # made as the node went: holding, nothing allocated yet
        assert (hello.resident, hello.holding) == (0, True)
        assert node.said(s) == [p.Release(resident=G, swapped=0)]  # what changed since


def test_an_implicit_burst_granted_after_a_long_wait_is_not_ended_at_once():
    # idle_release counts from the grant, not from the checkpoint that asked: else a
    # burst that waited longer than idle_release would be ended as it begins, and the
    # GPU work after that checkpoint would run outside a lease.
    # idle_release 2 s: the quiet 0.3 s after the grant has 1.7 s to spare on a busy machine
    with fake_session(idle_release_s=2.0) as (s, node):
        t = threading.Thread(target=s.checkpoint)  # GPU work outside gpu(): asks
        t.start()
        assert node.recv() == p.Acquire(ask=1)
        time.sleep(2.5)  # others hold the GPU longer than idle_release
        node.send(grant(1))
        t.join(10)
        assert s.holding
        time.sleep(0.3)  # a quiet period, well within idle_release of the grant
        assert s.holding and node.said(s) == []
        wait_until(lambda: not s.holding, what="the idle release")
        (rel,) = node.said(s)
        assert rel == p.Release(resident=0, swapped=0, idle_s=rel.idle_s)
        assert rel.idle_s >= 2.0  # its idle release, said


def test_a_holder_shows_its_lease_and_token_to_a_restarted_node_and_yields_if_refused():
    with fake_session() as (s, node):
        b = Burst(s)
        assert node.recv() == p.Acquire(ask=1)
        node.send(p.Grant(lease=5, swap_in=0, quantum_s=30.0, token="t5"))
        b.granted()
        node.drop()  # the node restarts: it opens a recovery window
        hello = node.take()
        assert (hello.holding, hello.lease, hello.token, hello.session) == (True, 5, "t5", 1)
        time.sleep(0.2)  # no answer yet (the window): the burst goes on meanwhile
        assert s.holding and node.said(s) == []
        node.send(p.Revoke(lease=5, swap_out=0, grace_s=5.0))  # its claim is refused
        node.sync(s)
        t = threading.Thread(target=s.checkpoint)  # the next safe point yields
        t.start()
        assert node.recv() == p.Release(resident=0, swapped=0, again=True, ask=2)
        node.send(grant(6))  # its turn, later: a new lease, taken (not a "resumed" one)
        t.join(10)
        assert not t.is_alive() and s.holding and s._lease.lease == 6
        b.exit()


def test_a_resumed_lease_comes_with_a_new_token():
    with fake_session() as (s, node):
        b = hold(s, node, lease=5, token="t5")
        node.drop()
        hello = node.take()
        assert hello.token == "t5"
        node.send(p.Grant(lease=9, swap_in=0, quantum_s=30.0, token="t9", resume=True))
        node.sync(s)
        assert s.holding and (s._lease.lease, s._lease.token) == (9, "t9")
        node.drop()
        assert node.take().token == "t9"  # shown to the next restart
        b.exit()


def test_a_compile_inside_this_threads_gpu_block_gives_the_lease_back_and_asks_again():
    # issue 25: a compile inside `with session.gpu():` held the lease through it (no safe
    # point for seconds: escalated past the grace); the calling thread's block alone is
    # given back, and asked again before the block goes on
    with fake_session() as (s, node):
        answer = threading.Thread(target=lambda: (node.recv(), node.send(grant(1))))
        answer.start()
        with s.gpu():
            answer.join(10)
            assert s._lease.pause_work()
            assert s._lease.phase is Phase.IDLE and not s.holding
            assert [type(m) for m in node.said(s)] == [p.Release]
            answer = threading.Thread(target=lambda: (node.recv(), node.send(grant(2))))
            answer.start()
            s._lease.resume_work()
            answer.join(10)
            assert s.holding and s._lease.lease == 2 and not s._lease.implicit
        assert s._lease.phase is Phase.IDLE
        assert [type(m) for m in node.said(s)] == [p.Release]


def test_a_compile_while_another_thread_is_inside_gpu_keeps_the_lease():
    # that thread's GPU work would lose the lease under it
    with fake_session() as (s, node):
        b = hold(s, node, lease=1)  # entered on a thread of its own
        assert not s._lease.pause_work()
        assert s.holding and node.said(s) == []
        b.exit()


def test_a_compile_that_keeps_the_lease_says_so_once_and_its_hooks_step_aside(capsys):
    from types import SimpleNamespace

    from gpushare.client import hooks

    dynamo = SimpleNamespace(callback_trigger=SimpleNamespace(name="DYNAMO"))
    with fake_session() as (s, node):
        b = hold(s, node, lease=1)  # another thread's gpu() block: the lease stays
        saved, said = hooks._compile_session[:], hooks._said_holding[:]
        hooks._compile_session[:], hooks._said_holding[:] = [s], [False]
        try:
            for _ in range(2):
                hooks._compile_start(dynamo)
                assert hooks._compiles.n == 1  # the hooks step aside in this thread
                hooks._compile_end(dynamo)
                assert hooks._compiles.n == 0
        finally:
            hooks._compile_session[:], hooks._said_holding[:] = saved, said
        assert s.holding and node.said(s) == []
        b.exit()
    err = capsys.readouterr().err
    assert err.count("holds the GPU while torch.compile compiles") == 1, err


def test_a_backend_that_reports_while_it_is_made_does_not_break_the_attach(monkeypatch):
    """The torch backend's allocator watcher reported from its own thread before the lease
    had its backend (an AttributeError there, on an H200): a report then is left for the
    first release to tell."""
    import gpushare.client.session as session

    real = session._backend_for
    reported: list[int] = []

    def reporting_at_once(name, w):
        make = real(name, w)

        def build(hooks):
            hooks.on_change()  # as the watcher thread may, before the constructor returns
            reported.append(1)
            return make(hooks)

        return build

    monkeypatch.setattr(session, "_backend_for", reporting_at_once)
    with fake_session() as (s, node):
        assert reported == [1] and s.backend is not None
        b = hold(s, node, lease=1)
        s.backend.allocate(PIECE)
        b.exit()
        said = node.said(s)
        assert [type(x) for x in said] == [p.Report, p.Release], said  # told once made


def test_an_implicit_bursts_release_says_how_long_it_idled_and_an_explicit_ones_none():
    """Issue 40: the node counted a server's implicit bursts with their idle release (0.17
    s of work looked 0.67 s long). The release says the idle it held after its last safe
    point; a ``with s.gpu()`` burst ends at its block's end, with no idle to say."""
    with fake_session(idle_release_s=0.5) as (s, node):
        t = threading.Thread(target=s.checkpoint)  # an implicit burst asks
        t.start()
        assert isinstance(node.recv(), p.Acquire)
        node.send(p.Grant(lease=1, swap_in=0, quantum_s=30.0, idle_release_s=0.1))
        t.join(10)
        rel = node.recv()  # its grant's idle release after its last checkpoint
        assert isinstance(rel, p.Release) and not rel.again
        assert 0.1 <= rel.idle_s < 1.0, rel
        b = hold(s, node, lease=2)
        b.exit()
        rel = node.recv()
        assert isinstance(rel, p.Release) and rel.idle_s == 0.0

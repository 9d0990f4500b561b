"""A fake node for one session, over socketpairs: the node's side of the real protocol,
scripted step by step from the test thread, so races between the node's messages and the
workload's threads can be played in a chosen order.

The fake is the session's connector: each (re)connect makes a socketpair, puts the
node's answer to the hello (a welcome unless told otherwise) in it at once, and queues
the node's end for the test to :meth:`FakeNode.take`. The test then reads what the
client sent (:meth:`recv`), sends what a node would (:meth:`send`), waits until the
client has handled it (:meth:`sync`), and checks that nothing else was said
(:meth:`said`).
"""

from __future__ import annotations

import contextlib
import queue
import select
import socket
import threading
from collections import deque
from collections.abc import Iterator

from gpushare import protocol as p
from gpushare.client.session import Session, open_session
from gpushare.client.transport import Link
from tests.support import wait_until

G = 2**30
MARK = 7_777_777_777  # the swapped figure of the report :meth:`FakeNode.said` ends with


class FakeNode:
    where = "fake-node"

    def __init__(self, memory_limit: int = 2 * G, idle_release_s: float = 60.0) -> None:
        self.memory_limit = memory_limit
        self.idle_release_s = idle_release_s
        self.connects = 0
        self.refuse = 0  # connects to refuse (ECONNREFUSED) before the next one is made
        self.answers: deque[p.Message] = deque()  # answers to the next hellos, else welcome
        self.gate: threading.Event | None = None  # set: connects wait for it first
        self.dialing = threading.Event()  # a connect began (its hello is made)
        self._ends: queue.Queue[socket.socket] = queue.Queue()
        self.conn: socket.socket | None = None
        self._buf = p.FrameBuffer()
        self._msgs: deque[p.Message] = deque()
        self.sent = 0  # messages sent to the client after welcomes, over every connection
        self.taken = 0  # connections taken by the test

    # --- the session's connector ----------------------------------------------------

    def __call__(self, timeout: float) -> socket.socket:
        self.dialing.set()
        if self.gate is not None:
            self.gate.wait(10)
        self.connects += 1
        if self.refuse:
            self.refuse -= 1
            raise ConnectionRefusedError(111, "Connection refused")
        client, node = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        answer = self.answers.popleft() if self.answers else self.welcome()
        node.sendall(p.encode(answer))
        self._ends.put(node)
        return client

    def welcome(self) -> p.Welcome:
        return p.Welcome(
            session=self.connects,
            name="raced",
            gpu=0,
            gpu_name="Fake GPU",
            simulated=True,
            memory_limit=self.memory_limit,
            weight=1.0,
            idle_release_s=self.idle_release_s,
            sim_bandwidth=1e15,  # copies take no modelled time
        )

    def attach(self) -> tuple[Session, p.Hello]:
        s = open_session(self, p.Hello(version=p.PROTOCOL_VERSION, name="raced", fills=True))
        s._link.backoff = (0.001, 0.01)  # reconnect tries back to back
        s.backend.progress_every_s = 0.0  # a report after every piece
        return s, self.take()

    # --- the node's end -------------------------------------------------------------

    def take(self) -> p.Hello:
        """The next connection the client made: it is the current one; returns its hello."""
        self.conn = self._ends.get(timeout=10)
        self.taken += 1
        self.conn.settimeout(10)
        self._buf, self._msgs = p.FrameBuffer(), deque()
        hello = self.recv()
        assert isinstance(hello, p.Hello), hello
        return hello

    def send(self, msg: p.Message) -> None:
        assert self.conn is not None
        self.conn.sendall(p.encode(msg))
        self.sent += 1

    def recv(self) -> p.Message:
        assert self.conn is not None
        while not self._msgs:
            data = self.conn.recv(65536)
            if not data:
                raise ConnectionError("the client closed the connection")
            self._msgs.extend(self._buf.feed(data))
        return self._msgs.popleft()

    def drop(self) -> None:
        """The node goes away (a crash: the connection closes)."""
        assert self.conn is not None
        self.conn.close()
        self.conn = None

    def go_away(self) -> None:
        """The node goes and stays away: the client's next connect waits (its hello is
        made by then) until the test sets :attr:`gate`."""
        self.gate = threading.Event()
        self.dialing.clear()
        self.drop()
        assert self.dialing.wait(10)

    def sync(self, s: Session) -> None:
        """Until the client has handled every message sent to it."""
        wait_until(lambda: s._link.received >= self.sent, what="the client to read")

    def said(self, s: Session) -> list[p.Message]:
        """What the client sent that was not read yet, up to now: it is made to send a
        marked report from this thread, and everything before the mark is returned."""
        wait_until(
            lambda: s._link.state is Link.CONNECTED and s._link.generation == self.taken - 1,
            what="the client to be connected on the connection taken last",
        )
        s._link.send(p.Report(resident=0, swapped=MARK))
        out = []
        while not isinstance(m := self.recv(), p.Report) or m.swapped != MARK:
            out.append(m)
        return out

    def unread(self) -> bool:
        """The client sent bytes not read yet (for a link it may no longer write to)."""
        assert self.conn is not None
        return bool(self._msgs) or bool(select.select([self.conn], [], [], 0)[0])

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        while not self._ends.empty():
            self._ends.get().close()


@contextlib.contextmanager
def fake_session(**kw: float) -> Iterator[tuple[Session, FakeNode]]:
    node = FakeNode(**kw)
    s, _ = node.attach()
    try:
        yield s, node
    finally:
        if node.gate is not None:
            node.gate.set()
        s.close()
        node.close()


class Burst:
    """``with s.gpu()`` entered on a thread of its own (it blocks until granted) and left
    from the test thread when the test says."""

    def __init__(self, s: Session) -> None:
        self.s = s
        self.cm = s.gpu()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._enter, daemon=True)
        self.thread.start()

    def _enter(self) -> None:
        try:
            self.cm.__enter__()
        except BaseException as e:
            self.error = e

    def granted(self) -> Burst:
        self.thread.join(10)
        assert not self.thread.is_alive(), "still waiting for the grant"
        if self.error is not None:
            raise self.error
        return self

    def exit(self) -> None:
        self.cm.__exit__(None, None, None)


def hold(s: Session, node: FakeNode, lease: int, **grant: int | str) -> Burst:
    """A burst that asks and is granted ``lease``; returns it holding."""
    b = Burst(s)
    assert isinstance(node.recv(), p.Acquire)
    node.send(p.Grant(lease=lease, swap_in=0, quantum_s=30.0, **grant))
    b.granted()
    assert s.holding
    return b

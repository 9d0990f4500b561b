"""Connecting to the node: a busy socket is tried again within the timeout, a node that
does not answer is a clear error, and a refusal is a public exception."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

import gpushare
from gpushare import protocol as p
from gpushare.client import transport
from gpushare.client.transport import Link
from gpushare.errors import AttachRefusedError, DaemonUnavailableError, GpushareError
from tests.client.fakenode import FakeNode, G
from tests.support import wait_until

WELCOME = p.Welcome(
    session=1,
    name="w",
    gpu=0,
    gpu_name="Fake GPU",
    simulated=True,
    memory_limit=G,
    weight=1.0,
    idle_release_s=60.0,
)


def listening(path: str) -> socket.socket:
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    return srv


def fill_backlog(path: str) -> list[socket.socket]:
    """Connections that nobody accepts, until the listen backlog is full (EAGAIN)."""
    out = []
    while True:
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.setblocking(False)
        try:
            c.connect(path)
        except BlockingIOError:
            c.close()
            return out
        out.append(c)


def serve_hello(srv: socket.socket, answer: p.Message = WELCOME) -> socket.socket:
    conn, _ = srv.accept()
    conn.settimeout(10)
    buf = p.FrameBuffer()
    while not (msgs := buf.feed(conn.recv(65536))):
        pass
    assert isinstance(msgs[0], p.Hello)
    conn.sendall(p.encode(answer))
    return conn


@pytest.fixture
def retries(monkeypatch):
    """Set when connect() pauses to try again."""
    event = threading.Event()
    sleep = transport._sleep

    def spy(seconds: float) -> None:
        event.set()
        sleep(seconds)

    monkeypatch.setattr(transport, "_sleep", spy)
    return event


def attach_in_thread(path: str, **kw) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        try:
            out["session"] = gpushare.attach("1GiB", socket=path, **kw)
        except BaseException as e:
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def attached(srv: socket.socket, t: threading.Thread, out: dict) -> None:
    """The node answers the attach in ``t``, which succeeds."""
    conn = serve_hello(srv)
    t.join(10)
    assert "error" not in out, out.get("error")
    out["session"].close()
    conn.close()
    srv.close()


def test_a_busy_node_is_tried_again_within_the_timeout(short_tmp, retries):
    path = str(short_tmp / "w.sock")
    srv = listening(path)
    waiting = fill_backlog(path)
    assert waiting, "the backlog took no connection"
    t, out = attach_in_thread(path, timeout=10)
    assert retries.wait(10)  # its first try met the full backlog
    for _ in waiting:  # the node catches up with the others
        srv.accept()[0].close()
    attached(srv, t, out)


def test_a_node_that_stays_busy_is_a_clear_error(short_tmp):
    path = str(short_tmp / "w.sock")
    srv = listening(path)
    waiting = fill_backlog(path)
    t0 = time.monotonic()
    with pytest.raises(DaemonUnavailableError, match=r"stayed busy for 0\.5 s .*timeout="):
        gpushare.attach("1GiB", socket=path, timeout=0.5)
    assert time.monotonic() - t0 < 5
    for c in waiting:
        c.close()
    srv.close()


def test_a_socket_file_nobody_listens_on_is_a_clear_error(short_tmp):
    path = str(short_tmp / "w.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)  # a node that died: its socket file is left, nobody listens
    s.close()
    with pytest.raises(DaemonUnavailableError, match=r"no node listens there.*'gpushare node'"):
        gpushare.attach("1GiB", socket=path, timeout=0.3)


def test_a_node_starting_during_the_attach_is_reached(short_tmp, retries):
    path = str(short_tmp / "w.sock")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)
    stale.close()
    t, out = attach_in_thread(path, timeout=10)
    assert retries.wait(10)  # refused: tried again
    os.unlink(path)  # the node (re)starts: a fresh socket at the same path
    srv = listening(path)
    attached(srv, t, out)


def test_a_refused_attach_is_a_public_error_with_a_code():
    node = FakeNode()
    node.answers.append(p.Error(code="gpu", message="no GPU 3 on this node (it has 1)"))
    with pytest.raises(gpushare.AttachRefusedError, match="no GPU 3") as e:
        node.attach()
    assert e.value.code == "gpu" and isinstance(e.value, GpushareError)
    assert type(e.value) is AttachRefusedError
    node.close()


def test_a_node_that_hangs_up_at_hello_is_unavailable(short_tmp):
    path = str(short_tmp / "w.sock")
    srv = listening(path)

    def hang_up() -> None:
        conn, _ = srv.accept()
        conn.recv(65536)
        conn.close()

    threading.Thread(target=hang_up, daemon=True).start()
    with pytest.raises(DaemonUnavailableError, match="closed the connection"):
        gpushare.attach("1GiB", socket=path, timeout=5)
    srv.close()


def test_a_busy_node_is_tried_again_at_attach_and_at_reconnect(retries):
    busy = p.Error(code="busy", message="uid 0 has 64 connections open without a hello")
    node = FakeNode()
    node.answers.extend([busy, busy])
    s, _ = node.attach()  # a flood of others' connections: this one gets in after it
    assert node.connects == 3 and s.id == 3 and retries.is_set()
    node.take(), node.take()  # the connection it holds is the third
    s._link.backoff = (0.001, 0.01)
    node.answers.append(busy)
    node.drop()
    node.take()  # refused: busy
    hello = node.take()  # tried again, taken: the session goes on
    assert hello.session == 3 and node.connects == 5
    wait_until(lambda: s._link.state is Link.CONNECTED, what="the reconnect")
    s.close()
    node.close()

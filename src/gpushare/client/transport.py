"""The client's connection to the node: connect, handshake, frames, the reader thread, and
reconnecting.

One :class:`Transport` per session. It owns the socket and the state of the link
(:class:`Link`), sends frames under a lock, and runs the reader thread, which hands every
message from the node to the session's lease (its :class:`Peer`) and, when the node goes
away, reconnects with backoff and re-registers the session with a fresh hello. It knows
nothing of leases: what a new connection must be told is the peer's to say. Link state
changes under the condition the transport shares with its peer, so the lease reads one
consistent picture of both.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import logging
import os
import random
import select
import socket as _socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import Protocol

from gpushare import protocol as p
from gpushare.errors import AttachRefusedError, DaemonUnavailableError

log = logging.getLogger("gpushare.client.transport")

# Error codes after which the node closes the session for good (no reconnecting).
FATAL = frozenset({"ended", "protocol", "denied", "rate", "limit"})
RECONNECT_BACKOFF = (0.05, 2.0)  # seconds: first and longest pause between reconnect tries
BUSY_BACKOFF = (0.002, 0.1)  # seconds: the same for a socket whose listen backlog is full
# The same for a hello answered `busy` (the node's line for room to say hello in is full,
# or it is recovering): longer, since each try costs the node an accept and an answer,
# and a thousand clients trying again every 0.1 s would be more work than their attaches.
HELLO_BUSY_BACKOFF = (0.05, 1.0)
RECONNECT_TIMEOUT = 10.0  # seconds for one reconnect try (connect and handshake)

_sleep = time.sleep  # a module attribute, so a test can see the retries
_FIX = "start it with 'gpushare node' or point GPUSHARE_SOCKET at its socket"


Ended = Callable[[str, float], None]
"""``(reason, grace_s)``: the node ends the session in ``grace_s`` seconds (``0``: it has,
for good)."""


class Link(enum.Enum):
    """Where a session's connection stands (its lease's state is apart: ``Phase``)."""

    CONNECTED = "connected"  # a node serves this session
    AWAY = "away"  # the node went away: the reader thread reconnects
    ENDED = "ended"  # the node ended the session, or refused it on reconnecting: for good
    CLOSED = "closed"  # closed by this process
    FORKED = "forked"  # a forked child's copy of the parent's session: never used


LIVE = frozenset({Link.CONNECTED, Link.AWAY})  # a burst in progress may go on


def connect(path: str, timeout: float) -> _socket.socket:
    """A connected Unix socket to ``path``. A busy node (its listen backlog full: EAGAIN)
    or a socket file nobody listens on yet (ECONNREFUSED: a node starting or restarting)
    is tried again with short, jittered backoff until ``timeout``; then, and for any other
    failure at once, :class:`DaemonUnavailableError` saying what to do."""
    deadline = time.monotonic() + timeout
    delay = BUSY_BACKOFF[0]
    while True:
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        try:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            sock.connect(path)
            return sock
        except (BlockingIOError, ConnectionRefusedError) as e:
            sock.close()
            left = deadline - time.monotonic()
            if left <= 0 or not os.path.exists(path):
                raise DaemonUnavailableError(_busy(path, e, timeout)) from None
            _sleep(min(delay * random.uniform(0.5, 1.5), left))
            delay = min(delay * 2, BUSY_BACKOFF[1])
        except OSError as e:
            sock.close()
            raise DaemonUnavailableError(
                f"cannot reach the gpushare node at {path} ({e.strerror or e}): {_FIX}"
            ) from None
        except BaseException:
            sock.close()
            raise


def _busy(path: str, e: OSError, timeout: float) -> str:
    if e.errno == errno.ECONNREFUSED or not os.path.exists(path):
        return (
            f"cannot reach the gpushare node at {path} ({e.strerror}, for {timeout:g} s:"
            f" no node listens there): {_FIX}"
        )
    return (
        f"the gpushare node at {path} stayed busy for {timeout:g} s ({e.strerror}: its"
        " listen backlog is full, too many attaches at once): try again, or attach with"
        " a longer timeout="
    )


class Connector(Protocol):
    """Makes a new connected socket to the node; ``where`` names it in messages."""

    where: str

    def __call__(self, timeout: float) -> _socket.socket: ...


class UnixConnector:
    def __init__(self, path: str) -> None:
        self.where = path

    def __call__(self, timeout: float) -> _socket.socket:
        return connect(self.where, timeout)


def open_connection(
    connector: Connector, hello: p.Hello, timeout: float
) -> tuple[_socket.socket, p.Welcome, list[p.Message]]:
    """Connect, say hello, read the welcome; returns what followed it too. A refusal is
    :class:`AttachRefusedError`; anything else that fails, :class:`DaemonUnavailableError`."""
    deadline = time.monotonic() + timeout
    delay = HELLO_BUSY_BACKOFF[0]
    while True:
        try:
            return _handshake(connector, hello, deadline, timeout)
        except _Busy as e:  # too many connections wait for their hello: try again soon
            left = deadline - time.monotonic()
            if left <= 0:
                raise DaemonUnavailableError(
                    f"the gpushare node at {connector.where} stayed busy for {timeout:g} s"
                    f" ({e}): try again, or attach with a longer timeout="
                ) from None
            _sleep(min(delay * random.uniform(0.5, 1.5), left))
            delay = min(delay * 2, HELLO_BUSY_BACKOFF[1])


class _Busy(Exception):
    """The node has as many connections waiting for a hello as it allows."""


def _handshake(
    connector: Connector, hello: p.Hello, deadline: float, timeout: float
) -> tuple[_socket.socket, p.Welcome, list[p.Message]]:
    try:
        sock = connector(timeout)
    except OSError as e:
        raise DaemonUnavailableError(
            f"cannot reach the gpushare node at {connector.where} ({e.strerror or e}): {_FIX}"
        ) from None
    try:
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        sock.sendall(p.encode(hello))
        buf = p.FrameBuffer()
        msgs: list[p.Message] = []
        while not msgs:
            data = sock.recv(65536)
            if not data:
                raise p.ProtocolError("the node closed the connection")
            msgs = buf.feed(data)
        first = msgs[0]
        if isinstance(first, p.Error) and first.code == "busy":
            sock.close()
            raise _Busy(first.message)
        if isinstance(first, p.Error):
            raise AttachRefusedError(first.message, first.code)
        if not isinstance(first, p.Welcome):
            raise p.ProtocolError(f"unexpected first answer from the node: {type(first).__name__}")
        sock.settimeout(None)
        return sock, first, msgs[1:]
    except (OSError, p.ProtocolError) as e:
        sock.close()
        raise DaemonUnavailableError(
            f"cannot reach the gpushare node at {connector.where}"
            f" ({getattr(e, 'strerror', None) or e}): {_FIX}"
        ) from None
    except BaseException:
        sock.close()
        raise


class Peer(Protocol):
    """What the transport tells the session's lease. All but :meth:`on_message` are
    called with the shared condition held."""

    def on_message(self, msg: p.Message) -> None:
        """A message from the node (not an error), on the reader thread, unlocked."""

    def on_link_change(self) -> None:
        """The link left CONNECTED (away, ended, closed)."""

    def resume_hello(self, hello: p.Hello) -> p.Hello:
        """The hello that re-registers the session with a node that came back."""

    def on_reconnected(self, hello: p.Hello) -> None:
        """A new connection is up (``hello`` was said on it): say what it must know."""


class Transport:
    """The connection of one session; see the module's docstring."""

    def __init__(
        self,
        sock: _socket.socket,
        session: int,
        connector: Connector,
        hello: p.Hello,
        cond: threading.Condition,
        peer: Peer,
        on_ended: Ended | None = None,
    ) -> None:
        self.cond = cond
        self.peer = peer  # the session's lease, told what comes
        self.state = Link.CONNECTED
        self.reason = ""  # why the link is away or ended
        self.away_since = 0.0
        self.generation = 0  # connections so far: a new one has not heard earlier requests
        self.session = session  # the node's id for it (a new one at each reconnect)
        self.received = 0  # messages handled (tests wait on it)
        self.backoff = RECONNECT_BACKOFF
        self.reconnect_timeout = RECONNECT_TIMEOUT
        self._sock = sock
        self._connector = connector
        self._hello = hello
        self._send_lock = threading.Lock()
        self._reading = False  # the reader has taken bytes it has not handled yet
        self._catching_up = 0  # threads in catch_up(): the reader wakes them
        self._reader = threading.Thread(target=self._run, name="gpushare-reader", daemon=True)
        self._first: list[p.Message] = []
        # Called on the reader thread, unlocked, once the node ended the session for good
        # (`ctl end`, a refusal on reconnecting; grace 0), or said it ends it in a grace
        # (`ctl end --grace`): `gpushare run` stops its program there.
        self.on_ended = on_ended
        self.ending: p.Ending | None = None  # the node ends this session soon

    def start(self, first: Iterable[p.Message] = ()) -> None:
        """Start the reader thread; it handles ``first`` (what came with the welcome)
        before anything it reads, in order."""
        self._first = list(first)
        self._reader.start()

    # --- sending --------------------------------------------------------------------

    def send(self, msg: p.Message) -> bool:
        """Send, or drop when the node is away (False): a reconnection re-registers what
        matters (memory, lease) and the peer makes its requests again."""
        data = p.encode(msg)
        with self._send_lock:
            if self.state is not Link.CONNECTED:
                return False
            try:
                self._sock.sendall(data)
            except OSError:
                return False  # the reader thread sees the end and reconnects
            return True

    # --- for the peer (condition held) ----------------------------------------------

    def catch_up(self, timeout: float = 5.0) -> None:
        """Wait until the reader thread has handled what the node has sent so far (a
        grant that crossed a revoke, say). Condition held; a system call: slow path only."""
        if threading.current_thread() is self._reader:
            return
        deadline = time.monotonic() + timeout
        poller = select.poll()
        with contextlib.suppress(OSError, ValueError):
            poller.register(self._sock, select.POLLIN)
        # Bytes in the socket first, then the reader's flag: it is set before the reader
        # takes bytes, so no message slips between the two looks.
        self._catching_up += 1
        try:
            while self.state is Link.CONNECTED and (poller.poll(0) or self._reading):
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self.cond.wait(min(left, 0.05))
        finally:
            self._catching_up -= 1

    def end(self, state: Link, reason: str) -> None:
        """Mark the link ended or closed (condition held); closing also ends an ended one."""
        if self.state in LIVE or (state is Link.CLOSED and self.state is Link.ENDED):
            self.state, self.reason = state, reason
            self.peer.on_link_change()
            self.cond.notify_all()

    # --- ending ---------------------------------------------------------------------

    def shut(self) -> None:
        """After :meth:`end` with CLOSED: wakes the reader thread and waits for it."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(_socket.SHUT_RDWR)
        if self._reader.is_alive() and self._reader is not threading.current_thread():
            self._reader.join(timeout=5)
        self._sock.close()

    def forked(self) -> None:
        """In a forked child: no lock is taken (another thread may have held it at the
        fork); the reader thread does not exist here."""
        self.state = Link.FORKED

    def close_fd(self) -> None:
        """A forked child's close: its copy of the socket only (the parent keeps its own)."""
        with contextlib.suppress(OSError):
            self._sock.close()

    # --- the reader thread ----------------------------------------------------------

    def _run(self) -> None:
        self._dispatch(self._first)
        self._first = []
        while True:
            reason = self._read(self._sock)
            with self.cond:
                self._reading = False
                self.cond.notify_all()
                if self.state is not Link.CONNECTED:  # closed, forked, ended: stay down
                    return
                self.state, self.reason = Link.AWAY, reason
                self.away_since = time.monotonic()
                self.peer.on_link_change()
                self.cond.notify_all()  # a swap-in waiting for room stops now
            log.warning("gpushare node went away (%s): reconnecting", reason)
            if not self._reconnect():
                return

    def _read(self, sock: _socket.socket) -> str:
        buf = p.FrameBuffer()
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        try:
            while True:
                poller.poll()
                self._reading = True  # before the bytes leave the socket: see catch_up
                data = sock.recv(65536)
                if not data:
                    return "connection closed by the node"
                self._dispatch(buf.feed(data))
                self._reading = False
                if self._catching_up:  # read after the flag is cleared: see catch_up
                    with self.cond:
                        self.cond.notify_all()
        except (OSError, ValueError, p.ProtocolError) as e:
            return str(e) or type(e).__name__

    def _dispatch(self, msgs: Iterable[p.Message]) -> None:
        for msg in msgs:
            if isinstance(msg, p.Error):
                self._on_error(msg)
            elif isinstance(msg, p.Ending):
                self._on_ending(msg)
            else:
                self.peer.on_message(msg)
            self.received += 1

    def _on_ending(self, msg: p.Ending) -> None:
        """The session ends in a grace: the program told (its shutdown may finish what is
        in flight, with its turns as usual), or, with no one to tell, said once."""
        self.ending = msg
        if self.on_ended is not None:
            self.on_ended(msg.reason, msg.grace_s)
        else:
            log.warning("gpushare node: %s: this session ends in %g s", msg.reason, msg.grace_s)

    def _on_error(self, msg: p.Error) -> None:
        if not (msg.code in FATAL and self.on_ended is not None):  # else on_ended says it
            log.error("gpushare node: %s", msg.message)
        if msg.code in FATAL:  # the node is ending this session: do not come back
            if self.on_ended is not None and self.state is Link.CONNECTED:
                # First, before a thread waiting on the lease wakes to an error: the
                # program is stopped, not left to fail in the middle of a step.
                self.on_ended(msg.message, 0.0)
            with self.cond:
                if self.state is Link.CONNECTED:
                    self.end(Link.ENDED, msg.message)

    def _reconnect(self) -> bool:
        """Until connected again (True), or closed or refused for good (False)."""
        delay = self.backoff[0]
        while True:
            with self.cond:
                if self.state is not Link.AWAY:
                    return False
                hello = self.peer.resume_hello(self._hello)
            try:
                sock, welcome, rest = open_connection(
                    self._connector, hello, self.reconnect_timeout
                )
            except AttachRefusedError as e:
                if self.on_ended is not None:  # first, as above
                    self.on_ended(f"refused on reconnecting: {e}", 0.0)
                with self.cond:
                    self.end(Link.ENDED, f"refused on reconnecting: {e}")
                log.error("gpushare node refused this session on reconnecting: %s", e)
                return False
            except DaemonUnavailableError:
                with self.cond:  # close() wakes this wait
                    self._pause(delay)
                delay = min(delay * 2, self.backoff[1])
                continue
            with self.cond:
                if self.state is not Link.AWAY:  # closed meanwhile
                    sock.close()
                    return False
                with self._send_lock:
                    old, self._sock = self._sock, sock
                self.session = welcome.session
                self.generation += 1
                self.state, self.reason = Link.CONNECTED, ""
                self.peer.on_reconnected(hello)
                self.cond.notify_all()
            with contextlib.suppress(OSError):
                old.close()
            log.warning("reconnected to the gpushare node as session %d", welcome.session)
            self._dispatch(rest)
            return True

    def _pause(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while self.state is Link.AWAY and (left := deadline - time.monotonic()) > 0:
            self.cond.wait(left)

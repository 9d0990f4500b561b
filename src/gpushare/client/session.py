"""The client runtime inside each workload: small, synchronous, thread- and fork-safe.

A reader thread receives the daemon's messages. A revoke only sets a flag, which
:meth:`Session.checkpoint` reads with no system call; swap-outs asked of an idle or
waiting session are done by the reader thread itself, while the workload's own threads
go on with CPU work. When the node goes away, the reader thread reconnects with backoff
and re-registers the session's memory (and its lease, mid-burst); meanwhile a burst in
progress goes on and a new one waits, up to ``reconnect_timeout``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket as _socket
import sys
import threading
import time
import weakref
from collections.abc import Iterator

import msgspec

from gpushare import protocol as p
from gpushare.client.env import read_env
from gpushare.client.swap.base import SwapBackend
from gpushare.client.swap.sim import SimBackend
from gpushare.errors import DaemonUnavailableError, GpushareError, SwapError
from gpushare.units import parse_size

log = logging.getLogger("gpushare.client.session")
# Error codes after which the node closes the session for good (no reconnecting).
_FATAL = frozenset({"ended", "protocol", "denied", "rate", "limit"})
_sessions: weakref.WeakSet[Session] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for s in list(_sessions):
        s._forked = True


os.register_at_fork(after_in_child=_after_fork_in_child)


def attach(
    memory: str | int | None = None,
    *,
    socket: str | None = None,
    gpu: int | None = None,
    name: str | None = None,
    weight: float | None = None,
    backend: str | None = None,
    timeout: float = 10.0,
    reconnect_timeout: float | None = None,
) -> Session:
    """Attach this process to a GPU through the node daemon; returns a :class:`Session`.

    ``memory`` (``"20GiB"``, bytes) is the most GPU memory the session may use; without
    it ``GPUSHARE_MEMORY``, then KAI's ``GPU_PORTION`` of the GPU, then the whole GPU.
    ``reconnect_timeout`` (default ``GPUSHARE_RECONNECT_TIMEOUT``, else 60 s) bounds how
    long a new burst waits for a node that went away.
    """
    env = read_env()
    path = socket or env.socket
    limit = parse_size(memory) if memory is not None else env.memory
    hello = p.Hello(
        version=p.PROTOCOL_VERSION,
        name=name or f"{os.path.basename(sys.argv[0]) or 'python'}-{os.getpid()}",
        memory_limit=limit,
        weight=weight if weight is not None else env.portion,
        portion=env.portion if limit is None else None,
        gpu=gpu if gpu is not None else env.gpu,
        gpu_uuid=env.gpu_uuid if gpu is None else "",
        backend=backend or "",
        pod=env.pod,
        namespace=env.namespace,
        container=env.container,
        pod_uid=env.pod_uid,
        fills=True,
    )
    try:
        sock, welcome, rest = _handshake(path, hello, timeout)
    except FileNotFoundError as e:
        raise DaemonUnavailableError(
            f"cannot reach the gpushare node at {path} ({e.strerror}): start it with"
            " 'gpushare node' or point GPUSHARE_SOCKET at its socket"
        ) from None
    except (OSError, p.ProtocolError) as e:
        raise DaemonUnavailableError(
            f"cannot reach the gpushare node at {path} ({getattr(e, 'strerror', None) or e}):"
            " start it with 'gpushare node' or point GPUSHARE_SOCKET at its socket"
        ) from None
    if reconnect_timeout is None:
        reconnect_timeout = float(os.environ.get("GPUSHARE_RECONNECT_TIMEOUT") or 60.0)
    try:
        swap = _make_backend(backend, welcome)
    except BaseException:
        sock.close()  # the node counts the session gone
        raise
    s = Session(sock, welcome, swap, path, hello, reconnect_timeout)
    for msg in rest:
        s._handle(msg)
    return s


class _Refused(GpushareError):
    def __init__(self, err: p.Error) -> None:
        super().__init__(err.message)
        self.code = err.code


def _handshake(
    path: str, hello: p.Hello, timeout: float
) -> tuple[_socket.socket, p.Welcome, list[p.Message]]:
    """Connect, say hello, read the welcome; returns what followed it too."""
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(path)
        sock.sendall(p.encode(hello))
        buf = p.FrameBuffer()
        msgs: list[p.Message] = []
        while not msgs:
            data = sock.recv(65536)
            if not data:
                raise p.ProtocolError("the node closed the connection")
            msgs = buf.feed(data)
        first = msgs[0]
        if isinstance(first, p.Error):
            raise _Refused(first)
        if not isinstance(first, p.Welcome):
            raise p.ProtocolError(f"unexpected first answer from the node: {type(first)}")
        sock.settimeout(None)
        return sock, first, msgs[1:]
    except BaseException:
        sock.close()
        raise


def _make_backend(name: str | None, w: p.Welcome) -> SwapBackend:
    """``sim`` for a simulated GPU, ``torch`` for a real one, unless asked otherwise."""
    name = name or ("sim" if w.simulated else "torch")
    if name == "sim":
        if not w.simulated:
            raise GpushareError(
                f"GPU {w.gpu} ({w.gpu_name}) is a real GPU and the sim backend only serves"
                " simulated ones: use backend='torch' (the default on real GPUs)"
            )
        return SimBackend(
            w.memory_limit,
            scale=w.sim_scale,
            bandwidth=w.sim_bandwidth,
            failure_rate=w.sim_swap_failure_rate,
            link=w.sim_link,
        )
    if name == "torch":
        if w.simulated:
            raise GpushareError(
                f"GPU {w.gpu} is simulated and the torch backend needs a real one:"
                " use backend='sim' (the default on simulated GPUs)"
            )
        from gpushare.client.swap.torch import TorchBackend  # imports PyTorch: only when needed

        return TorchBackend(w.memory_limit, gpu_uuid=w.gpu_uuid, gpu_index=w.gpu)
    raise GpushareError(f"unknown swap backend {name!r}: choose 'torch' or 'sim'")


class Session:
    """One workload process attached to one GPU. See :func:`attach`."""

    def __init__(
        self,
        sock: _socket.socket,
        welcome: p.Welcome,
        backend: SwapBackend,
        path: str = "",
        hello: p.Hello | None = None,
        reconnect_timeout: float = 60.0,
    ) -> None:
        self.id = welcome.session
        self.name = welcome.name
        self.gpu_index = welcome.gpu
        self.gpu_name = welcome.gpu_name
        self.simulated = welcome.simulated
        self.memory_limit = welcome.memory_limit
        self.weight = welcome.weight
        self.idle_release_s = welcome.idle_release_s
        self.backend = backend
        backend.on_change = self._report
        backend.check_access = self._check_access
        backend.wait_room = self._wait_room
        self._sock = sock
        self._path = path
        self._hello = hello or p.Hello(version=p.PROTOCOL_VERSION)
        self.reconnect_timeout = reconnect_timeout
        self._generation = 0  # connections so far: a new one needs requests made again
        self._away_since = 0.0
        self._fatal = False  # the node ended this session: no reconnecting
        self._send_lock = threading.Lock()
        self._cond = threading.Condition()
        self._pid = os.getpid()
        self._forked = False
        self._closed = False
        self._gone: str = ""
        self._depth = 0  # threads inside gpu()
        self._implicit = False  # a burst opened by checkpoint() outside gpu()
        self._last_work = 0.0
        self._busy = 0  # threads inside working(): no release for idleness meanwhile
        self._acquiring = False
        self._holding = False
        self._lease = 0
        self._grant: p.Grant | None = None
        self._room = 0  # while swapping in: the most it may have on the GPU (0: no bound)
        self._swap_gen = 0  # the connection whose grant the swap-in in progress follows
        self._revoked = False  # read without a lock by checkpoint()
        self._revoke: p.Revoke | None = None
        self.bursts = 0  # bursts opened by this process
        self.grants = 0  # leases received: a change means others may have run in between
        self.waits: list[float] = []  # seconds from asking to holding, per grant
        self._reader = threading.Thread(target=self._read_loop, name="gpushare-reader", daemon=True)
        self._reader.start()
        self._idle_thread: threading.Thread | None = None
        _sessions.add(self)

    # --- public ---------------------------------------------------------------------

    @contextlib.contextmanager
    def gpu(self) -> Iterator[Session]:
        """A burst: blocks until the lease is granted (swapping in first), releases at exit."""
        with self._cond:
            self._usable()
            self._depth += 1
            try:
                if not self._holding:
                    self._implicit = False
                    self._acquire_locked()
            except BaseException:
                self._depth -= 1
                raise
        try:
            yield self
        finally:
            with self._cond:
                self._depth -= 1
                if self._depth == 0 and self._holding:
                    self._release_locked(again=False)

    def checkpoint(self) -> None:
        """A safe point: yields here if the lease was revoked, then waits for the next turn.

        Outside :meth:`gpu`, a checkpoint opens a burst itself, which ends after
        ``idle_release`` seconds without another checkpoint.
        """
        self._last_work = time.monotonic()
        if self._revoked or not self._holding:
            self._checkpoint_slow()

    @contextlib.contextmanager
    def working(self) -> Iterator[Session]:
        """GPU work with no safe point inside (a backward pass, say): a checkpoint at its
        start, and, while it runs, an implicit burst is not ended for idleness."""
        self.checkpoint()
        self.begin_work()
        try:
            yield self
        finally:
            self.end_work()

    def begin_work(self) -> None:
        """:meth:`working` in two calls, for hooks that see a start and an end."""
        with self._cond:
            self._busy += 1

    def end_work(self) -> None:
        with self._cond:
            self._busy -= 1
            self._last_work = time.monotonic()
            self._cond.notify_all()

    def close(self) -> None:
        """Release any lease and detach; the session's memory is freed."""
        if self._forked:
            with contextlib.suppress(OSError):
                self._sock.close()
            return
        with self._cond:
            if self._closed:
                return
            if self._holding and not self._gone:
                with contextlib.suppress(GpushareError, OSError):
                    self._release_locked(again=False)
            self._closed = True
            self._cond.notify_all()
        with contextlib.suppress(OSError):
            self._sock.shutdown(_socket.SHUT_RDWR)
        self._sock.close()
        if self._reader is not threading.current_thread():
            self._reader.join(timeout=5)
        self.backend.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def holding(self) -> bool:
        return self._holding

    # --- the lease ------------------------------------------------------------------

    def _usable(self) -> None:
        if self._forked:
            raise GpushareError(
                f"this session belongs to process {self._pid}: call gpushare.attach() in the child"
            )
        if self._closed:
            raise GpushareError("session is closed")
        if self._gone:  # wait for the reader thread to reconnect, up to the timeout
            deadline = self._away_since + self.reconnect_timeout
            while self._gone and not self._fatal and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DaemonUnavailableError(
                        f"the gpushare node has been away for {self.reconnect_timeout:g} s"
                        f" ({self._gone}); set GPUSHARE_RECONNECT_TIMEOUT to wait longer"
                    )
                self._cond.wait(left)
            if self._fatal:
                raise DaemonUnavailableError(f"the gpushare node ended this session: {self._gone}")
            if self._closed:
                raise GpushareError("session is closed")

    def _acquire_locked(self) -> None:
        if self._acquiring:  # another thread is asking: wait for its answer
            while self._acquiring:
                self._cond.wait()
                self._usable()
            return
        self._acquiring = True
        self.bursts += 1
        t0 = time.monotonic()
        self._grant = None
        self._send(p.Acquire())
        self._wait_for_grant(t0)

    def _wait_for_grant(self, t0: float) -> None:
        """Wait for the grant asked for (``_acquiring`` set); withdraw if interrupted."""
        try:
            self._await_grant(t0)
        except BaseException:
            self._cancel_wait()
            raise
        finally:
            self._acquiring = False
            self._cond.notify_all()

    def _cancel_wait(self) -> None:
        # Interrupted while waiting (Ctrl-C, an error): withdraw from the queue, or give
        # back a grant that crossed the withdrawal; a grant arriving later is ignored.
        self._grant = None
        if not self._gone and not self._holding:
            with contextlib.suppress(GpushareError, OSError):
                self._send(
                    p.Release(
                        resident=self.backend.resident_bytes, swapped=self.backend.swapped_bytes
                    )
                )

    def _await_grant(self, t0: float) -> None:
        gen = self._generation
        while True:
            while self._grant is None:
                self._usable()
                if self._generation != gen:  # a new node: it has not heard us ask
                    gen = self._generation
                    self._send(p.Acquire())
                self._cond.wait()
            g, self._grant = self._grant, None
            self._swap_gen = self._generation
            try:
                if g.swap_in or self.backend.swapped_bytes:
                    self._swap("in", 0)
                # Work may grow the session to its limit: not before the node has room.
                self._wait_room(self.memory_limit)
            except SwapError:
                if not (self._gone or self._generation != self._swap_gen):
                    raise
                continue  # the node went away mid swap-in: ask the next one, go on
            break
        self.waits.append(time.monotonic() - t0)
        self.grants += 1
        self._holding = True

    def _release_locked(self, again: bool) -> None:
        rev, self._revoke = self._revoke, None
        self._revoked = False
        self._holding = False
        swap_out = rev.swap_out if rev is not None and rev.lease == self._lease else 0
        if swap_out:
            # The GPU work is done before the lease goes; the swap-out comes after the
            # release, reported chunk by chunk, so the next holder swaps in meanwhile.
            self.backend.synchronize()
        self._lease = 0
        self._send(
            p.Release(
                resident=self.backend.resident_bytes,
                swapped=self.backend.swapped_bytes,
                again=again,
                swapping_out=swap_out,
            )
        )
        if swap_out:
            try:
                self._swap("out", swap_out)
            except SwapError as e:
                log.error("swap-out asked by the revoke failed: %s", e)

    def _checkpoint_slow(self) -> None:
        with self._cond:
            self._usable()
            if self._revoked and self._holding:
                self.backend.synchronize()
                t0 = time.monotonic()
                self._grant = None
                self._acquiring = True
                self._release_locked(again=True)
                self._wait_for_grant(t0)
            elif not self._holding:
                if self._depth == 0:
                    self._implicit = True
                    self._acquire_locked()
                    self._start_idle_thread()
                else:  # another thread of this burst is yielding: wait for the new grant
                    while not self._holding:
                        self._usable()
                        self._cond.wait()

    def _start_idle_thread(self) -> None:
        if self._idle_thread is None:
            self._idle_thread = threading.Thread(
                target=self._idle_loop, name="gpushare-idle", daemon=True
            )
            self._idle_thread.start()
        else:
            self._cond.notify_all()

    def _idle_loop(self) -> None:
        # Ends implicit bursts after idle_release seconds without a checkpoint.
        with self._cond:
            while not (self._closed or self._fatal or self._forked):
                if not (self._implicit and self._holding and self._depth == 0 and not self._busy):
                    self._cond.wait()
                    continue
                idle = time.monotonic() - self._last_work
                if idle >= self.idle_release_s:
                    self._implicit = False
                    with contextlib.suppress(GpushareError, OSError):
                        self._release_locked(again=False)
                else:
                    self._cond.wait(self.idle_release_s - idle)

    def _set_room(self, room: int) -> None:
        self._room = room if room < self.memory_limit else 0  # its limit: no bound

    def _wait_room(self, resident: int) -> None:
        # Called by the backend's swap-in, under self._cond (from _await_grant): waiting
        # releases it, so the reader thread can deliver the Room that ends the wait.
        while self._room and resident > self._room:
            if self._gone or self._closed or self._generation != self._swap_gen:
                raise SwapError(
                    "the gpushare node went away during this session's swap-in: try again"
                )
            self._cond.wait()

    def _check_access(self) -> None:
        if not self._holding:
            raise GpushareError(
                "GPU memory used outside a lease: do GPU work inside 'with session.gpu():'"
            )

    # --- messages -------------------------------------------------------------------

    def _send(self, msg: p.Message) -> None:
        """Send, or drop when the node is away: a reconnection re-registers the state
        that matters (memory, lease) and requests are made again."""
        data = p.encode(msg)
        with self._send_lock, contextlib.suppress(OSError):
            self._sock.sendall(data)

    def _report(self) -> None:
        with contextlib.suppress(DaemonUnavailableError):
            self._send(
                p.Report(resident=self.backend.resident_bytes, swapped=self.backend.swapped_bytes)
            )

    def _swap(self, direction: str, nbytes: int) -> None:
        try:
            r = self.backend.swap_in() if direction == "in" else self.backend.swap_out(nbytes)
        except SwapError as e:
            self._send(
                p.SwapDone(
                    direction="in" if direction == "in" else "out",
                    bytes=0,
                    seconds=0.0,
                    resident=self.backend.resident_bytes,
                    swapped=self.backend.swapped_bytes,
                    error=str(e),
                )
            )
            raise
        self._send(
            p.SwapDone(
                direction="in" if direction == "in" else "out",
                bytes=r.bytes,
                seconds=r.seconds,
                resident=self.backend.resident_bytes,
                swapped=self.backend.swapped_bytes,
            )
        )

    def _read_loop(self) -> None:
        while True:
            reason = self._read_until_closed(self._sock)
            with self._cond:
                if self._closed or self._forked:
                    return
                self._gone = self._gone or reason
                self._away_since = time.monotonic()
                self._cond.notify_all()
                if self._fatal:
                    return
            log.warning("gpushare node went away (%s): reconnecting", reason)
            if not self._reconnect():
                return

    def _read_until_closed(self, sock: _socket.socket) -> str:
        buf = p.FrameBuffer()
        try:
            while True:
                data = sock.recv(65536)
                if not data:
                    return "connection closed by the node"
                for msg in buf.feed(data):
                    self._handle(msg)
        except (OSError, p.ProtocolError) as e:
            return str(e)

    def _reconnect(self) -> bool:
        """Until connected again (True) or closed or refused for good (False)."""
        delay = 0.05
        while not (self._closed or self._forked):
            with self._cond:  # what this session has now, for the new node
                hello = msgspec.structs.replace(
                    self._hello,
                    memory_limit=self.memory_limit,
                    weight=self.weight,
                    portion=None,
                    gpu=self.gpu_index,
                    resident=self.backend.resident_bytes,
                    swapped=self.backend.swapped_bytes,
                    holding=self._holding,
                )
            try:
                sock, welcome, rest = _handshake(self._path, hello, 10.0)
            except _Refused as e:
                with self._cond:
                    self._gone, self._fatal = f"refused on reconnecting: {e}", True
                    self._cond.notify_all()
                log.error("gpushare node refused this session on reconnecting: %s", e)
                return False
            except (OSError, p.ProtocolError):
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
                continue
            with self._cond:
                old, self._sock = self._sock, sock
                self.id = welcome.session
                self._lease = 0
                self._revoked, self._revoke = False, None
                self._generation += 1
                self._gone = ""
                self._cond.notify_all()
            with contextlib.suppress(OSError):
                old.close()
            log.warning("reconnected to the gpushare node as session %d", self.id)
            for msg in rest:
                self._handle(msg)
            return True
        return False

    def _handle(self, msg: p.Message) -> None:
        if isinstance(msg, p.Grant):
            with self._cond:
                if self._acquiring:  # else it crossed a withdrawal, already released
                    self._lease = msg.lease
                    self._set_room(msg.room)
                    self._grant = msg
                elif self._holding:  # thawed, or resumed after a node restart: a new lease
                    self._lease = msg.lease
                    self._revoked, self._revoke = False, None
                self._cond.notify_all()
        elif isinstance(msg, p.Room):
            with self._cond:
                self._set_room(msg.room)
                self._cond.notify_all()
        elif isinstance(msg, p.Revoke):
            if msg.lease == self._lease:
                self._revoke = msg
                self._revoked = True
                with self._cond:
                    self._cond.notify_all()
        elif isinstance(msg, p.SwapOut):
            # Under the lock: never while this session's own threads touch its memory.
            with self._cond, contextlib.suppress(SwapError, DaemonUnavailableError):
                if self._holding:  # a holder's memory is not for taking: re-plan
                    self._send(
                        p.SwapDone(
                            direction="out",
                            bytes=0,
                            seconds=0.0,
                            resident=self.backend.resident_bytes,
                            swapped=self.backend.swapped_bytes,
                            error="session holds the GPU",
                        )
                    )
                else:
                    self._swap("out", msg.bytes)
        elif isinstance(msg, p.Error):
            log.error("gpushare node: %s", msg.message)
            if msg.code in _FATAL:  # the node is ending this session: do not come back
                with self._cond:
                    self._gone, self._fatal = msg.message, True
                    self._cond.notify_all()

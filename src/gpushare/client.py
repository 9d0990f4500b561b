"""The client runtime inside each workload: small, synchronous, thread- and fork-safe.

A reader thread receives the daemon's messages. A revoke only sets a flag, which
:meth:`Session.checkpoint` reads with no system call; swap-outs asked of an idle or
waiting session are done by the reader thread itself, while the workload's own threads
go on with CPU work.
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

from gpushare import protocol as p
from gpushare.env import read_env
from gpushare.errors import DaemonUnavailableError, GpushareError, SwapError
from gpushare.swap.base import SwapBackend
from gpushare.swap.sim import SimBackend
from gpushare.units import parse_size

log = logging.getLogger("gpushare.client")
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
) -> Session:
    """Attach this process to a GPU through the node daemon; returns a :class:`Session`.

    ``memory`` (``"20GiB"``, bytes) is the most GPU memory the session may use; without
    it ``GPUSHARE_MEMORY``, then KAI's ``GPU_PORTION`` of the GPU, then the whole GPU.
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
        backend=backend or "",
        pod=env.pod,
        namespace=env.namespace,
        container=env.container,
        pod_uid=env.pod_uid,
    )
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
    except OSError as e:
        sock.close()
        raise DaemonUnavailableError(
            f"cannot reach the gpushare node at {path} ({e.strerror or e}): start it with"
            " 'gpushare node' or point GPUSHARE_SOCKET at its socket"
        ) from None
    try:
        sock.sendall(p.encode(hello))
        welcome = _read_one(sock)
    except (OSError, p.ProtocolError) as e:
        sock.close()
        raise DaemonUnavailableError(f"gpushare node at {path} did not answer: {e}") from None
    if isinstance(welcome, p.Error):
        sock.close()
        raise GpushareError(welcome.message)
    if not isinstance(welcome, p.Welcome):
        sock.close()
        raise DaemonUnavailableError(f"unexpected first answer from the node: {type(welcome)}")
    sock.settimeout(None)
    return Session(sock, welcome, _make_backend(backend, welcome))


def _read_one(sock: _socket.socket) -> p.Message:
    buf = p.FrameBuffer()
    while True:
        data = sock.recv(65536)
        if not data:
            raise p.ProtocolError("connection closed")
        msgs = buf.feed(data)
        if msgs:
            return msgs[0]


def _make_backend(name: str | None, w: p.Welcome) -> SwapBackend:
    if name in (None, "", "sim"):
        if not w.simulated:
            raise GpushareError(
                f"GPU {w.gpu} ({w.gpu_name}) is a real GPU and the sim backend only serves"
                " simulated ones: the torch backend is needed for real GPUs"
            )
        return SimBackend(w.memory_limit, scale=w.sim_scale, bandwidth=w.sim_bandwidth)
    raise GpushareError(f"unknown swap backend {name!r}: choose 'sim'")


class Session:
    """One workload process attached to one GPU. See :func:`attach`."""

    def __init__(self, sock: _socket.socket, welcome: p.Welcome, backend: SwapBackend) -> None:
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
        self._sock = sock
        self._send_lock = threading.Lock()
        self._cond = threading.Condition()
        self._pid = os.getpid()
        self._forked = False
        self._closed = False
        self._gone: str = ""
        self._depth = 0  # threads inside gpu()
        self._implicit = False  # a burst opened by checkpoint() outside gpu()
        self._last_work = 0.0
        self._acquiring = False
        self._holding = False
        self._lease = 0
        self._grant: p.Grant | None = None
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
                if self._depth == 0 and self._holding and not self._gone:
                    self._release_locked(again=False)

    def checkpoint(self) -> None:
        """A safe point: yields here if the lease was revoked, then waits for the next turn.

        Outside :meth:`gpu`, a checkpoint opens a burst itself, which ends after
        ``idle_release`` seconds without another checkpoint.
        """
        self._last_work = time.monotonic()
        if self._revoked or not self._holding:
            self._checkpoint_slow()

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
        if self._gone:
            raise DaemonUnavailableError(f"gpushare node went away: {self._gone}")

    def _acquire_locked(self) -> None:
        if self._acquiring:  # another thread is asking: wait for its answer
            while self._acquiring:
                self._cond.wait()
                self._usable()
            return
        self._acquiring = True
        try:
            self.bursts += 1
            t0 = time.monotonic()
            self._grant = None
            self._send(p.Acquire())
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
        while self._grant is None:
            self._usable()
            self._cond.wait()
        g, self._grant = self._grant, None
        self.waits.append(time.monotonic() - t0)
        self.grants += 1
        if g.swap_in or self.backend.swapped_bytes:
            self._swap("in", 0)
        self._holding = True

    def _release_locked(self, again: bool) -> None:
        out, secs = 0, 0.0
        rev, self._revoke = self._revoke, None
        self._revoked = False
        self._holding = False
        if rev is not None and rev.lease == self._lease and rev.swap_out:
            self.backend.synchronize()
            try:
                r = self.backend.swap_out(rev.swap_out)
                out, secs = r.bytes, r.seconds
            except SwapError as e:
                log.error("swap-out asked by the revoke failed: %s", e)
        self._lease = 0
        self._send(
            p.Release(
                resident=self.backend.resident_bytes,
                swapped=self.backend.swapped_bytes,
                again=again,
                swapped_out=out,
                seconds=secs,
            )
        )

    def _checkpoint_slow(self) -> None:
        with self._cond:
            self._usable()
            if self._revoked and self._holding:
                self.backend.synchronize()
                t0 = time.monotonic()
                self._grant = None
                self._acquiring = True
                self._release_locked(again=True)
                try:
                    self._await_grant(t0)
                except BaseException:
                    self._cancel_wait()
                    raise
                finally:
                    self._acquiring = False
                    self._cond.notify_all()
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
            while not (self._closed or self._gone or self._forked):
                if not (self._implicit and self._holding and self._depth == 0):
                    self._cond.wait()
                    continue
                idle = time.monotonic() - self._last_work
                if idle >= self.idle_release_s:
                    self._implicit = False
                    with contextlib.suppress(GpushareError, OSError):
                        self._release_locked(again=False)
                else:
                    self._cond.wait(self.idle_release_s - idle)

    def _check_access(self) -> None:
        if not self._holding:
            raise GpushareError(
                "GPU memory used outside a lease: do GPU work inside 'with session.gpu():'"
            )

    # --- messages -------------------------------------------------------------------

    def _send(self, msg: p.Message) -> None:
        data = p.encode(msg)
        with self._send_lock:
            try:
                self._sock.sendall(data)
            except OSError as e:
                self._gone = self._gone or f"send failed: {e}"
                raise DaemonUnavailableError(f"gpushare node went away: {e}") from None

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
        buf = p.FrameBuffer()
        reason = "connection closed by the node"
        try:
            while True:
                data = self._sock.recv(65536)
                if not data:
                    break
                for msg in buf.feed(data):
                    self._handle(msg)
        except (OSError, p.ProtocolError) as e:
            reason = str(e)
        with self._cond:
            if not self._closed:
                self._gone = reason
            self._cond.notify_all()

    def _handle(self, msg: p.Message) -> None:
        if isinstance(msg, p.Grant):
            with self._cond:
                if self._acquiring:  # else it crossed a withdrawal, already released
                    self._lease = msg.lease
                    self._grant = msg
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

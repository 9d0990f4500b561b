"""The client runtime inside each workload: small, synchronous, thread- and fork-safe.

:func:`attach` connects and says hello; :class:`Session` is the public face of two parts:
the connection (:mod:`gpushare.client.transport`: socket, reader thread, reconnecting)
and the lease (:mod:`gpushare.client.lease`: the state machine of asking, swapping in,
holding and yielding). The lease builds the connection and the swap backend, each
given at construction what it tells (the lease as the connection's peer; its hooks, to
report memory, check access and wait for room, as the backend's), so neither runs a
moment half wired. A revoke only clears the flag :meth:`Session.checkpoint` reads
with no lock and no system call; swap-outs asked of an idle or waiting session are done
by the reader thread, while the workload's own threads go on with CPU work. When the
node goes away, the reader thread reconnects with backoff and re-registers the session's
memory (and its lease, mid-burst); meanwhile a burst in progress goes on and a new one
waits, up to ``reconnect_timeout``.
"""

from __future__ import annotations

import contextlib
import os
import socket as _socket
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from gpushare import protocol as p
from gpushare.client.env import compute_limit_of, memory_figures, program_name, read_env
from gpushare.client.launchers import gang_fields
from gpushare.client.lease import Lease
from gpushare.client.swap.base import SwapBackend, SwapHooks
from gpushare.client.swap.sim import SimBackend
from gpushare.client.swap.vmm import Discardable
from gpushare.client.transport import (
    Connector,
    Ended,
    Link,
    Peer,
    Transport,
    UnixConnector,
    open_connection,
)
from gpushare.errors import GpushareError
from gpushare.units import parse_size

_sessions: weakref.WeakSet[Session] = weakref.WeakSet()
_now = time.monotonic


def _after_fork_in_child() -> None:
    for s in list(_sessions):
        s._lease.forked()


os.register_at_fork(after_in_child=_after_fork_in_child)


def discardable(tensor: Any) -> Discardable:
    """Mark a CUDA tensor's memory as a cache this workload can rebuild (a server's KV
    cache): when the node takes memory back it is dropped rather than copied to host
    memory, and it comes back zeroed at the next grant; the mark's ``drops`` grows each
    time it was dropped (rebuild it then). For the torch backend (a real GPU); where no
    session of this process serves the tensor's GPU (run bare, or on a simulated GPU,
    where ``backend.allocate(n, discardable=True)`` is the way), nothing is marked and
    ``bytes`` is 0, so the same code runs everywhere."""
    from gpushare.client.swap.torch import TorchBackend  # no PyTorch import of its own

    for s in list(_sessions):
        b = s.backend
        if isinstance(b, TorchBackend) and b.device == tensor.device.index and s.open:
            return b.discardable_tensor(tensor)
    return Discardable(tensor.data_ptr(), tensor.untyped_storage().nbytes(), 0)


def attach(
    memory: str | int | None = None,
    *,
    memory_limit: str | int | None = None,
    compute_limit: float | None = None,
    socket: str | None = None,
    gpu: int | None = None,
    name: str | None = None,
    weight: float | None = None,
    backend: str | None = None,
    timeout: float = 10.0,
    reconnect_timeout: float | None = None,
) -> Session:
    """Attach this process to a GPU through the node daemon; returns a :class:`Session`.

    ``memory`` (``"20GiB"``, bytes) is the GPU memory the session requests: what the node
    guarantees it and packs sessions by; without it ``GPUSHARE_MEMORY``, then KAI's
    ``gpu-memory`` annotation or ``GPU_PORTION`` of the GPU, then the whole GPU.
    ``memory_limit`` is the most it may use (default ``GPUSHARE_MEMORY_LIMIT``, KAI's
    limit annotations, else the request): between the two, memory is lent while it is
    free and given back when it is needed, never a reason to end the workload.
    ``compute_limit`` (default ``GPUSHARE_COMPUTE_LIMIT``, else none) caps the session's
    share of GPU time, a fraction in (0, 1], even when the GPU would otherwise idle.
    ``timeout`` bounds connecting (a busy node is tried again within it) and the
    handshake. ``reconnect_timeout`` (default ``GPUSHARE_RECONNECT_TIMEOUT``, else 60 s)
    bounds how long a new burst waits for a node that went away. Raises
    :class:`~gpushare.errors.DaemonUnavailableError` when no node answers and
    :class:`~gpushare.errors.AttachRefusedError` when the node refuses.
    """
    return attach_with(
        memory,
        memory_limit=memory_limit,
        compute_limit=compute_limit,
        socket=socket,
        gpu=gpu,
        name=name,
        weight=weight,
        backend=backend,
        timeout=timeout,
        reconnect_timeout=reconnect_timeout,
    )


def attach_with(
    memory: str | int | None = None,
    *,
    memory_limit: str | int | None = None,
    compute_limit: float | None = None,
    socket: str | None = None,
    gpu: int | None = None,
    name: str | None = None,
    weight: float | None = None,
    backend: str | None = None,
    timeout: float = 10.0,
    reconnect_timeout: float | None = None,
    on_ended: Ended | None = None,
    family: int = 0,
    resident_model: str = "",
) -> Session:
    """:func:`attach`, and ``on_ended(reason, grace_s)`` called on the reader thread,
    unlocked, once the node has ended the session for good (``ctl end``, a refusal on
    reconnecting: grace 0), or says it will in ``grace_s`` (``ctl end --grace``):
    ``gpushare run`` stops its program there. ``family``: this process
    was started by session ``family``'s program and joins it as a member (one lease, its
    memory out of that session's limit: ``memory_limit`` the most it takes, else all the
    session has free). ``resident_model``: how ``gpushare run`` models a CPU-run
    program's memory on a simulated GPU (client/modelled.py), said in the hello."""
    env = read_env()
    path = socket or env.socket
    if family:
        request, limit = None, parse_size(memory_limit) if memory_limit is not None else None
    else:
        request, limit = memory_figures(memory, memory_limit, env)
    hello = p.Hello(
        version=p.PROTOCOL_VERSION,
        name=name or f"{program_name(sys.argv[0], sys.orig_argv)}-{os.getpid()}",
        memory_limit=limit,
        memory_request=request,
        weight=weight if weight is not None else env.portion,
        # the limit's share when none is given; and the weight's source (a member's
        # limit and weight are its session's)
        portion=None if family else env.portion,
        portion_limit=None if family else env.portion_limit,
        sharing=env.sharing_mode,
        compute_limit=compute_limit_of(compute_limit, os.environ.get("GPUSHARE_COMPUTE_LIMIT")),
        gpu=gpu if gpu is not None else env.gpu,
        gpu_uuid=env.gpu_uuid if gpu is None else "",
        backend=backend or "",
        pod=env.pod,
        namespace=env.namespace,
        container=env.container,
        pod_uid=env.pod_uid,
        claim=env.claim,
        fills=True,
        prefetch=True,
        grows=True,  # both backends ask before they grow past a bound (sim: in allocate;
        # torch: the allocator library's gs_on_grow hook), so the node may lend bounds
        **gang_fields(),  # a rank of a distributed job: granted with the others
        family=family,
        resident_model=resident_model,
    )
    if reconnect_timeout is None:
        reconnect_timeout = float(os.environ.get("GPUSHARE_RECONNECT_TIMEOUT") or 60.0)
    return open_session(
        UnixConnector(path), hello, timeout, backend, reconnect_timeout, on_ended=on_ended
    )


def open_session(
    connector: Connector,
    hello: p.Hello,
    timeout: float = 10.0,
    backend: str | None = None,
    reconnect_timeout: float = 60.0,
    on_ended: Ended | None = None,
) -> Session:
    """:func:`attach` once the hello is made, through any connector (tests use a fake
    node's); ``on_ended``: see :func:`attach_with`."""
    sock, welcome, rest = open_connection(connector, hello, timeout)
    try:
        swap = _backend_for(backend, welcome)
    except BaseException:
        sock.close()  # the node counts the session gone
        raise
    return Session(
        sock,
        welcome,
        swap,
        connector.where,
        hello,
        reconnect_timeout,
        connector=connector,
        first=rest,
        on_ended=on_ended,
    )


BackendFactory = Callable[[SwapHooks], SwapBackend]
"""Builds a session's swap backend, given what it calls in its session."""


def _backend_for(name: str | None, w: p.Welcome) -> BackendFactory:
    """``sim`` for a simulated GPU, ``torch`` for a real one, unless asked otherwise: how
    to build it (a backend that does not fit the GPU is refused here, before)."""
    name = name or ("sim" if w.simulated else "torch")
    if name == "sim":
        if not w.simulated:
            raise GpushareError(
                f"GPU {w.gpu} ({w.gpu_name}) is a real GPU and the sim backend only serves"
                " simulated ones: use backend='torch' (the default on real GPUs)"
            )
        return lambda hooks: SimBackend(
            w.memory_limit,
            scale=w.sim_scale,
            bandwidth=w.sim_bandwidth,
            failure_rate=w.sim_swap_failure_rate,
            link=w.sim_link,
            hooks=hooks,
        )
    if name == "torch":
        if w.simulated:
            raise GpushareError(
                f"GPU {w.gpu} is simulated and the torch backend needs a real one:"
                " use backend='sim' (the default on simulated GPUs)"
            )
        from gpushare.client.swap.torch import TorchBackend  # imports PyTorch: only when needed

        return lambda hooks: TorchBackend(
            w.memory_limit, gpu_uuid=w.gpu_uuid, gpu_index=w.gpu, hooks=hooks
        )
    raise GpushareError(f"unknown swap backend {name!r}: choose 'torch' or 'sim'")


class Session:
    """One workload process attached to one GPU. See :func:`attach`."""

    def __init__(
        self,
        sock: _socket.socket,
        welcome: p.Welcome,
        backend: BackendFactory,
        path: str = "",
        hello: p.Hello | None = None,
        reconnect_timeout: float = 60.0,
        *,
        connector: Connector | None = None,
        first: Iterable[p.Message] = (),
        on_ended: Ended | None = None,
    ) -> None:
        self.name = welcome.name
        self.gpu_index = welcome.gpu
        self.gpu_name = welcome.gpu_name
        self.simulated = welcome.simulated
        self.weight = welcome.weight
        self.idle_release_s = welcome.idle_release_s
        self.tq_s = welcome.tq_s  # the GPU's TQ when it attached (0: the node did not say)
        # The distributed job this process is a rank of ("": none), as its hello said.
        self.gang = hello.gang if hello else ""
        # One condition for the link and the lease: each reads a consistent picture of
        # both. Not reentrant: a swap leaves it (see Lease._unlocked).
        cond = threading.Condition(threading.Lock())

        def link(peer: Peer) -> Transport:
            return Transport(
                sock,
                welcome.session,
                connector or UnixConnector(path),
                hello or p.Hello(version=p.PROTOCOL_VERSION),
                cond,
                peer,
                on_ended,
            )

        try:  # the lease builds its link and backend, each told of it
            self._lease = Lease(link, backend, cond, welcome, reconnect_timeout, os.getpid())
        except BaseException:
            sock.close()  # the backend could not start: the node counts the session gone
            raise
        self._link = self._lease.link
        self.backend = self._lease.backend
        self._link.start(first)
        _sessions.add(self)

    # --- public ---------------------------------------------------------------------

    @contextlib.contextmanager
    def gpu(self) -> Iterator[Session]:
        """A burst: blocks until the lease is granted (swapping in first), releases at exit."""
        self._lease.enter()
        try:
            yield self
        finally:
            self._lease.exit()

    def checkpoint(self) -> None:
        """A safe point: yields here if the lease was revoked, then waits for the next turn.

        Outside :meth:`gpu`, a checkpoint opens a burst itself, which ends after
        ``idle_release`` seconds without another checkpoint.
        """
        lease = self._lease
        lease.last_work = _now()
        if not lease.ready:  # the fast path: one flag, no lock, no system call
            lease.checkpoint()

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
        self._lease.begin_work()

    def end_work(self) -> None:
        self._lease.end_work()

    def close(self) -> None:
        """Release any lease and detach; the session's memory is freed."""
        if self._link.state is Link.FORKED:
            self._link.close_fd()
            return
        if not self._lease.close():
            return
        self._link.shut()
        with self._lease.swap_lock:  # a swap in progress stops at its next piece
            self.backend.close()

    @property
    def open(self) -> bool:
        """Attached (connected, or reconnecting), not closed."""
        return self._link.state not in (Link.CLOSED, Link.FORKED)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def memory_limit(self) -> int:
        """The most it may have on the GPU (less once a process of its family joined)."""
        return self._lease.memory_limit

    @property
    def memory_request(self) -> int:
        """What the node guarantees it and packs by (its limit unless it asked for less)."""
        return self._lease.memory_request

    @property
    def holding(self) -> bool:
        """This process may issue GPU work now."""
        return self._lease.holding

    @property
    def id(self) -> int:
        """The node's id for this session (a new one after the node restarted)."""
        return self._link.session

    @property
    def bursts(self) -> int:
        """Bursts opened by this process."""
        return self._lease.bursts

    @property
    def grants(self) -> int:
        """Leases received: a change means others may have run in between."""
        return self._lease.grants

    @property
    def waits(self) -> list[float]:
        """Seconds from asking to holding, per grant."""
        return self._lease.waits

    @property
    def reconnect_timeout(self) -> float:
        return self._lease.reconnect_timeout

    @reconnect_timeout.setter
    def reconnect_timeout(self, seconds: float) -> None:
        self._lease.reconnect_timeout = seconds

    # Read by other parts of the client and by older tests.
    @property
    def _revoked(self) -> bool:
        """A revoke is pending: the next checkpoint yields (gpushare run's hooks)."""
        return self._lease.revoke is not None

    @property
    def _fatal(self) -> bool:
        """The node ended this session, or refused it on reconnecting."""
        return self._link.state is Link.ENDED

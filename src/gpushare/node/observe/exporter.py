"""The Prometheus exporter as the node runs it: in a process of its own
(node/observe/exporter_process.py), so that a scrape costs the node's event loop one snapshot,
taken and encoded between two messages, and no thread in the node's interpreter.

The node binds the port (a busy one stops its start, as before) and keeps the
listening socket, so the port stays the node's while an exporter is started again;
the exporter inherits it and one end of a socketpair, over which it asks for snapshots.
An exporter that ends while the node runs is logged and started again (at once after
one that served, later and later after one that did not: 1, 3, 7, 15, 30 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import msgspec

from gpushare.node.observe import metrics_http
from gpushare.node.observe.exporter_process import ASK, HEADER, READY
from gpushare.status import NodeStatus

log = logging.getLogger("gpushare.node.exporter")
MODULE = "gpushare.node.observe.exporter_process"
STOP_WAIT_S = 2.0  # for an exporter to end at the link's end, before it is killed


class Snapshots:
    """The encoded snapshots the loop gives the exporter: a new one for each request,
    unless the last was taken less than ``SHARE`` times its own cost ago, so however
    fast the exporter is scraped, snapshots take at most 1/(SHARE + 1) of the loop's
    time (0.5%), and a scrape's figures are at most that old (and 1 s)."""

    SHARE = 200
    MOST_S = 1.0

    def __init__(self, status: Callable[[], NodeStatus], clock: Callable[[], float]) -> None:
        self._status = status
        self._clock = clock
        self._encode = msgspec.msgpack.Encoder().encode
        self._last = b""
        self._until = float("-inf")  # the last one is given until then

    def take(self) -> bytes:
        t0 = self._clock()
        if t0 < self._until:
            return self._last
        self._last = self._encode(self._status())
        took = self._clock() - t0
        self._until = t0 + min(self.MOST_S, took * (self.SHARE + 1))
        return self._last


class _Answers(asyncio.Protocol):
    """The node's end of the link: a snapshot for each request, written from the loop."""

    def __init__(self, snapshots: Snapshots, ended: asyncio.Future[None]) -> None:
        self._snapshots = snapshots
        self._ended = ended
        self.transport: asyncio.Transport | None = None
        self.ready = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if READY in data:
            self.ready = True
        for _ in range(data.count(ASK)):  # one at a time in flight: at most one here
            self._answer()

    def _answer(self) -> None:
        assert self.transport is not None
        try:
            body = self._snapshots.take()
        except Exception:
            log.exception("metrics: the snapshot failed")
            body = b""  # the scrape is answered 500; the exporter serves on
        self.transport.writelines([HEADER.pack(len(body)), body])

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._ended.done():
            self._ended.set_result(None)


class Exporter:
    """Serves ``/metrics`` from a child process; ``status`` is called in the loop."""

    def __init__(
        self,
        status: Callable[[], NodeStatus],
        port: int,
        address: str,
        clock: Callable[[], float],
    ) -> None:
        self._snapshots = Snapshots(status, clock)
        self._listen = metrics_http.bind(port, address)  # OSError: the caller says what to do
        self.port: int = self._listen.getsockname()[1]
        self.proc: subprocess.Popen[bytes] | None = None
        self._link: asyncio.Transport | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._keep())

    async def _keep(self) -> None:
        """An exporter running while the node runs."""
        failures = 0
        while not self._stopping.is_set():
            ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            try:
                proc, answers = await self._spawn(ended)
            except OSError as e:
                log.error("metrics: the exporter could not start: %s", e)
                ready, how, pid = False, "", 0
            else:
                log.debug("metrics: exporter pid %d", proc.pid)
                if self._stopping.is_set() and self._link is not None:
                    self._link.close()  # stopped while it started
                await ended
                ready, how, pid = answers.ready, await self._reap(proc), proc.pid
            if self._stopping.is_set():
                return
            failures = 0 if ready else failures + 1
            delay = min(30.0, 2.0**failures - 1)
            if pid:
                log.warning(
                    "metrics: the exporter (pid %d) ended (%s): starting another%s",
                    pid,
                    how,
                    f" in {delay:g} s" if delay else "",
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), delay)

    async def _spawn(self, ended: asyncio.Future[None]) -> tuple[subprocess.Popen[bytes], _Answers]:
        ours, theirs = socket.socketpair()
        with theirs:
            # the same gpushare as this node's, whatever the child's path would say
            src = str(Path(__file__).resolve().parents[2])
            path = os.pathsep.join([src, *filter(None, [os.environ.get("PYTHONPATH")])])
            try:
                self.proc = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        MODULE,
                        "--listen",
                        str(self._listen.fileno()),
                        "--link",
                        str(theirs.fileno()),
                        "--parent",
                        str(os.getpid()),
                    ],
                    pass_fds=(self._listen.fileno(), theirs.fileno()),
                    stdin=subprocess.DEVNULL,
                    env={**os.environ, "PYTHONPATH": path},
                )
            except BaseException:
                ours.close()
                raise
        answers = _Answers(self._snapshots, ended)
        transport, _ = await asyncio.get_running_loop().create_unix_connection(
            lambda: answers, sock=ours
        )
        self._link = transport
        return self.proc, answers

    async def _reap(self, proc: subprocess.Popen[bytes]) -> str:
        """How it ended (it closed the link: it is ending, or it is killed after a while)."""
        waited = 0.0
        while proc.poll() is None:
            if waited >= STOP_WAIT_S:
                proc.kill()
                proc.wait()
                break
            await asyncio.sleep(0.01)
            waited += 0.01
        code = proc.returncode
        if code is not None and code < 0:
            with contextlib.suppress(ValueError):
                return f"killed by {signal.Signals(-code).name}"
        return f"exit status {code}"

    async def stop(self) -> None:
        """Ends the exporter (the link's end tells it) and frees the port."""
        self._stopping.set()
        if self._link is not None:
            self._link.close()
        if self._task is not None:
            try:
                await self._task  # it reaps the exporter (killed if it lingers)
            except Exception:
                log.exception("metrics: stopping the exporter")
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._listen.close()

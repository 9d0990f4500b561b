"""The node's Unix sockets: listening (with the right mode from birth, a stale socket
replaced, a live one left alone) and reading one frame."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from gpushare import protocol as p

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]

# Connections the kernel queues for accepting: sized for bursts of attaches (a job
# starting 1,000 workers at once; asyncio's default is 100). Linux caps it at
# net.core.somaxconn (4096 since 5.4); a client finding it full tries again.
LISTEN_BACKLOG = 4096
# Connections asyncio accepts at each wakeup (it takes the listen backlog for it, and
# each one accepted holds a descriptor until its handler has run): a flood of silent
# connections took the node to its descriptor limit (1,015 open of 1,024); 32 keeps it
# to about 200 (tests/node/test_mass_attach.py). The kernel's queue stays deep.
ACCEPT_BATCH = 32


class Handlers:
    """The connection handlers running now, so that a stopping node ends them (their
    peers see the end, their sessions detach) rather than leaving them to be cancelled."""

    def __init__(self) -> None:
        self._live: dict[asyncio.Task[Any], asyncio.StreamWriter] = {}

    def track(self, handler: Handler) -> Handler:
        async def run(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            assert task is not None
            self._live[task] = writer
            try:
                await handler(reader, writer)
            finally:
                self._live.pop(task, None)

        return run

    async def close(self, timeout: float = 2.0) -> None:
        for writer in self._live.values():
            writer.close()
        if self._live:
            await asyncio.wait(list(self._live), timeout=timeout)


async def read_frame(reader: asyncio.StreamReader) -> p.Message:
    header = await reader.readexactly(p.HEADER_SIZE)
    body = await reader.readexactly(p.frame_length(header))
    return p.decode(body)


class Idle(TimeoutError):
    """No frame began within the idle timeout."""


class Unfinished(TimeoutError):
    """A frame began and did not end within the frame timeout."""


async def read_frame_within(reader: asyncio.StreamReader, idle: float, frame: float) -> p.Message:
    """One frame that begins within ``idle`` seconds and, once begun, ends within
    ``frame`` more (:class:`Idle`, :class:`Unfinished`): a peer that sends part of a
    frame and stops holds its connection that long, not for good."""
    try:
        first = await asyncio.wait_for(reader.readexactly(1), idle)
    except TimeoutError:
        raise Idle() from None
    try:
        async with asyncio.timeout(frame):
            header = first + await reader.readexactly(p.HEADER_SIZE - 1)
            body = await reader.readexactly(p.frame_length(header))
    except TimeoutError:
        raise Unfinished() from None
    return p.decode(body)


async def serve_unix(
    cb: Handler, path: str, mode: int, backlog: int = LISTEN_BACKLOG
) -> asyncio.Server:
    d = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(d, exist_ok=True)
    except OSError as e:
        raise OSError(f"cannot create {d}: {e.strerror}; choose another socket path") from None
    if os.path.exists(path):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # stale, from a node that died
        else:
            raise OSError(f"another gpushare node is serving {path}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        old = os.umask(0o777 & ~mode)  # born with the right mode: no window where it is wider
        try:
            sock.bind(path)
        finally:
            os.umask(old)
        srv = await asyncio.start_unix_server(cb, sock=sock, backlog=min(backlog, ACCEPT_BATCH))
    except BaseException:
        sock.close()
        raise
    sock.listen(backlog)  # asyncio listened with the batch; the kernel's queue is deeper
    os.chmod(path, mode)
    return srv

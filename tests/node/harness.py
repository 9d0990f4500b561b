"""A whole node, running in this process on virtual time.

``@in_process(...)`` turns ``async def test_x(node, ...)`` into a test that starts a real
:class:`~gpushare.node.daemon.Node` (its asyncio servers on real Unix sockets in a
temporary folder, its arbiters, timers, sampler and config watch) on a
:class:`~gpushare.node.host.virtual_time.VirtualTimeLoop`, and hands it the test as an
:class:`InProcessNode`. Workloads and administrators are raw protocol connections in the
same loop, so quanta, grace periods and watch periods pass in no wall time, in the same
order every run. Signals are recorded, never sent (the peers are this process).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import os
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from gpushare import protocol as p
from gpushare.core.clock import ManualClock
from gpushare.node.daemon import Node
from gpushare.node.host import virtual_time
from gpushare.node.host.gpus import simulated_gpus
from gpushare.node.host.procs import ProcRef
from gpushare.node.keep.config import load
from gpushare.units import parse_size

G = 2**30


class Peer:
    """One raw connection to a node socket: frames out, frames in."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self._buf = p.FrameBuffer()
        self._pending: list[p.Message] = []

    @classmethod
    async def connect(cls, path: str) -> Peer:
        return cls(*await asyncio.open_unix_connection(path))

    async def send(self, *msgs: p.Message) -> None:
        self.writer.write(b"".join(p.encode(m) for m in msgs))
        await self.writer.drain()

    async def send_raw(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def recv(self, timeout: float = 60.0) -> p.Message:
        """The next frame (virtual seconds: a test that waits for nothing fails)."""
        async with asyncio.timeout(timeout):
            while not self._pending:
                data = await self.reader.read(65536)
                if not data:
                    raise ConnectionError("the node closed the connection")
                self._pending.extend(self._buf.feed(data))
        return self._pending.pop(0)

    async def expect(self, kind: type[Any], timeout: float = 60.0) -> Any:
        """The next frame of type ``kind``, skipping others (a SwapOut, say)."""
        async with asyncio.timeout(timeout):
            while True:
                msg = await self.recv(timeout)
                if isinstance(msg, kind):
                    return msg

    async def closed(self, timeout: float = 60.0) -> bool:
        """True once the node has closed this connection (frames before it are read)."""
        try:
            while True:
                await self.recv(timeout)
        except (ConnectionError, OSError):
            return True

    async def request(self, msg: p.Message) -> p.Message:
        await self.send(msg)
        return await self.recv()

    def close(self) -> None:
        self.writer.close()


class Workload(Peer):
    welcome: p.Welcome

    @property
    def session(self) -> int:
        return self.welcome.session


class InProcessNode:
    def __init__(
        self, node: Node, clock: ManualClock, folder: Path, make: Callable[[], Node]
    ) -> None:
        self.node, self.clock, self.dir = node, clock, folder
        self.signals: list[tuple[int, int]] = []
        self._make = make

    async def restart(self) -> Node:
        """Stop the node (its connections end, as when it dies) and start another on the
        same sockets and files: what a node restart looks like to its workloads."""
        await self.node.stop()
        self.node = self._make()
        await self.node.start()
        return self.node

    @property
    def socket(self) -> str:
        return self.node.config.socket

    @property
    def admin_socket(self) -> str:
        return self.node.config.admin_socket

    async def workload(self, **hello: Any) -> Workload:
        """A session: hello (``memory_limit`` etc.), welcomed."""
        w = Workload(*await asyncio.open_unix_connection(self.socket))
        await w.send(p.Hello(version=p.PROTOCOL_VERSION, **hello))
        w.welcome = await w.expect(p.Welcome)
        return w

    async def admin(self) -> Peer:
        return await Peer.connect(self.admin_socket)

    async def ask(self, msg: p.Message) -> p.Message:
        """One admin request on its own connection."""
        a = await self.admin()
        try:
            return await a.request(msg)
        finally:
            a.close()

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        return [e for e in self.node.events.backlog if kind is None or e["event"] == kind]

    async def until(self, pred: Callable[[], Any], timeout: float = 60.0) -> Any:
        """Let the node run (virtual time) until ``pred()`` holds."""
        async with asyncio.timeout(timeout):
            while not (v := pred()):
                await asyncio.sleep(0.001)
            return v

    async def until_wall(self, pred: Callable[[], Any], timeout: float = 30.0) -> Any:
        """Let the node run until ``pred()`` holds, bounded in real seconds: for what
        a thread or a process does (virtual time jumps while they work, so
        :meth:`until`'s virtual bound would pass before they have begun)."""
        deadline = time.monotonic() + timeout
        while not (v := pred()):
            assert time.monotonic() < deadline, f"not within {timeout} real seconds"
            await asyncio.sleep(0.01)
        return v

    async def settle(self) -> None:
        """Let every connection's pending frames be handled (no virtual time passes
        while something is ready to run)."""
        for _ in range(20):
            await asyncio.sleep(0)


def in_process(
    memory: str = "16GiB", gpus: int = 1, files: dict[str, str] | None = None, **config: Any
) -> Callable[[Callable[..., Awaitable[None]]], Callable[..., None]]:
    """Decorate ``async def test(node: InProcessNode, <fixtures>...)``. ``config``: the
    NodeConfig fields; ``files``: ``{"config": text, "state": text}`` written first (the
    node then watches its config file, and persists to the state file)."""

    def wrap(test: Callable[..., Awaitable[None]]) -> Callable[..., None]:
        @functools.wraps(test)
        def run(*args: Any, **kwargs: Any) -> None:
            # On a tmpfs where there is one: the node's files are flushed to disk as they
            # are written (session records), and a disk makes each write milliseconds.
            shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
            with tempfile.TemporaryDirectory(prefix="gs-ip-", dir=shm) as d:
                folder = Path(d)
                paths = {}
                for name, text in (files or {}).items():
                    paths[name] = folder / f"{name}.toml"
                    if text is not None:
                        paths[name].write_text(text)
                # as `gpushare node` does it: the files, then the flags over them
                flags = {
                    "socket": str(folder / "w.sock"),
                    "admin_socket": str(folder / "a.sock"),
                    "metrics_port": 0,
                    **config,
                }
                config_path = str(paths.get("config", ""))
                state_path = str(paths.get("state", ""))
                cfg = load(config_path, state_path, flags)
                clock = ManualClock()
                box: list[InProcessNode] = []

                def record(ref: ProcRef, sig: int) -> None:
                    box[0].signals.append((ref.pid, sig))

                def make() -> Node:
                    return Node(
                        cfg,
                        simulated_gpus(gpus, parse_size(memory)),
                        config_path=config_path,
                        state_path=state_path,
                        clock=clock,
                        signaller=record,
                        flags=flags,
                    )

                box.append(InProcessNode(make(), clock, folder, make))

                async def main() -> None:
                    await box[0].node.start()
                    try:
                        await test(box[0], *args, **kwargs)
                    finally:
                        await box[0].node.stop()

                virtual_time.run(main(), clock)

        # pytest asks for the test's fixtures, less the node it is handed here
        sig = inspect.signature(test)
        run.__signature__ = sig.replace(parameters=list(sig.parameters.values())[1:])  # type: ignore[attr-defined]
        return run

    return wrap

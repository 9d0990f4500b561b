"""The virtual-time loop: timers fire in clock time, idle time is skipped, sockets
between peers in the loop work as on any loop."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from gpushare.core.clock import ManualClock
from gpushare.node.host import virtual_time


def test_an_hour_of_sleeps_passes_at_once_and_in_order():
    clock = ManualClock(start=100.0)
    order: list[tuple[str, float]] = []

    async def sleeper(name: str, delay: float) -> None:
        await asyncio.sleep(delay)  # virtual time: the subject of these tests
        order.append((name, asyncio.get_running_loop().time()))

    async def main() -> float:
        await asyncio.gather(sleeper("b", 3600), sleeper("a", 1.5), sleeper("c", 7200))
        return clock.monotonic()

    t0 = time.monotonic()
    assert virtual_time.run(main(), clock) == pytest.approx(7300.0)
    assert time.monotonic() - t0 < 5  # no real waiting (loosely bounded)
    assert order == [("a", pytest.approx(101.5)), ("b", 3700.0), ("c", 7300.0)]


def test_ready_io_runs_before_time_moves():
    clock = ManualClock()

    async def main() -> tuple[bytes, float]:
        a, b = socket.socketpair()
        _, wa = await asyncio.open_connection(sock=a)
        rb, wb = await asyncio.open_connection(sock=b)
        waiter = asyncio.ensure_future(asyncio.sleep(50))  # a timer pending all along
        t0 = clock.monotonic()
        wa.write(b"ping")
        data = await rb.readexactly(4)
        moved = clock.monotonic() - t0
        waiter.cancel()
        wa.close()
        wb.close()
        return data, moved

    assert virtual_time.run(main(), clock) == (b"ping", 0.0)


def test_timeouts_are_virtual_and_deterministic():
    clock = ManualClock()

    async def main() -> float:
        r, w = socket.socketpair()
        reader, _ = await asyncio.open_connection(sock=r)
        t0 = clock.monotonic()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(30):
                await reader.read(1)  # nothing ever comes
        w.close()
        return clock.monotonic() - t0

    assert virtual_time.run(main(), clock) == pytest.approx(30.0)

"""Virtual time for a running node: an asyncio loop whose clock is a ManualClock.

``loop.time()`` is the clock's ``monotonic()``, and whenever nothing is ready to run
(no callback due, no socket readable) the loop jumps the clock to its next timer instead
of sleeping, as trio's ``MockClock(autojump_threshold=0)`` and kopf's looptime do. A
node started on this loop with the same clock (its arbiters, its timers, its sampling)
runs its real servers over real sockets, and a test drives it through quanta, grace
periods and watch periods in no wall time and in the same order every run.

Sockets between peers in this process are seen at once (the kernel holds the bytes), so
"nothing ready" means every peer waits. Other threads and processes are not waited for:
time jumps while they work, so a virtual-time test keeps all its peers in this loop. The
one exception is the loop's own work handed to an executor it is given
(``run_in_executor(pool, ...)``: the node's record writes): time stands still while such
a job ends within 50 ms of real time (a test's figures stay exact), and passes as the
wall clock's does while it takes longer (a slow disk), never jumping past the job.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Callable, Coroutine, Mapping
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any, TypeVar

from gpushare.core.clock import ManualClock
from gpushare.node.host.clock import SystemClock

if TYPE_CHECKING:
    from _typeshed import FileDescriptorLike

T = TypeVar("T")


_WALL = SystemClock()  # only for an executor's job that takes its time


class _AutojumpSelector(selectors.BaseSelector):
    """A selector that, asked to wait ``timeout`` seconds with nothing ready, moves the
    clock on by ``timeout`` and returns at once (the loop then runs the timer due)."""

    def __init__(self, clock: ManualClock) -> None:
        self._clock = clock
        self._real = selectors.DefaultSelector()
        self.working = 0  # executor jobs of the loop's in flight

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = self._real.select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:  # no timer at all: only I/O can wake the loop
            return self._real.select(None)
        if self.working:  # a job's end wakes the loop (its self-pipe): till then time
            t0 = _WALL.monotonic()  # stands still, or goes as the wall's for a slow one
            ready = self._real.select(min(timeout, 0.05))
            if not ready:
                self._clock.advance(min(timeout, _WALL.monotonic() - t0))
            return ready
        self._clock.advance(max(0.0, timeout))
        return []

    def register(
        self, fileobj: FileDescriptorLike, events: int, data: Any = None
    ) -> selectors.SelectorKey:
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj: FileDescriptorLike) -> selectors.SelectorKey:
        return self._real.unregister(fileobj)

    def modify(
        self, fileobj: FileDescriptorLike, events: int, data: Any = None
    ) -> selectors.SelectorKey:
        return self._real.modify(fileobj, events, data)

    def get_key(self, fileobj: FileDescriptorLike) -> selectors.SelectorKey:
        return self._real.get_key(fileobj)

    def get_map(self) -> Mapping[FileDescriptorLike, selectors.SelectorKey]:
        return self._real.get_map()

    def close(self) -> None:
        self._real.close()


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop on ``clock``: timers fire in clock time, idle time is skipped."""

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock
        self._jumps = _AutojumpSelector(clock)
        super().__init__(self._jumps)

    def time(self) -> float:
        return self.clock.monotonic()

    def run_in_executor(  # type: ignore[override]
        self, executor: Executor | None, func: Callable[..., T], *args: Any
    ) -> asyncio.Future[T]:
        fut = super().run_in_executor(executor, func, *args)
        if executor is not None:  # asyncio.to_thread's (None): not waited for
            self._jumps.working += 1
            fut.add_done_callback(self._job_done)
        return fut

    def _job_done(self, _: asyncio.Future[Any]) -> None:
        self._jumps.working -= 1


def run(main: Coroutine[Any, Any, T], clock: ManualClock | None = None) -> T:
    """Run ``main`` to its end on a virtual-time loop (a fresh ManualClock by default)."""
    c = clock or ManualClock()
    with asyncio.Runner(loop_factory=lambda: VirtualTimeLoop(c)) as runner:
        return runner.run(main)

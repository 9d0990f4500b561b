"""The swap-backend interface: how a session's GPU memory leaves the GPU and comes back."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

# Progress during a swap is reported at most this often: every piece at PCIe speed
# (a 256 MiB piece takes ~5 ms), without flooding the node at a simulated 2 TB/s.
PROGRESS_EVERY_S = 0.002


def _nothing() -> None:
    pass


def _no_bound(resident: int) -> None:
    pass


@dataclass(frozen=True)
class SwapHooks:
    """What a backend calls in its session, given when it is built (a backend alone, in
    a test or benchmark, has none: nothing to tell, no lease to check, no room to wait
    for)."""

    on_change: Callable[[], None] = _nothing  # memory figures changed: report them
    check_access: Callable[[], None] = _nothing  # raises outside a lease
    wait_room: Callable[[int], None] = _no_bound  # blocks until that much is allowed
    # Before an allocation: blocks until the session may have that many bytes in all
    # (past its grant's bound it asks the node again, yielding meanwhile).
    grow: Callable[[int], None] = _no_bound
    # Blocks until the session holds the GPU (a burst opened, as GPU work at a safe point
    # opens one): before memory another allocator brings back by itself (vLLM's wake).
    hold: Callable[[], None] = _nothing
    holding: Callable[[], bool] = lambda: True  # whether it holds the GPU now


NO_HOOKS = SwapHooks()


class ForeignPool(Protocol):
    """Memory another allocator of the process holds and can swap itself (vLLM's sleep
    mode: :mod:`~gpushare.client.swap.vllm_sleep`), counted and swapped with the
    session's own."""

    @property
    def resident_bytes(self) -> int: ...
    @property
    def swapped_bytes(self) -> int: ...
    @property
    def discarded_bytes(self) -> int: ...

    def figures(self) -> tuple[int, int, int]:
        """The three above, read at once."""
        ...

    def swap_out(self) -> SwapResult:
        """All of it, or nothing where it cannot."""
        ...

    def swap_in(self, room: Callable[[int], float]) -> SwapResult:
        """What :meth:`swap_out` took, once ``room(bytes)`` allowed that many more."""
        ...


def no_pool() -> ForeignPool | None:
    return None


@dataclass(frozen=True)
class SwapResult:
    bytes: int  # device bytes moved (as the GPU counts them)
    seconds: float
    discarded: int = 0  # a swap-out: discardable bytes dropped instead (not moved)


class SwapBackend(ABC):
    """One session's GPU memory. Implementations: ``sim`` (here) and ``torch``.

    Swap calls come from one thread at a time (the session serializes them); a failed
    swap raises :class:`~gpushare.errors.SwapError` and leaves memory as it was (chunks
    already moved stay moved, and are counted so).

    Swaps go chunk by chunk, so that a switch can overlap: a swap-out calls
    :attr:`on_change` as each chunk's GPU memory is freed, and a swap-in calls
    :attr:`wait_room` before each chunk with the resident bytes it will have after it
    (which blocks until the node allows that much) and :attr:`on_change` after it.
    """

    name: str
    simulated: bool

    def __init__(self, hooks: SwapHooks = NO_HOOKS) -> None:
        self.on_change: Callable[[], None] = hooks.on_change
        self.check_access: Callable[[], None] = hooks.check_access
        self.wait_room: Callable[[int], None] = hooks.wait_room
        self.grow: Callable[[int], None] = hooks.grow
        self.hold: Callable[[], None] = hooks.hold
        self.holding: Callable[[], bool] = hooks.holding
        self._last_progress = 0.0
        self.progress_every_s = PROGRESS_EVERY_S

    def set_limit(self, limit: int) -> None:  # noqa: B027  a backend with no limit of its own
        """The session's memory limit is now ``limit`` (a process of its family joined or
        left): allocations past it fail from now on. What it has stays."""

    def room_for(self, resident: int) -> float:
        """Wait until the node allows ``resident`` bytes on the GPU (:attr:`wait_room`);
        returns the seconds waited, which a swap's timing leaves out."""
        t0 = time.perf_counter()
        self.wait_room(resident)
        return time.perf_counter() - t0

    def progress(self) -> None:
        """A piece moved: tell the session (the node), unless it heard very recently;
        the swap's end is always told (SwapDone carries the figures)."""
        now = time.perf_counter()
        if now - self._last_progress >= self.progress_every_s:
            self._last_progress = now
            self.on_change()

    @property
    @abstractmethod
    def resident_bytes(self) -> int: ...

    @property
    @abstractmethod
    def swapped_bytes(self) -> int: ...

    @property
    def discarded_bytes(self) -> int:
        """Discardable memory dropped at a swap-out, made again (empty) at the next
        swap-in; a backend without discardable memory has none."""
        return 0

    def figures(self) -> tuple[int, int, int]:
        """Resident, swapped and discarded bytes, as a report sends them (one read where
        a backend can do it in one)."""
        return self.resident_bytes, self.swapped_bytes, self.discarded_bytes

    @abstractmethod
    def synchronize(self) -> None:
        """Wait for GPU work already queued (before swapping out under it)."""

    @abstractmethod
    def swap_out(self, nbytes: int) -> SwapResult:
        """Move at least ``nbytes`` (or all there is) to host memory and free them."""

    @abstractmethod
    def swap_in(self) -> SwapResult:
        """Bring every swapped byte back and verify it; ``seconds`` leaves out the time
        spent waiting for room."""

    def close(self) -> None:  # noqa: B027  optional for backends with nothing to free
        """Free host buffers."""

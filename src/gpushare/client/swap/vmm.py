"""GPU memory that can leave the GPU and come back at the same addresses.

Each allocation is a reserved virtual address range backed by *pieces* of physical
memory (at most :data:`PIECE_BYTES` each). Swap-out copies pieces to pinned host buffers,
then unmaps and releases them, piece by piece, telling the session after each (so the
next holder can swap into what was freed); swap-in creates and maps new pieces at the
same addresses, after the node has given room for each, and copies the bytes back.
Pointers into the memory (tensors, modules, optimizer state, CUDA graphs) stay valid.

Copies are pipelined, :data:`DEPTH` pieces in flight on one stream, so the link stays
busy while the driver maps and unmaps. Pinned host buffers are made in the background
from attach (pinning runs at about 1 GiB/s, far too slow for a switch) and reused.

The GPU is reached through a :class:`~gpushare.client.swap.cuda.Driver`; the ``torch`` backend
(:mod:`gpushare.client.swap.torch`) routes PyTorch's allocations here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from gpushare.client.swap.base import SwapBackend, SwapResult
from gpushare.client.swap.cuda import Driver
from gpushare.errors import OutOfMemoryError, SwapError

log = logging.getLogger("gpushare.client.swap")
PIECE_BYTES = 256 * 2**20  # the swap granularity: big enough that driver calls don't count
DEPTH = 4  # copies in flight


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def mem_available(proc: str = "/proc") -> int:
    """MemAvailable from ``{proc}/meminfo``, in bytes (0 if unknown)."""
    try:
        with open(os.path.join(proc, "meminfo")) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


class HostBuffers:
    """Pinned host buffers of one size: ``target`` bytes of them made in the background,
    handed out and taken back. Past the target, a buffer is pinned on the spot (slow:
    counted in :attr:`late_pins`, so the figure shows)."""

    def __init__(self, driver: Driver, size: int, target: int) -> None:
        self._driver = driver
        self.size = size
        self.count_target = max(0, target // size)
        self._free: list[int] = []
        self._all: list[int] = []
        self._cond = threading.Condition()
        self._stop = False
        self.late_pins = 0
        self.pin_seconds = 0.0
        self.ready = threading.Event()
        self.error: str = ""
        threading.Thread(target=self._pin, name="gpushare-pin", daemon=True).start()

    @property
    def pinned_bytes(self) -> int:
        return len(self._all) * self.size

    def _pin(self) -> None:
        t0 = time.perf_counter()
        try:
            self._driver.make_current()
            for _ in range(self.count_target):
                if self._stop:
                    break
                ptr = self._driver.host_alloc(self.size)
                with self._cond:
                    self._all.append(ptr)
                    self._free.append(ptr)
                    self._cond.notify_all()
        except SwapError as e:  # host memory short: later swaps pin on the spot, or fail
            self.error = str(e)
            log.warning("pinning host buffers stopped at %d bytes: %s", self.pinned_bytes, e)
        finally:
            self.pin_seconds = time.perf_counter() - t0
            self.ready.set()
            with self._cond:
                self._cond.notify_all()

    def take(self) -> int:
        with self._cond:
            while not self._free and not self.ready.is_set():
                self._cond.wait()  # the pinner is at work: its next buffer comes soonest
            if self._free:
                return self._free.pop()
        ptr = self._driver.host_alloc(self.size)  # raises SwapError when host memory is out
        with self._cond:
            self._all.append(ptr)
            self.late_pins += 1
        return ptr

    def give(self, ptr: int) -> None:
        with self._cond:
            self._free.append(ptr)
            self._cond.notify_all()

    def close(self) -> None:
        """Free the buffers not holding swapped bytes."""
        self._stop = True
        self.ready.wait()
        with self._cond:
            for ptr in self._free:
                with contextlib.suppress(SwapError):
                    self._driver.host_free(ptr)
                self._all.remove(ptr)
            self._free = []


@dataclass
class _Piece:
    va: int
    size: int
    handle: int  # physical memory; 0 while swapped out
    host: int = 0  # the host buffer holding its bytes while swapped out


@dataclass
class _Segment:
    va: int
    size: int
    pieces: list[_Piece] = field(default_factory=list)


class VmmBackend(SwapBackend):
    """One session's swappable GPU memory on one device (see the module doc)."""

    name = "vmm"
    simulated = False

    def __init__(
        self,
        driver: Driver,
        limit: int,
        piece_bytes: int = PIECE_BYTES,
        host_bytes: int | None = None,
    ) -> None:
        super().__init__()
        self.driver = driver
        self.limit = limit
        driver.make_current()
        self.granularity = driver.granularity()
        self.piece_bytes = _round_up(piece_bytes, self.granularity)
        self._segments: dict[int, _Segment] = {}
        self._lock = threading.RLock()  # segments and pieces; one swap at a time
        self._resident = 0
        self._swapped = 0
        self._stream = driver.new_stream()
        target = limit if host_bytes is None else host_bytes
        self.host = HostBuffers(driver, self.piece_bytes, _round_up(target, self.piece_bytes))

    @property
    def resident_bytes(self) -> int:
        return self._resident

    @property
    def swapped_bytes(self) -> int:
        return self._swapped

    # --- the allocator --------------------------------------------------------------

    def allocate(self, size: int) -> int:
        """A new range of at least ``size`` bytes; its address. Raises
        :class:`OutOfMemoryError` past the session's limit, :class:`SwapError` when the
        GPU has no room for it."""
        if size <= 0:
            raise ValueError("allocation size must be positive")
        rounded = _round_up(size, self.granularity)
        with self._lock:
            used = self._resident + self._swapped
            if used + rounded > self.limit:
                raise OutOfMemoryError(
                    f"allocating {rounded} bytes would take this session past its memory limit"
                    f" of {self.limit} bytes ({used} in use): free memory or ask for a larger"
                    " limit (--memory, GPUSHARE_MEMORY)"
                )
            self.driver.make_current()
            va = self.driver.reserve(rounded)
            seg = _Segment(va, rounded)
            try:
                for off in range(0, rounded, self.piece_bytes):
                    n = min(self.piece_bytes, rounded - off)
                    h = self.driver.create(n)
                    seg.pieces.append(_Piece(va + off, n, h))
                    self.driver.map(va + off, n, h)
            except BaseException:
                self._drop(seg)
                raise
            self._segments[va] = seg
            self._resident += rounded
        self.on_change()
        return va

    def free(self, va: int) -> None:
        with self._lock:
            seg = self._segments.pop(va, None)
            if seg is None:
                raise ValueError(f"no allocation at {va:#x}")
            for p in seg.pieces:
                if p.handle:
                    self._resident -= p.size
                else:
                    self._swapped -= p.size
            self._drop(seg)
        self.on_change()

    def _drop(self, seg: _Segment) -> None:
        self.driver.make_current()
        for p in seg.pieces:
            if p.handle:
                with contextlib.suppress(SwapError):  # a piece created but never mapped
                    self.driver.unmap(p.va, p.size)
                self.driver.release(p.handle)
            elif p.host:
                self.host.give(p.host)
        self.driver.unreserve(seg.va, seg.size)

    # --- swapping -------------------------------------------------------------------

    def _pieces(self, newest_first: bool = False) -> Iterator[_Piece]:
        """Every piece, in allocation order (or the reverse)."""
        segs = reversed(self._segments.values()) if newest_first else self._segments.values()
        for seg in segs:
            yield from reversed(seg.pieces) if newest_first else seg.pieces

    def synchronize(self) -> None:
        """The caller's GPU work is waited for by the torch backend; here, nothing."""

    def swap_out(self, nbytes: int) -> SwapResult:
        """Move pieces (the most recently allocated first) to host memory until at least
        ``nbytes`` went, freeing each on the GPU as its copy is done."""
        with self._lock:
            self.driver.make_current()
            t0 = time.perf_counter()
            victims: list[_Piece] = []
            want = 0
            for p in self._pieces(newest_first=True):
                if want >= nbytes:
                    break
                if p.handle:
                    victims.append(p)
                    want += p.size
            moved = 0
            inflight: deque[tuple[_Piece, int, int]] = deque()
            try:
                for p in victims:
                    buf = self.host.take()
                    try:
                        self.driver.copy_dtoh(buf, p.va, p.size, self._stream)
                        ev = self.driver.record(self._stream)
                    except BaseException:
                        self.host.give(buf)
                        raise
                    inflight.append((p, buf, ev))
                    if len(inflight) >= DEPTH:
                        moved += self._retire_out(*inflight.popleft())
                while inflight:
                    moved += self._retire_out(*inflight.popleft())
            except BaseException:
                for _p, buf, ev in inflight:  # not freed: they stay resident
                    with contextlib.suppress(SwapError):
                        self.driver.wait(ev)
                    self.host.give(buf)
                raise
            return SwapResult(moved, time.perf_counter() - t0)

    def _retire_out(self, p: _Piece, buf: int, ev: int) -> int:
        self.driver.wait(ev)
        self.driver.unmap(p.va, p.size)
        self.driver.release(p.handle)
        p.handle, p.host = 0, buf
        self._resident -= p.size
        self._swapped += p.size
        self.progress()
        return p.size

    def swap_in(self) -> SwapResult:
        """Bring every swapped piece back to its address, in allocation order, each
        once the node has room for it."""
        with self._lock:
            self.driver.make_current()
            t0 = time.perf_counter()
            moved = 0
            inflight: deque[tuple[_Piece, int]] = deque()
            try:
                for p in [p for p in self._pieces() if not p.handle]:
                    t0 += self.room_for(self._resident + p.size)  # not transfer time
                    h = self.driver.create(p.size)
                    try:
                        self.driver.map(p.va, p.size, h)
                    except BaseException:
                        self.driver.release(h)
                        raise
                    p.handle = h
                    self._resident += p.size
                    self._swapped -= p.size
                    try:
                        self.driver.copy_htod(p.va, p.host, p.size, self._stream)
                        inflight.append((p, self.driver.record(self._stream)))
                    except BaseException:
                        self._unback(p)
                        raise
                    if len(inflight) >= DEPTH:
                        moved += self._retire_in(*inflight.popleft())
                while inflight:
                    moved += self._retire_in(*inflight.popleft())
            except BaseException:
                for p, ev in inflight:  # copies done are kept; others go back to host only
                    try:
                        self._retire_in(p, ev)
                    except SwapError:
                        self._unback(p)
                self.on_change()
                raise
            return SwapResult(moved, time.perf_counter() - t0)

    def _retire_in(self, p: _Piece, ev: int) -> int:
        self.driver.wait(ev)
        self.host.give(p.host)
        p.host = 0
        self.progress()
        return p.size

    def _unback(self, p: _Piece) -> None:
        """Undo a piece's swap-in: its bytes are still in its host buffer."""
        with contextlib.suppress(SwapError):
            self.driver.unmap(p.va, p.size)
        with contextlib.suppress(SwapError):
            self.driver.release(p.handle)
        p.handle = 0
        self._resident -= p.size
        self._swapped += p.size

    def wait_for_host_buffers(self, timeout: float | None = None) -> bool:
        """Block until the background pinning is done (benchmarks, tests)."""
        return self.host.ready.wait(timeout)

    def close(self) -> None:
        self.host.close()

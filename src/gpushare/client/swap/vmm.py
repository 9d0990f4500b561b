"""GPU memory that can leave the GPU and come back at the same addresses.

The memory is held by gpushare's allocator library (:mod:`gpushare.client.swap.shim`):
each allocation a reserved virtual address range backed by *pieces* of physical memory
(at most :data:`PIECE_BYTES` each). This module moves the pieces. Swap-out copies pieces
to pinned host memory, then unmaps and releases them, piece by piece, telling the session
after each (so the next holder can swap into what was freed); swap-in creates and maps
new pieces at the same addresses, after the node has given room for each, and copies the
bytes back. Pointers into the memory (tensors, modules, optimizer state, CUDA graphs)
stay valid. Memory the workload marked discardable (:meth:`VmmBackend.discardable`: a
cache it can rebuild) goes first and is dropped, not copied; its pieces come back zeroed
at the next swap-in, and the mark's :attr:`Discardable.drops` tells the workload to
rebuild.

Copies are pipelined, :data:`DEPTH` batches in flight on one stream, a batch being one
piece or several small ones (PyTorch's 2 and 20 MiB segments) up to a piece's size, with
one event each, so the link stays busy while the driver maps and unmaps, and small
segments do not each pay an event's calls. Pinned host memory is made in the background
from attach (pinning runs at about 1 GiB/s, far too slow for a switch) and reused; small
pieces share host buffers (:class:`~gpushare.client.swap.host.HostBuffers`).

The GPU is reached through a :class:`~gpushare.client.swap.cuda.Driver`, whose calls run
with the session's context pushed on the calling thread (and popped after).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from gpushare.client.swap.base import (
    NO_HOOKS,
    ForeignPool,
    SwapBackend,
    SwapHooks,
    SwapResult,
    no_pool,
)
from gpushare.client.swap.cuda import Driver, give_back
from gpushare.client.swap.host import HostBuffers, round_up
from gpushare.client.swap.shim import Piece
from gpushare.errors import SwapError

log = logging.getLogger("gpushare.client.swap")
PIECE_BYTES = 256 * 2**20  # the swap granularity: big enough that driver calls don't count
DEPTH = 4  # batches of copies in flight


class Store(Protocol):
    """Where the pieces are (gpushare's allocator library: :class:`~.shim.Shim`)."""

    @property
    def resident(self) -> int: ...
    @property
    def swapped(self) -> int: ...
    @property
    def discarded(self) -> int: ...
    @property
    def piece_bytes(self) -> int: ...
    def mark(self, va: int, size: int, on: bool = True) -> int: ...
    def alloc(self, size: int) -> int: ...
    def free(self, va: int) -> None: ...
    def claim_out(self, nbytes: int) -> list[Piece]: ...
    def claim_in(self) -> list[Piece]: ...
    def settle(self, piece: Piece, handle: int, host: int) -> None: ...
    def returned(self) -> list[int]: ...
    def notify(self, fd: int) -> None: ...
    def defer_release(self, handle: int, size: int) -> None: ...
    def retry(self) -> int: ...
    def on_grow(self, fn: Callable[[int], None] | None) -> Any: ...


# --- waiting for the GPU's work, bounded ---------------------------------------------------


class IdleWaiter:
    """Waits for a device's queued work (``sync``: e.g. ``torch.cuda.synchronize``) for
    at most a bound, from any thread: the synchronize runs on a helper thread of its
    own, one at a time, so that a caller (the client's reader thread, asked to swap out
    a session that holds no grant) is never stuck behind work that waits on something
    else, such as an NCCL collective waiting for its peers, which only the messages that
    thread reads can bring."""

    def __init__(self, sync: Callable[[], None]) -> None:
        self._sync = sync
        self._lock = threading.Lock()
        self._done: threading.Event | None = None
        self._error: BaseException | None = None
        self.started = 0  # helper threads started: one while one is pending

    def _run(self, done: threading.Event) -> None:
        try:
            self._sync()
        except BaseException as e:  # told to the waiter, not lost on the helper
            self._error = e
        finally:
            done.set()

    def wait(self, timeout: float) -> None:
        """Return once the device is idle; :class:`SwapError` if it is not within
        ``timeout`` seconds (the synchronize goes on: a later wait waits on it)."""
        with self._lock:
            done = self._done
            if done is None or done.is_set():
                done = self._done = threading.Event()
                self._error = None
                self.started += 1
                threading.Thread(
                    target=self._run, args=(done,), name="gpushare-sync", daemon=True
                ).start()
        if not done.wait(timeout):
            raise SwapError(
                f"the GPU still runs this session's work after {timeout:g} s (a collective"
                " waiting for its peers?): its memory stays on the GPU for now"
            )
        if self._error is not None:
            raise SwapError(f"waiting for the GPU's work failed: {self._error}")


# --- the backend ---------------------------------------------------------------------------


def stop_process(why: str) -> None:
    """Memory past the limit that nothing can refuse: said, and the process ends (status
    3, as a process of a session that cannot be gated does)."""
    print(why, file=sys.stderr, flush=True)
    os._exit(3)


def _still(d: Discardable) -> bool:
    """Whether ``d``'s memory is still what was marked (a check that fails: no)."""
    if d.still is None:
        return True
    try:
        return d.still()
    except Exception:
        log.warning("checking a discardable mark failed: its memory is copied", exc_info=True)
        return False


@dataclass
class Discardable:
    """Memory marked discardable (:meth:`VmmBackend.discardable`): the ``bytes`` of
    ``[va, va + size)`` in pieces wholly its own are dropped, not copied, when the node
    takes memory back, and zeroed when they come back at the next grant. ``drops``
    counts its pieces dropped so far: when it has grown, the workload rebuilds."""

    va: int
    size: int
    bytes: int
    drops: int = 0
    # Whether the memory is still what was marked (a tensor's storage may be freed or
    # swapped for another while the tensor lives): asked before each swap-out.
    still: Callable[[], bool] | None = field(default=None, repr=False, compare=False)


class VmmBackend(SwapBackend):
    """One session's swappable GPU memory on one device (see the module doc)."""

    name = "vmm"
    simulated = False

    def __init__(
        self,
        driver: Driver,
        store: Store,
        limit: int,
        host_bytes: int | None = None,
        hooks: SwapHooks = NO_HOOKS,
        foreign: Callable[[], ForeignPool | None] = no_pool,
        past_limit: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(hooks)
        self.past_limit = stop_process if past_limit is None else past_limit
        # Memory of another allocator in the process (vLLM's sleep mode), found once it
        # exists: counted and swapped with ours.
        self.foreign = foreign
        self._over_said = False
        self.driver = driver
        self.store = store
        self.limit = limit
        self.piece_bytes = store.piece_bytes
        self._lock = threading.RLock()  # one swap at a time
        self._stream = 0
        self._events: list[int] = []
        self._next_event = 0
        with driver.context():
            try:
                self._stream = driver.new_stream()
                for _ in range(DEPTH + 1):
                    self._events.append(driver.new_event())
            except BaseException:  # what was made goes back: nothing of a failed attach stays
                self._destroy_stream_and_events()
                raise
        self._marks: list[Discardable] = []
        self._dropped = 0  # by the swap-out in progress
        self._dropping: list[Discardable] = []  # the marks as it began
        target = limit if host_bytes is None else host_bytes
        self.host = HostBuffers(driver, self.piece_bytes, round_up(target, self.piece_bytes))
        # The allocator writes a byte here after each allocation and free (in C, without
        # the GIL); a thread reports the new figures to the node.
        self._notify_r, notify_w = os.pipe()
        os.set_blocking(notify_w, False)
        self._notify_w = notify_w
        store.notify(notify_w)
        threading.Thread(target=self._watch, name="gpushare-alloc", daemon=True).start()
        self._grow_cb: Any = None
        self.set_grow(hooks.grow)

    def figures(self) -> tuple[int, int, int]:
        """Resident, swapped and discarded bytes: gpushare's own and the foreign pool's
        (its list walked once)."""
        f = self.foreign()
        own = self.store.resident, self.store.swapped, self.store.discarded
        if f is None:
            return own
        theirs = f.figures()
        if sum(own) + sum(theirs) > self.limit and not self._over_said:
            # Past the limit the node would refuse the session's figures (a release, a
            # swap's end) and the invariant could not hold: the process stops, saying why.
            self._over_said = True
            self.past_limit(
                f"gpushare: error: vLLM's sleep-mode memory ({sum(theirs)} bytes) and"
                f" gpushare's ({sum(own)}) pass this process's memory limit ({self.limit}"
                f" bytes), and gpushare cannot refuse vLLM's allocations: stopped."
                f" {self.limit_fix()}"
            )
        return own[0] + theirs[0], own[1] + theirs[1], own[2] + theirs[2]

    @property
    def resident_bytes(self) -> int:
        return self.figures()[0]

    def limit_fix(self) -> str:
        """The fix for a foreign pool past the limit, as a user would apply it."""
        return (
            "Start vLLM with --gpu-memory-utilization low enough that the model and its KV"
            " cache fit within the limit"
        )

    @property
    def swapped_bytes(self) -> int:
        return self.figures()[1]

    @property
    def discarded_bytes(self) -> int:
        return self.figures()[2]

    def discardable(
        self, va: int, size: int, still: Callable[[], bool] | None = None
    ) -> Discardable:
        """Mark ``[va, va + size)`` (memory of this backend's) as a cache the workload
        can rebuild. Only whole pieces within it are marked (a piece it shares with other
        memory is copied as ever): :attr:`Discardable.bytes` says how much."""
        if size <= 0:
            raise ValueError("a discardable range needs a positive size")
        with self._lock:
            d = Discardable(va, size, self.store.mark(va, size, True), still=still)
            self._marks.append(d)
        return d

    def keep(self, d: Discardable) -> None:
        """``d`` is no longer discardable (its memory is freed, or holds what cannot be
        rebuilt): copied like the rest from now on."""
        with self._lock:
            if d in self._marks:
                self._marks.remove(d)
                self.store.mark(d.va, d.size, False)
                for other in self._marks:  # a piece it shared with another mark stays his
                    self.store.mark(other.va, other.size, True)

    def set_grow(self, grow: Callable[[int], None]) -> None:
        """The session's grow hook (:class:`SwapHooks`): an allocation past the grant's
        bound is a safe point, as on a simulated GPU, so the library asks before it
        allocates; with none (a backend alone), it asks nobody."""
        self.grow = grow
        if grow is NO_HOOKS.grow:
            if self._grow_cb is not None:
                self.store.on_grow(None)
            self._grow_cb = None
        elif self._grow_cb is None:
            self._grow_cb = self.store.on_grow(self._before_alloc)

    def _before_alloc(self, nbytes: int) -> None:
        """From the allocator library, on the allocating thread, before ``nbytes`` more:
        past the grant's bound the session yields (its GPU work waited for) and asks the
        node again, and the allocation goes on once that fits. Never raises into C: a
        failure to ask is logged, and the allocation goes on within the limit."""
        try:
            f = self.foreign()
            theirs = sum(f.figures()) if f is not None else 0
            own = self.store.resident + self.store.swapped + self.store.discarded
            self.grow(own + theirs + nbytes)
        except BaseException as e:  # nothing may reach the C caller
            log.warning("gpushare: asking for room before an allocation failed: %s", e)

    def _watch(self) -> None:
        while True:
            try:
                if not os.read(self._notify_r, 4096):
                    return
            except OSError:
                return
            self.on_change()
            time.sleep(self.progress_every_s)  # allocations in a burst: one report

    # --- the allocator (PyTorch goes through the library itself) ---------------------

    def allocate(self, size: int) -> int:
        """A new range of at least ``size`` bytes; its address. Raises
        :class:`~gpushare.errors.OutOfMemoryError` past the session's limit,
        :class:`SwapError` when the GPU has no room for it."""
        if size <= 0:
            raise ValueError("allocation size must be positive")
        return self.store.alloc(size)

    def free(self, va: int) -> None:
        self.store.free(va)

    # --- swapping ----------------------------------------------------------------------

    def _event(self) -> int:
        # DEPTH batches at most are in flight, so the next of DEPTH + 1 events is free.
        ev = self._events[self._next_event]
        self._next_event = (self._next_event + 1) % len(self._events)
        return ev

    def _take_back_host(self) -> None:
        for addr in self.store.returned():
            self.host.give(addr)

    def _drain_stream(self) -> bool:
        """Wait for every copy queued on the stream (before memory or buffers they touch
        go back): an event, else the stream, else the whole context. Whether it did."""
        with contextlib.suppress(SwapError):
            if self._events:
                ev = self._event()
                self.driver.record(ev, self._stream)
                self.driver.wait(ev)
                return True
        with contextlib.suppress(SwapError):
            self.driver.sync_stream(self._stream)
            return True
        with contextlib.suppress(SwapError):
            self.driver.synchronize()
            return True
        log.error("waiting for gpushare's copies failed: their memory stays mapped")
        return False

    def _destroy_stream_and_events(self) -> None:
        """Each given back on its own (one failing leaves the others to go); the caller's
        context current."""
        if self._stream:
            self._drain_stream()  # nothing of ours still runs on it
        for ev in self._events:
            give_back(self.driver.destroy_event, ev)
        self._events = []
        if self._stream:
            give_back(self.driver.destroy_stream, self._stream)
            self._stream = 0

    def synchronize(self) -> None:
        """The caller's GPU work is waited for by the torch backend; here, nothing."""

    def _pipeline(
        self,
        todo: deque[Piece],
        inflight: deque[tuple[deque[tuple[Piece, int]], list[int]]],
        issue: Callable[[Piece, deque[tuple[Piece, int]]], None],
        retire: Callable[[deque[tuple[Piece, int]], list[int]], int],
    ) -> int:
        """Copies in batches (one piece, or small ones up to a piece's size), DEPTH
        batches in flight, one event each: ``issue`` puts a piece in its batch and starts
        its copy, ``retire`` finishes a batch whose copies are done. A failure leaves the
        batches in ``inflight`` and the pieces not started in ``todo`` for the caller."""
        moved = 0
        while todo or inflight:
            if not todo or len(inflight) >= DEPTH:
                moved += retire(*inflight[0])
                inflight.popleft()
                continue
            batch: deque[tuple[Piece, int]] = deque()
            ev: list[int] = []
            inflight.append((batch, ev))
            size = 0
            while todo and (not batch or size + todo[0].size <= self.piece_bytes):
                size += todo[0].size
                issue(todo[0], batch)
                todo.popleft()
            ev.append(self._event())
            self.driver.record(ev[0], self._stream)
        return moved

    def swap_out(self, nbytes: int) -> SwapResult:
        """Move pieces (the most recently allocated first) to host memory until at least
        ``nbytes`` went, freeing each on the GPU as its copy is done; then, if that was
        not enough, the foreign pool (all of it)."""
        r = self._swap_out_own(nbytes)
        f = self.foreign()
        if f is None or r.bytes + r.discarded >= nbytes or f.resident_bytes == 0:
            return r
        with self._lock:
            o = f.swap_out()
        self.on_change()
        return SwapResult(r.bytes + o.bytes, r.seconds + o.seconds, r.discarded + o.discarded)

    def _swap_out_own(self, nbytes: int) -> SwapResult:

        def issue(p: Piece, batch: deque[tuple[Piece, int]]) -> None:
            if p.discard:  # dropped, not copied (no host buffer): the workload rebuilds it
                batch.append((p, 0))
                return
            buf = self.host.take(p.size)
            try:
                self.driver.copy_dtoh(buf, p.va, p.size, self._stream)
            except BaseException:  # not queued: p stays in todo, its buffer goes back
                self.host.give(buf)
                raise
            batch.append((p, buf))

        with self._lock, self.driver.context():
            self.store.retry()
            self._take_back_host()
            for d in [d for d in self._marks if not _still(d)]:
                self.keep(d)  # no longer the memory marked: copied like the rest
            t0 = time.perf_counter()
            self._dropped = 0
            self._dropping = list(self._marks)  # a mark given up meanwhile still hears
            todo = deque(self.store.claim_out(nbytes))
            inflight: deque[tuple[deque[tuple[Piece, int]], list[int]]] = deque()
            try:
                moved = self._pipeline(todo, inflight, issue, self._retire_out)
            except BaseException:
                # copies issued are done before their buffers go back (if not known
                # done, the buffers are kept out of use)
                drained = self._drain_stream()
                for batch, _ in inflight:  # not freed: they stay resident
                    for p, buf in batch:
                        if buf and drained:
                            self.host.give(buf)
                        self.store.settle(p, p.handle, p.host)
                for p in todo:
                    self.store.settle(p, p.handle, p.host)
                raise
            return SwapResult(moved, time.perf_counter() - t0, self._dropped)

    def _retire_out(self, batch: deque[tuple[Piece, int]], ev: list[int]) -> int:
        self.driver.wait(ev[0])
        moved = 0
        while batch:
            p, buf = batch[0]
            self.driver.unmap(p.va, p.size)  # raises: p is still mapped, and kept
            batch.popleft()
            try:
                self.driver.release(p.handle)
            except SwapError as e:  # unmapped, its bytes on the host: out, released later
                log.error("releasing swapped-out GPU memory failed (tried again later): %s", e)
                self.store.defer_release(p.handle, p.size)
            self.store.settle(p, 0, buf)
            if buf:
                moved += p.size
            else:
                self._dropped += p.size
                for d in self._dropping:
                    if d.va <= p.va < d.va + d.size:
                        d.drops += 1
            self.progress()
        return moved

    def swap_in(self) -> SwapResult:
        """Bring every swapped piece back to its address, in allocation order, each
        once the node has room for it; then the foreign pool, once there is room for
        all of it."""
        r = self._swap_in_own()
        f = self.foreign()
        if f is None or not (f.swapped_bytes or f.discarded_bytes):
            return r
        with self._lock:
            o = f.swap_in(lambda n: self.room_for(self.store.resident + f.resident_bytes + n))
        self.on_change()
        return SwapResult(r.bytes + o.bytes, r.seconds + o.seconds)

    def _swap_in_own(self) -> SwapResult:
        inflight: deque[tuple[deque[tuple[Piece, int]], list[int]]] = deque()
        waited = 0.0

        def issue(p: Piece, batch: deque[tuple[Piece, int]]) -> None:
            nonlocal waited
            pending = sum(q.size for b, _ in inflight for q, _ in b)  # mapped, not settled
            waited += self.room_for(self.store.resident + pending + p.size)
            h = self.driver.create(p.size)
            try:
                self.driver.map(p.va, p.size, h)
            except BaseException:
                with contextlib.suppress(SwapError):
                    self.driver.release(h)  # never mapped
                raise
            try:
                if p.dropped:  # made again, empty (new memory holds what was there before)
                    self.driver.zero(p.va, p.size, self._stream)
                else:
                    self.driver.copy_htod(p.va, p.host, p.size, self._stream)
            except BaseException:  # not queued: unmapped again, p stays in todo
                with contextlib.suppress(SwapError):
                    self.driver.unmap(p.va, p.size)
                with contextlib.suppress(SwapError):
                    self.driver.release(h)
                raise
            batch.append((p, h))

        with self._lock, self.driver.context():
            self.store.retry()
            self._take_back_host()
            t0 = time.perf_counter()
            todo = deque(self.store.claim_in())
            try:
                moved = self._pipeline(todo, inflight, issue, self._retire_in)
            except BaseException:
                self._undo_in(inflight, todo)
                raise
            return SwapResult(moved, time.perf_counter() - t0 - waited)  # not transfer time

    def _undo_in(
        self, inflight: deque[tuple[deque[tuple[Piece, int]], list[int]]], todo: deque[Piece]
    ) -> None:
        """A swap-in failed: the pieces mapped are kept, once their copies are done; those
        not begun stay on the host."""
        drained = self._drain_stream()
        for batch, _ in inflight:
            for p, h in batch:
                if drained and p.host:  # else a copy may still read it: kept out of use
                    self.host.give(p.host)
                self.store.settle(p, h, 0)
        for p in todo:
            self.store.settle(p, 0, p.host)
        self.on_change()

    def _retire_in(self, batch: deque[tuple[Piece, int]], ev: list[int]) -> int:
        self.driver.wait(ev[0])
        moved = 0
        while batch:
            p, h = batch.popleft()
            if p.host:
                self.host.give(p.host)
            if not p.dropped:
                moved += p.size
            self.store.settle(p, h, 0)
            self.progress()
        return moved

    def wait_for_host_buffers(self, timeout: float | None = None) -> bool:
        """Block until the background pinning is done (benchmarks, tests)."""
        return self.host.ready.wait(timeout)

    def close(self) -> None:
        """Detach: the host buffers, the stream and the events go back to the driver
        (a workload that attaches again, or keeps running, holds none of them)."""
        self.set_grow(NO_HOOKS.grow)
        close = getattr(self.foreign, "close", None)  # a finder's: vLLM's calls its own again
        if close is not None:
            close()
        self.store.notify(-1)
        with contextlib.suppress(OSError):
            os.close(self._notify_w)  # the watching thread ends
        self.host.close()
        with self._lock, contextlib.suppress(SwapError), self.driver.context():
            self._destroy_stream_and_events()
            self.store.retry()

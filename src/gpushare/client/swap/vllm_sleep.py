"""vLLM's sleep-mode memory, swapped through vLLM's own allocator.

With ``--enable-sleep-mode`` vLLM allocates the weights and the KV cache through an
allocator of its own (``vllm.device_allocator.cumem.CuMemAllocator``, a process-wide
singleton whose C extension calls the driver: ``cuMemCreate``/``cuMemMap``), past
gpushare's allocator library. Its ``sleep(offload_tags)`` copies the allocations of those
tags to host memory and unmaps and releases every allocation (the others' contents are
lost); ``wake_up(tags)`` maps new memory at the same addresses and copies back what was
kept. This module makes that memory a part of the session:

* counted: its mapped bytes are resident, the copies it keeps on the host swapped, the
  allocations it dropped discarded, in every report;
* taken back: a swap-out the node asks for puts the allocator to sleep with every tag
  kept (weights and KV cache copied: the engine may be mid-request, and only vLLM's
  scheduler can tell whether its KV cache may be lost), and the swap-in wakes it;
* ahead: vLLM's sleep copies into pinned host memory it asks PyTorch for then, and
  pinning runs at about 1 GiB/s; as its allocations appear, host memory of their sizes is
  pinned and let go in the background (``prepin``), so PyTorch's cache of pinned memory
  holds it when the sleep asks (it keeps what a wake frees for the next sleep);
* watched: vLLM's own ``/sleep`` (level 1: weights kept, KV cache dropped after vLLM
  reset its prefix cache) and ``/wake_up`` are seen as they happen, so memory an
  operator put to sleep is free for others in the node's books, and a wake first waits
  for the session's lease and the room it needs (:attr:`SwapHooks.hold`, ``grow``).

Nothing of vLLM is imported here: the allocator is found in ``sys.modules`` once vLLM
made it, and used through the names vLLM gives it (:class:`CuMemAllocatorLike`).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from gpushare.client.swap.base import SwapResult

log = logging.getLogger("gpushare.client.swap")

MODULE = "vllm.device_allocator.cumem"


class AllocationDataLike(Protocol):
    """vLLM's ``AllocationData``: ``handle`` is ``(device, size, address, handle)``."""

    handle: tuple[int, int, int, int]
    tag: str
    cpu_backup_tensor: Any  # a host copy while asleep (an offloaded tag), else None


class CuMemAllocatorLike(Protocol):
    pointer_to_data: dict[int, AllocationDataLike]

    def sleep(self, offload_tags: tuple[str, ...] | str | None = None) -> None: ...
    def wake_up(self, tags: list[str] | None = None) -> None: ...


def find_allocator(modules: Mapping[str, Any] | None = None) -> CuMemAllocatorLike | None:
    """vLLM's sleep-mode allocator in this process, once it holds memory; else None."""
    mod = (sys.modules if modules is None else modules).get(MODULE)
    cls = getattr(mod, "CuMemAllocator", None)
    inst = getattr(cls, "instance", None)
    if inst is None or not getattr(inst, "pointer_to_data", None):
        return None
    return inst  # type: ignore[no-any-return]


def _size(data: AllocationDataLike) -> int:
    return int(data.handle[1])


class SleepModePool:
    """One process's vLLM sleep-mode memory (see the module doc). ``on_change`` is told
    when vLLM's own sleep or wake changed the figures; before vLLM's own wake, ``hold()``
    blocks until the session holds the GPU, and ``grow(total)`` until it may have
    ``total`` bytes of this pool resident."""

    def __init__(
        self,
        allocator: CuMemAllocatorLike,
        on_change: Callable[[], None],
        grow: Callable[[int], None],
        prepin: Callable[[list[int]], None] | None = None,
        hold: Callable[[], None] = lambda: None,
    ) -> None:
        self.allocator = allocator
        self.on_change = on_change
        self.grow = grow
        self.hold = hold
        self.prepin = prepin
        self._pinned: set[int] = set()  # addresses whose host memory was pinned ahead
        self._pinning: threading.Thread | None = None
        self._lock = threading.RLock()
        self._out: dict[int, bool] = {}  # address -> kept on the host (else dropped)
        self.ours = False  # asleep because gpushare put it to sleep (it wakes it too)
        self._sleep, self._wake = allocator.sleep, allocator.wake_up
        # vLLM's worker calls these on the instance: theirs go through us from now on.
        allocator.sleep = self._vllm_sleep  # type: ignore[method-assign]
        allocator.wake_up = self._vllm_wake  # type: ignore[method-assign]

    # --- the figures ------------------------------------------------------------------

    def _items(self) -> list[tuple[int, AllocationDataLike]]:
        return list(self.allocator.pointer_to_data.items())  # vLLM's frees may run beside

    @property
    def resident_bytes(self) -> int:
        items = self._items()
        self._pin_ahead(items)
        return sum(_size(d) for a, d in items if a not in self._out)

    def _pin_ahead(self, items: list[tuple[int, AllocationDataLike]]) -> None:
        """Pin host memory for allocations new since the last look, off this thread."""
        if self.prepin is None or len(self._pinned) == len(items):
            return
        if self._pinning is not None and self._pinning.is_alive():
            return  # the next look takes what it did not
        new = [(a, _size(d)) for a, d in items if a not in self._pinned]
        if not new:
            return
        self._pinned.update(a for a, _ in new)
        prepin = self.prepin
        self._pinning = threading.Thread(
            target=prepin, args=([n for _, n in new],), name="gpushare-prepin", daemon=True
        )
        self._pinning.start()

    @property
    def swapped_bytes(self) -> int:
        return sum(_size(d) for a, d in self._items() if self._out.get(a) is True)

    @property
    def discarded_bytes(self) -> int:
        return sum(_size(d) for a, d in self._items() if self._out.get(a) is False)

    @property
    def asleep(self) -> bool:
        return bool(self._out)

    # --- gpushare's swaps -------------------------------------------------------------

    def swap_out(self) -> SwapResult:
        """Put the allocator to sleep with every tag kept (nothing lost); nothing if any
        of it is asleep already (vLLM's sleep unmaps all it holds: only vLLM may put
        back what it took)."""
        with self._lock:
            items = self._items()
            if self._out or not items:
                return SwapResult(0, 0.0)
            tags = tuple(sorted({d.tag for _, d in items}))
            t0 = time.perf_counter()
            self._sleep(offload_tags=tags)
            self._settled_out()
            self.ours = True
            return SwapResult(self.swapped_bytes, time.perf_counter() - t0)

    def swap_in(self, room: Callable[[int], float]) -> SwapResult:
        """Wake what gpushare put to sleep, once ``room`` allowed it (``room(bytes)``
        waits and returns the seconds waited). What vLLM put to sleep stays asleep:
        vLLM wakes it, and its scheduler with it."""
        with self._lock:
            if not self.ours:
                return SwapResult(0, 0.0)
            back = self.swapped_bytes + self.discarded_bytes
            waited = room(back)
            t0 = time.perf_counter()
            self._wake(tags=None)
            self._out.clear()
            self.ours = False
            return SwapResult(back, time.perf_counter() - t0 - waited)

    def _settled_out(self) -> None:
        self._out = {a: d.cpu_backup_tensor is not None for a, d in self._items()}

    # --- vLLM's own sleep and wake ----------------------------------------------------

    def _vllm_sleep(self, *args: Any, **kwargs: Any) -> None:
        with self._lock:
            if self._out:  # gpushare's sleep: the memory is on the host already
                if self.ours:
                    # vLLM asks for the sleep it would have had: the copies stay (more
                    # than it asked to keep, never less).
                    self.ours = False
                    log.info("gpushare: vLLM's sleep came while gpushare had it asleep")
                return
            self._sleep(*args, **kwargs)
            self._settled_out()
        self.on_change()

    def _vllm_wake(self, *args: Any, **kwargs: Any) -> None:
        tags = kwargs.get("tags", args[0] if args else None)
        back = {a: _size(d) for a, d in self._items() if a in self._out}
        back = {a: n for a, n in back.items() if tags is None or self._tag(a) in tags}
        if back:
            # Memory back on the GPU, and copies to it, are GPU work: within a lease, and
            # within its bound. Outside the lock: the wait may see a revoke, whose
            # swap-out takes it.
            self.hold()
            self.grow(self.resident_bytes + sum(back.values()))
        with self._lock:
            self._wake(*args, **kwargs)
            for a in back:
                self._out.pop(a, None)
            if not self._out:
                self.ours = False
        self.on_change()

    def _tag(self, address: int) -> str:
        d = self.allocator.pointer_to_data.get(address)
        return "" if d is None else d.tag

    def close(self) -> None:
        """The session ends: vLLM's calls go to its allocator alone again."""
        a = self.allocator
        if a.sleep == self._vllm_sleep:
            del a.sleep
        if a.wake_up == self._vllm_wake:
            del a.wake_up


class SleepModeFinder:
    """Finds vLLM's allocator once vLLM made it (it does so after the session attached)
    and keeps one :class:`SleepModePool` for it."""

    def __init__(
        self,
        on_change: Callable[[], None],
        grow: Callable[[int], None],
        modules: Mapping[str, Any] | None = None,
        prepin: Callable[[list[int]], None] | None = None,
        hold: Callable[[], None] = lambda: None,
    ) -> None:
        self._args = on_change, grow, prepin, hold
        self._modules = modules
        self.pool: SleepModePool | None = None

    def __call__(self) -> SleepModePool | None:
        if self.pool is None:
            a = find_allocator(self._modules)
            if a is not None:
                self.pool = SleepModePool(a, *self._args)
                log.info(
                    "gpushare: vLLM's sleep-mode memory (%d bytes so far) is swapped"
                    " through vLLM's allocator",
                    self.pool.resident_bytes,
                )
        return self.pool

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()

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

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

from gpushare.client.swap.base import SwapResult
from gpushare.errors import SwapError

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


class _Shown:
    """vLLM's list of allocations as one sleep or wake of vLLM's sees it when gpushare
    calls it: only the allocations that call may touch, from a list taken once (vLLM's
    malloc and free callbacks, bound to the allocator itself, go on changing the real
    one meanwhile), those handed out noted (a failed sleep stopped at the last)."""

    def __init__(self, whole: dict[int, Any], only: set[int]) -> None:
        self.whole, self.only = whole, frozenset(only)
        self.handed: list[int] = []  # in order: all but the last were done with

    def items(self) -> Iterator[tuple[int, Any]]:
        for a, d in list(self.whole.items()):
            if a in self.only:
                self.handed.append(a)
                yield a, d

    def __getitem__(self, a: int) -> Any:
        return self.whole[a]

    def __contains__(self, a: object) -> bool:
        return a in self.whole

    def pop(self, a: int, *default: Any) -> Any:
        return self.whole.pop(a, *default)


class _Caller:
    """The allocator as its own ``sleep`` or ``wake_up`` sees it in a call of ours:
    itself in every name but ``pointer_to_data``, which is :class:`_Shown`."""

    def __init__(self, allocator: Any, shown: _Shown) -> None:
        self._allocator = allocator
        self.pointer_to_data = shown

    def __getattr__(self, name: str) -> Any:
        return getattr(self._allocator, name)


class SleepModePool:
    """One process's vLLM sleep-mode memory (see the module doc). ``on_change`` is told
    when vLLM's own sleep or wake changed the figures; before vLLM's own wake, ``hold()``
    blocks until the session holds the GPU, and ``grow(total)`` until it may have
    ``total`` bytes of this pool resident.

    vLLM's ``sleep`` unmaps *every* allocation it lists and ``wake_up`` maps every one
    of its tags, whatever each one's state: each call, gpushare's and vLLM's own, is
    shown only the allocations it may touch (:class:`_Shown`), so that nothing is
    mapped twice or unmapped twice, whatever the order of sleeps, wakes by tag and new
    allocations. After a call that failed, what is out is judged from where it stopped
    and vLLM's host copies: a failed sleep was done with the allocations before the one
    it was at (each out, kept if copied, dropped if not), the rest still mapped; a failed
    wake unmapped what it mapped, so each of its allocations is out, kept where its copy
    is still there, dropped where vLLM had let it go."""

    def __init__(
        self,
        allocator: CuMemAllocatorLike,
        on_change: Callable[[], None],
        grow: Callable[[int], None],
        prepin: Callable[[list[int]], None] | None = None,
        hold: Callable[[], None] = lambda: None,
        holding: Callable[[], bool] = lambda: True,
        mapped: Callable[[int], bool] | None = None,
    ) -> None:
        self.allocator = allocator
        # Asks the driver whether an address is mapped: where vLLM failed part way.
        self.mapped = mapped
        self.holding = holding
        self.on_change = on_change
        self.grow = grow
        self.hold = hold
        self.prepin = prepin
        self._pinned: set[int] = set()  # addresses whose host memory was pinned ahead
        self._pinning: threading.Thread | None = None
        self._looking = threading.Lock()
        self._lock = threading.RLock()
        # Address -> kept on the host (True) or dropped (False). A vLLM sleep before the
        # pool was made shows in its host copies (what it dropped then cannot be seen).
        self._out: dict[int, bool] = {
            a: True for a, d in self._items() if d.cpu_backup_tensor is not None
        }
        self._ours: set[int] = set()  # put to sleep by gpushare, which wakes them
        # vLLM's own functions, called with a :class:`_Caller` for the allocator.
        self._sleep, self._wake = type(allocator).sleep, type(allocator).wake_up
        # vLLM's worker calls these on the instance: theirs go through us from now on.
        allocator.sleep = self._vllm_sleep  # type: ignore[method-assign]
        allocator.wake_up = self._vllm_wake  # type: ignore[method-assign]

    # --- the figures ------------------------------------------------------------------

    def _items(self) -> list[tuple[int, AllocationDataLike]]:
        return list(self.allocator.pointer_to_data.items())  # one C call under the GIL

    def figures(self) -> tuple[int, int, int]:
        """Resident, swapped (kept on the host) and discarded bytes, in one walk of
        vLLM's list (a report reads all three)."""
        with self._look() as pin:
            items = self._items()
            if pin:
                self._pin_ahead(items)
        held = [0, 0, 0]
        for a, d in items:
            out = self._out.get(a)
            held[0 if out is None else 1 if out else 2] += _size(d)
        return held[0], held[1], held[2]

    @property
    def resident_bytes(self) -> int:
        return self.figures()[0]

    @property
    def swapped_bytes(self) -> int:
        return self.figures()[1]

    @property
    def discarded_bytes(self) -> int:
        return self.figures()[2]

    @contextlib.contextmanager
    def _look(self) -> Iterator[bool]:
        """Whether this look pins ahead: one thread's at a time (two would pin the same
        memory twice), its list taken within it (an older list would forget what a newer
        one had pinned)."""
        pin = self.prepin is not None and self._looking.acquire(blocking=False)
        try:
            yield pin
        finally:
            if pin:
                self._looking.release()

    def _pin_ahead(self, items: list[tuple[int, AllocationDataLike]]) -> None:
        """Pin host memory for allocations new since the last look, off this thread."""
        if self.prepin is None:
            return
        if self._pinning is not None and self._pinning.is_alive():
            return  # the next look takes what it did not
        now = {a for a, _ in items}
        self._pinned &= now  # a freed allocation's address may come back, another size
        new = [(a, _size(d)) for a, d in items if a not in self._pinned]
        if not new:
            return
        self._pinned.update(a for a, _ in new)
        self._pinning = threading.Thread(
            target=self.prepin, args=([n for _, n in new],), name="gpushare-prepin", daemon=True
        )
        self._pinning.start()

    def _prune(self) -> None:
        """Forget allocations vLLM freed (its free callback takes them off its list)."""
        d = self.allocator.pointer_to_data
        for a in [a for a in self._out if a not in d]:
            del self._out[a]
        self._ours &= set(self._out)

    def _shown(self, addresses: set[int]) -> _Shown:
        return _Shown(self.allocator.pointer_to_data, addresses)

    def _call(self, fn: Callable[..., None], shown: _Shown, *args: Any, **kw: Any) -> None:
        """vLLM's ``fn`` (its sleep or wake_up) shown only ``shown`` (the lock held)."""
        fn(_Caller(self.allocator, shown), *args, **kw)

    def _judge(self, shown: _Shown, done: bool) -> None:
        """After a sleep: each allocation it was done with is out, kept if vLLM has a
        host copy of it, dropped if not; if it failed, the one it was at is still mapped
        (vLLM copies, then unmaps), as are those it did not reach."""
        finished = shown.handed if done else shown.handed[:-1]
        if not done and shown.handed and self.mapped is not None:
            with contextlib.suppress(Exception):  # unknown: taken as still mapped
                if not self.mapped(shown.handed[-1]):  # it failed after its unmap
                    finished = shown.handed
        for a in finished:
            d = self.allocator.pointer_to_data.get(a)
            if d is not None:
                self._out[a] = d.cpu_backup_tensor is not None

    def _wake_each(self, addresses: set[int], *args: Any, **kwargs: Any) -> None:
        """vLLM's wake, called for one allocation at a time (in vLLM's order): on a
        failure vLLM unmaps what that call mapped, and a call that mapped one only
        loses no copy it had already let go of (one call over all of them would lose
        every copy restored before the failure). Each judged as it ends."""
        for a in [a for a, _ in self._items() if a in addresses]:
            try:
                self._call(self._wake, self._shown({a}), *args, **kwargs)
            except BaseException:
                self._woken({a}, done=False)
                raise
            self._woken({a}, done=True)

    def _woken(self, tried: set[int], done: bool) -> None:
        """After a wake over ``tried``: all mapped if it finished; if it failed, vLLM
        unmapped what it had mapped, so each is out: kept if its copy is still there,
        dropped if not (a copy it had let go of is lost)."""
        for a, d in self._items():
            if a not in tried:
                continue
            if done:
                self._out.pop(a, None)
                self._ours.discard(a)
            else:
                kept = d.cpu_backup_tensor is not None
                if not kept and self._out.get(a) is True:
                    log.error(
                        "gpushare: vLLM's wake failed after it let go of the host copy of"
                        " %d bytes at %#x: that memory comes back empty",
                        _size(d),
                        a,
                    )
                self._out[a] = kept

    # --- gpushare's swaps -------------------------------------------------------------

    def swap_out(self) -> SwapResult:
        """Put what is mapped to sleep with every tag kept (nothing lost)."""
        with self._lock:
            self._prune()
            mapped = {a: d for a, d in self._items() if a not in self._out}
            if not mapped:
                return SwapResult(0, 0.0)
            tags = tuple(sorted({d.tag for d in mapped.values()}))
            t0 = time.perf_counter()
            shown = self._shown(set(mapped))
            try:
                self._call(self._sleep, shown, offload_tags=tags)
            except Exception as e:
                self._judge(shown, done=False)
                self._ours |= set(mapped) & set(self._out)
                raise SwapError(f"vLLM's allocator could not sleep: {e}") from e
            self._judge(shown, done=True)
            self._ours |= set(mapped) & set(self._out)
            return SwapResult(sum(_size(d) for d in mapped.values()), time.perf_counter() - t0)

    def swap_in(self, room: Callable[[int], float]) -> SwapResult:
        """Wake what gpushare put to sleep, once ``room`` allowed it (``room(bytes)``
        waits and returns the seconds waited). What vLLM put to sleep stays asleep:
        vLLM wakes it, and its scheduler with it. The wait is outside the lock, so a
        sleep or wake of vLLM's meanwhile is not held up by the node (what is left to
        wake is looked at again after it)."""
        allowed = -1
        while True:
            with self._lock:
                self._prune()
                mine = {a: d for a, d in self._items() if a in self._ours}
                if not mine:
                    return SwapResult(0, 0.0)
                back = sum(_size(d) for d in mine.values())
                if back <= allowed:
                    t0 = time.perf_counter()
                    try:
                        self._wake_each(set(mine), tags=None)
                    except Exception as e:
                        raise SwapError(f"vLLM's allocator could not wake: {e}") from e
                    return SwapResult(back, time.perf_counter() - t0)
            room(back)
            allowed = back

    # --- vLLM's own sleep and wake ----------------------------------------------------

    def _vllm_sleep(self, *args: Any, **kwargs: Any) -> None:
        with self._lock:
            self._prune()
            mapped = {a for a, _ in self._items() if a not in self._out}
            shown = self._shown(mapped)
            try:
                self._call(self._sleep, shown, *args, **kwargs)
            except BaseException:
                self._judge(shown, done=False)
                raise
            self._judge(shown, done=True)
            # What gpushare put to sleep is vLLM's to wake from now on (its copies kept:
            # more than vLLM asked to keep, never less).
            self._ours.clear()
        self.on_change()

    def _asleep(self, tags: Any) -> dict[int, int]:
        return {
            a: _size(d)
            for a, d in self._items()
            if a in self._out and (tags is None or d.tag in tags)
        }

    def _vllm_wake(self, *args: Any, **kwargs: Any) -> None:
        tags = kwargs.get("tags", args[0] if args else None)
        allowed = -1
        while True:
            with self._lock:
                self._prune()
                back = self._asleep(tags)
                need = self.resident_bytes + sum(back.values())
                # The lease may have gone since the wait (a revoke, the idle release).
                if not back or (need <= allowed and self.holding()):
                    # Never a mapped one: vLLM would map it again.
                    self._wake_each(set(back), *args, **kwargs)
                    break
            # Memory back on the GPU, and copies to it, are GPU work: within a lease, and
            # within its bound. Outside the lock: the wait may see a revoke, whose
            # swap-out takes it (then there is more to wake: asked again).
            self.hold()
            self.grow(need)
            allowed = need
        self.on_change()

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
        holding: Callable[[], bool] = lambda: True,
        mapped: Callable[[int], bool] | None = None,
    ) -> None:
        self._args = on_change, grow, prepin, hold, holding, mapped
        self._modules = modules
        self._lock = threading.Lock()
        self.pool: SleepModePool | None = None

    def __call__(self) -> SleepModePool | None:
        if self.pool is not None:
            return self.pool
        with self._lock:  # one pool: a second would wrap vLLM's calls twice
            a = None if self.pool is not None else find_allocator(self._modules)
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

"""vLLM's sleep-mode memory counted and swapped with the session's own (the allocator as
vLLM has it, over the fake libcuda: :mod:`.fake_vllm`)."""

from __future__ import annotations

import ctypes
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from gpushare.client.swap import vllm_sleep
from gpushare.client.swap.base import SwapHooks
from gpushare.client.swap.vllm_sleep import SleepModeFinder, SleepModePool, find_allocator
from gpushare.client.swap.vmm import VmmBackend
from gpushare.errors import SwapError

from . import fake_vllm
from .conftest import GRANULE, FakeGpu

PIECE = GRANULE


class Told:
    """What the pool told its session: changes, and the lease and growth asked before a
    wake (with the GPU's physical bytes at the time, to show the waits came first)."""

    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu = gpu
        self.changes = 0
        self.grows: list[tuple[int, int]] = []
        self.holds: list[int] = []
        self.rooms: list[int] = []

    def on_change(self) -> None:
        self.changes += 1

    def grow(self, total: int) -> None:
        self.grows.append((total, self.gpu.physical_bytes))

    def hold(self) -> None:
        self.holds.append(self.gpu.physical_bytes)

    def wait_room(self, resident: int) -> None:
        self.rooms.append(resident)


def put(va: int, n: int, seed: int) -> bytes:
    data = random.Random(seed).randbytes(n)
    ctypes.memmove(va, data, n)  # what the model's kernels write
    return data


def engine(
    gpu: FakeGpu, limit: int = 64 * PIECE
) -> tuple[VmmBackend, fake_vllm.CuMemAllocator, Told]:
    """A session's backend whose process then made vLLM's allocator (as vLLM's worker
    does after the session attached), holding weights and a KV cache."""
    told = Told(gpu)
    mods, alloc = fake_vllm.modules(str(gpu.libcuda))
    finder = SleepModeFinder(
        told.on_change, told.grow, modules=mods, hold=told.hold, mapped=gpu.driver.mapped
    )
    hooks = SwapHooks(on_change=told.on_change, wait_room=told.wait_room)
    b = gpu.backend(limit=limit, hooks=hooks, foreign=finder)
    return b, alloc, told


def bare(
    gpu: FakeGpu, prepin: Callable[[list[int]], None] | None = None, **backend: Any
) -> tuple[VmmBackend, fake_vllm.CuMemAllocator, SleepModeFinder]:
    """A backend whose process made vLLM's allocator, with nothing listening to it."""
    mods, alloc = fake_vllm.modules(str(gpu.libcuda))
    finder = SleepModeFinder(lambda: None, lambda n: None, modules=mods, prepin=prepin)
    return gpu.backend(foreign=finder, **backend), alloc, finder


def test_vllms_allocator_calls_the_driver_as_vllms_extension_does(gpu: FakeGpu):
    _, alloc = fake_vllm.modules(str(gpu.libcuda))
    gpu.cu.fake_cuda_log_clear()
    va = alloc.allocate(PIECE + 1, "weights")  # aligned up to the minimum granularity
    assert alloc.pointer_to_data[va].handle[1] == 2 * PIECE
    calls = ["cuMemAddressReserve", "cuMemCreate", "cuMemMap", "cuMemSetAccess"]
    assert [c for c in gpu.log() if c in calls] == calls  # its own, past gpushare's wrapper
    alloc.free(va)
    freed = ["cuCtxSynchronize", "cuCtxGetCurrent", "cuMemUnmap", "cuMemRelease"]
    assert gpu.log()[-5:] == [*freed, "cuMemAddressFree"]  # ensure_context before the unmap
    alive = gpu.cu.fake_cuda_alive
    alive.argtypes = [ctypes.c_char_p]
    assert [alive(w) for w in (b"handles", b"mappings", b"reservations")] == [0, 0, 0]


def test_vllms_allocator_is_found_once_it_holds_memory(gpu: FakeGpu):
    assert find_allocator({}) is None  # vLLM not loaded
    mods, alloc = fake_vllm.modules(str(gpu.libcuda))
    assert find_allocator(mods) is None  # made, nothing allocated yet
    alloc.allocate(2 * PIECE, "weights")
    assert find_allocator(mods) is alloc
    mods["vllm.device_allocator.cumem"].CuMemAllocator.instance = None
    assert find_allocator(mods) is None


def test_a_swap_out_keeps_weights_and_kv_cache_and_brings_both_back(gpu: FakeGpu):
    b, alloc, told = engine(gpu)
    own_va = b.allocate(3 * PIECE)
    own = put(own_va, 3 * PIECE, 1)
    w_va = alloc.allocate(4 * PIECE, "weights")
    kv_va = alloc.allocate(6 * PIECE, "kv_cache")
    weights, kv = put(w_va, 4 * PIECE, 2), put(kv_va, 6 * PIECE, 3)
    assert (b.resident_bytes, b.swapped_bytes) == (13 * PIECE, 0)  # vLLM's counted too
    r = b.swap_out(b.resident_bytes)
    assert (r.bytes, r.discarded) == (13 * PIECE, 0)  # nothing dropped: a request may run
    assert (b.resident_bytes, b.swapped_bytes, b.discarded_bytes) == (0, 13 * PIECE, 0)
    assert gpu.physical_bytes == 0  # vLLM's memory really released too
    told.rooms.clear()
    r = b.swap_in()
    assert r.bytes == 13 * PIECE and told.rooms[-1] == 13 * PIECE  # room for it all first
    assert (b.resident_bytes, b.swapped_bytes) == (13 * PIECE, 0)
    assert ctypes.string_at(own_va, 3 * PIECE) == own
    assert ctypes.string_at(w_va, 4 * PIECE) == weights  # same addresses, same bytes
    assert ctypes.string_at(kv_va, 6 * PIECE) == kv
    b.close()


def test_a_swap_out_that_ours_covers_leaves_vllms_memory_on_the_gpu(gpu: FakeGpu):
    b, alloc, _ = engine(gpu)
    b.allocate(3 * PIECE)
    alloc.allocate(4 * PIECE, "weights")
    r = b.swap_out(2 * PIECE)
    assert r.bytes >= 2 * PIECE
    assert (
        b.resident_bytes >= 4 * PIECE
        and not alloc.pointer_to_data[next(iter(alloc.pointer_to_data))].cpu_backup_tensor
    )
    assert gpu.physical_bytes == b.resident_bytes
    b.close()


def test_vllms_own_sleep_is_counted_and_its_wake_waits_for_room_first(gpu: FakeGpu):
    b, alloc, told = engine(gpu)
    b.allocate(2 * PIECE)
    w_va = alloc.allocate(4 * PIECE, "weights")
    alloc.allocate(6 * PIECE, "kv_cache")
    weights = put(w_va, 4 * PIECE, 4)
    assert b.resident_bytes == 12 * PIECE  # the pool found
    before = told.changes
    alloc.sleep(offload_tags=("weights",))  # vLLM's /sleep, level 1, as its worker calls it
    assert told.changes > before  # the node hears at once
    assert (b.resident_bytes, b.swapped_bytes, b.discarded_bytes) == (
        2 * PIECE,
        4 * PIECE,
        6 * PIECE,
    )
    assert gpu.physical_bytes == 2 * PIECE
    # gpushare's swaps leave what vLLM put to sleep to vLLM (its scheduler wakes with it).
    b.swap_out(b.resident_bytes)
    assert b.swapped_bytes == 6 * PIECE and b.discarded_bytes == 6 * PIECE
    b.swap_in()
    assert b.resident_bytes == 2 * PIECE and gpu.physical_bytes == 2 * PIECE
    alloc.wake_up()  # vLLM's /wake_up
    assert told.holds == [2 * PIECE]  # the lease first,
    assert told.grows == [(10 * PIECE, 2 * PIECE)]  # then room, before a byte was mapped
    assert (b.resident_bytes, b.swapped_bytes, b.discarded_bytes) == (12 * PIECE, 0, 0)
    assert ctypes.string_at(w_va, 4 * PIECE) == weights
    b.close()


class Walked(dict[int, Any]):
    """vLLM's allocation list, counting the walks over it."""

    walks = 0

    def items(self) -> Any:
        self.walks += 1
        return super().items()


def test_a_report_walks_vllms_list_once_for_all_three_figures(gpu: FakeGpu):
    b, alloc, _ = engine(gpu)
    b.allocate(2 * PIECE)
    alloc.allocate(4 * PIECE, "weights")
    alloc.allocate(6 * PIECE, "kv_cache")
    assert b.resident_bytes == 12 * PIECE  # the pool found
    alloc.sleep(offload_tags=("weights",))  # weights kept, the KV cache dropped
    b.allocate(PIECE)
    alloc.pointer_to_data = walked = Walked(alloc.pointer_to_data)
    assert b.figures() == (3 * PIECE, 4 * PIECE, 6 * PIECE)
    assert walked.walks == 1
    assert (b.resident_bytes, b.swapped_bytes, b.discarded_bytes) == b.figures()
    b.close()


def test_a_wake_by_tag_is_counted_by_tag(gpu: FakeGpu):
    b, alloc, told = engine(gpu)
    alloc.allocate(4 * PIECE, "weights")
    alloc.allocate(6 * PIECE, "kv_cache")
    assert b.resident_bytes == 10 * PIECE
    alloc.sleep(offload_tags=("weights",))
    alloc.wake_up(tags=["weights"])  # as an RL trainer does before it syncs weights
    assert told.grows[-1] == (4 * PIECE, 0)
    assert (b.resident_bytes, b.swapped_bytes, b.discarded_bytes) == (4 * PIECE, 0, 6 * PIECE)
    alloc.wake_up(tags=["kv_cache"])
    assert (b.resident_bytes, b.swapped_bytes, b.discarded_bytes) == (10 * PIECE, 0, 0)
    assert gpu.physical_bytes == 10 * PIECE
    b.close()


def test_vllms_sleep_while_gpushare_has_it_asleep_keeps_every_copy(gpu: FakeGpu):
    b, alloc, _ = engine(gpu)
    kv_va = alloc.allocate(6 * PIECE, "kv_cache")
    kv = put(kv_va, 6 * PIECE, 5)
    b.swap_out(b.resident_bytes)
    alloc.sleep(offload_tags=("weights",))  # would unmap what is unmapped: not passed on
    b.swap_in()  # vLLM's sleep now: vLLM wakes it
    assert b.resident_bytes == 0 and b.swapped_bytes == 6 * PIECE
    alloc.wake_up()
    assert ctypes.string_at(kv_va, 6 * PIECE) == kv  # kept, though vLLM would drop it
    b.close()


def test_vllms_memory_past_the_limit_stops_the_process_with_the_fix(gpu: FakeGpu):
    # The node refuses figures past the limit (a release, a swap's end), and nothing can
    # refuse vLLM's allocations: the process stops, saying why (once).
    stopped: list[str] = []
    b, alloc, _ = bare(gpu, limit=8 * PIECE, past_limit=stopped.append)
    b.allocate(2 * PIECE)
    alloc.allocate(6 * PIECE, "weights")
    assert b.resident_bytes == 8 * PIECE and not stopped  # at the limit: fine
    alloc.allocate(2 * PIECE, "kv_cache")
    assert b.resident_bytes == 10 * PIECE
    assert b.resident_bytes == 10 * PIECE
    assert len(stopped) == 1 and "--gpu-memory-utilization" in stopped[0]
    assert "stopped" in stopped[0] and str(8 * PIECE) in stopped[0]
    b.close()


def test_closing_gives_vllm_its_allocators_calls_back(gpu: FakeGpu):
    b, alloc, told = engine(gpu)
    alloc.allocate(2 * PIECE, "weights")
    assert b.resident_bytes == 2 * PIECE
    assert "sleep" in vars(alloc)  # vLLM's calls go through the pool
    b.close()
    assert "sleep" not in vars(alloc) and "wake_up" not in vars(alloc)
    before = told.changes
    alloc.sleep(offload_tags=("weights",))
    alloc.wake_up()
    assert told.changes == before


def test_host_memory_for_vllms_sleep_is_pinned_ahead_once_per_allocation(gpu: FakeGpu):
    mods, alloc = fake_vllm.modules(str(gpu.libcuda))
    asked: list[list[int]] = []
    done = threading.Event()  # set on the pinning thread

    def prepin(sizes: list[int]) -> None:
        asked.append(sizes)
        done.set()

    finder = SleepModeFinder(lambda: None, lambda n: None, modules=mods, prepin=prepin)
    b = gpu.backend(foreign=finder)
    alloc.allocate(4 * PIECE, "weights")
    assert b.resident_bytes == 4 * PIECE and done.wait(10)
    assert finder.pool is not None and finder.pool._pinning is not None
    finder.pool._pinning.join(10)
    done.clear()
    alloc.allocate(6 * PIECE, "kv_cache")  # the KV cache comes after the weights
    assert b.resident_bytes == 10 * PIECE and done.wait(10)
    assert b.resident_bytes == 10 * PIECE  # nothing new: not asked again
    finder.pool._pinning.join(10)
    assert asked == [[4 * PIECE], [6 * PIECE]]  # each allocation's size once, ahead
    b.close()


def test_readers_on_many_threads_pin_each_allocation_once(gpu: FakeGpu, monkeypatch):
    size = vllm_sleep._size

    def slow_size(d: Any) -> int:
        time.sleep(0.0005)  # each look slow: readers' looks overlap, as under load
        return size(d)

    monkeypatch.setattr(vllm_sleep, "_size", slow_size)
    mods, alloc = fake_vllm.modules(str(gpu.libcuda))
    asked: list[int] = []
    finder = SleepModeFinder(lambda: None, lambda n: None, modules=mods, prepin=asked.extend)
    b = gpu.backend(limit=256 * PIECE, foreign=finder)
    stop = threading.Event()

    def report() -> None:  # the reader thread, the allocator's watcher, the lease's
        while not stop.is_set():
            b.figures()

    readers = [threading.Thread(target=report) for _ in range(6)]
    for t in readers:
        t.start()
    sizes = [k * PIECE for k in range(1, 12)]  # each its own size, to tell them apart
    for n in sizes:
        alloc.allocate(n, "kv_cache")
        time.sleep(0.002)  # the allocations spread out among the readers' looks
    stop.set()
    for t in readers:
        t.join(10)
    assert finder.pool is not None
    for _ in range(3):  # what a look skipped while pinning ran, the next one takes
        if finder.pool._pinning is not None:
            finder.pool._pinning.join(10)
        b.figures()
    assert sorted(asked) == sizes  # every allocation pinned for, none twice
    b.close()


# --- orders of calls (each found by a review: the fake libcuda, as CUDA, refuses to map
# a mapped range or unmap an unmapped one) ------------------------------------------------


def test_a_wake_by_tag_while_gpushare_has_it_asleep_is_not_mapped_again(gpu: FakeGpu):
    b, alloc, _ = engine(gpu)
    w_va = alloc.allocate(4 * PIECE, "weights")
    kv_va = alloc.allocate(6 * PIECE, "kv_cache")
    weights, kv = put(w_va, 4 * PIECE, 6), put(kv_va, 6 * PIECE, 7)
    b.swap_out(b.resident_bytes)  # gpushare's sleep, every tag kept
    alloc.wake_up(tags=["weights"])  # vLLM's wake by tag
    assert (b.resident_bytes, b.swapped_bytes) == (4 * PIECE, 6 * PIECE)
    b.swap_in()  # the KV cache only
    assert (b.resident_bytes, b.swapped_bytes) == (10 * PIECE, 0)
    assert gpu.physical_bytes == b.resident_bytes
    assert ctypes.string_at(w_va, 4 * PIECE) == weights
    assert ctypes.string_at(kv_va, 6 * PIECE) == kv
    b.close()


def test_an_allocation_made_while_asleep_is_not_mapped_again_or_put_to_sleep_twice(
    gpu: FakeGpu,
):
    b, alloc, _ = engine(gpu)
    w_va = alloc.allocate(4 * PIECE, "weights")
    weights = put(w_va, 4 * PIECE, 8)
    b.swap_out(b.resident_bytes)
    kv_va = alloc.allocate(6 * PIECE, "kv_cache")  # the KV cache comes after the weights
    kv = put(kv_va, 6 * PIECE, 9)
    assert (b.resident_bytes, b.swapped_bytes) == (6 * PIECE, 4 * PIECE)
    r = b.swap_out(b.resident_bytes)  # the new one alone goes to sleep
    assert r.bytes == 6 * PIECE and gpu.physical_bytes == 0
    b.swap_in()
    assert (b.resident_bytes, b.swapped_bytes) == (10 * PIECE, 0)
    assert ctypes.string_at(w_va, 4 * PIECE) == weights
    assert ctypes.string_at(kv_va, 6 * PIECE) == kv
    b.close()


def test_a_sleep_that_fails_part_way_is_a_swap_error_and_the_figures_hold(gpu: FakeGpu):
    b, alloc, _ = engine(gpu)
    w_va = alloc.allocate(4 * PIECE, "weights")
    alloc.allocate(6 * PIECE, "kv_cache")
    weights = put(w_va, 4 * PIECE, 10)
    gpu.fail("cuMemHostAlloc", code=2, skip=1)  # pinned memory short at the second copy
    with pytest.raises(SwapError, match="could not sleep"):
        b.swap_out(b.resident_bytes)
    assert b.resident_bytes == gpu.physical_bytes == 6 * PIECE  # what went is counted out
    assert b.swapped_bytes == 4 * PIECE
    r = b.swap_out(b.resident_bytes)  # the next revoke: the rest, nothing unmapped twice
    assert r.bytes == 6 * PIECE and gpu.physical_bytes == 0
    b.swap_in()
    assert b.resident_bytes == gpu.physical_bytes == 10 * PIECE
    assert ctypes.string_at(w_va, 4 * PIECE) == weights
    b.close()


def test_any_error_of_vllms_allocator_is_a_swap_error(gpu: FakeGpu, monkeypatch):
    b, alloc, _ = engine(gpu)
    alloc.allocate(4 * PIECE, "weights")

    def no_pinned(size: int) -> int:
        raise RuntimeError("CUDA error: out of memory")  # what torch.empty(pin_memory) says

    monkeypatch.setattr(alloc.ext, "pinned", no_pinned)
    with pytest.raises(SwapError):  # what the session's swap paths catch
        b.swap_out(b.resident_bytes)
    assert b.resident_bytes == gpu.physical_bytes == 4 * PIECE
    b.close()


def test_a_swap_in_that_waited_for_room_reports_its_copy_time_only(gpu: FakeGpu):
    # the wait for room takes 0.2 s: the behaviour under test (not in the copy's time)
    b, alloc, _ = bare(gpu, hooks=SwapHooks(wait_room=lambda n: time.sleep(0.2)))
    alloc.allocate(4 * PIECE, "weights")
    b.swap_out(b.resident_bytes)
    r = b.swap_in()
    assert 0 <= r.seconds < 0.2  # the node refuses a negative time


def test_vllms_sleep_is_not_held_up_by_a_swap_in_waiting_for_room(gpu: FakeGpu):
    b, alloc, _ = engine(gpu)
    w_va = alloc.allocate(4 * PIECE, "weights")
    alloc.allocate(6 * PIECE, "kv_cache")
    weights = put(w_va, 4 * PIECE, 12)
    b.swap_out(b.resident_bytes)
    waiting, free = threading.Event(), threading.Event()

    def room_for(resident: int) -> float:
        waiting.set()
        assert free.wait(10)  # the node has no room yet
        return 0.0

    b.room_for = room_for  # type: ignore[method-assign]
    swap_in = threading.Thread(target=b.swap_in)
    swap_in.start()
    assert waiting.wait(10)
    slept = threading.Thread(target=alloc.sleep, kwargs={"offload_tags": ("weights",)})
    slept.start()  # vLLM's /sleep meanwhile: it is vLLM's to wake from now on
    slept.join(5)
    assert not slept.is_alive()  # not behind the node's wait
    free.set()
    swap_in.join(10)
    assert (b.resident_bytes, b.swapped_bytes) == (0, 10 * PIECE) and gpu.physical_bytes == 0
    alloc.wake_up()
    assert b.resident_bytes == gpu.physical_bytes == 10 * PIECE
    assert ctypes.string_at(w_va, 4 * PIECE) == weights
    b.close()


def test_an_allocation_freed_while_asleep_is_forgotten(gpu: FakeGpu):
    b, alloc, _ = engine(gpu)
    alloc.allocate(4 * PIECE, "weights")
    tmp = alloc.allocate(2 * PIECE, "weights")
    assert b.resident_bytes == 6 * PIECE
    alloc.sleep(offload_tags=("weights",))
    alloc.pointer_to_data.pop(tmp)  # freed while asleep (vLLM's free callback)
    alloc.wake_up()
    assert (b.resident_bytes, b.swapped_bytes) == (4 * PIECE, 0)
    r = b.swap_out(b.resident_bytes)  # swappable again
    assert r.bytes == 4 * PIECE and gpu.physical_bytes == 0  # tmp went with the sleep
    b.close()


def test_a_sleep_of_vllms_before_the_pool_was_made_shows_in_its_copies(gpu: FakeGpu):
    b, alloc, _ = bare(gpu)
    alloc.allocate(4 * PIECE, "weights")
    alloc.sleep(offload_tags=("weights",))  # before any figure was asked
    assert (b.resident_bytes, b.swapped_bytes) == (0, 4 * PIECE)
    assert gpu.physical_bytes == 0
    b.close()


def test_pinning_ahead_follows_the_addresses_not_their_count(gpu: FakeGpu):
    asked: list[list[int]] = []
    b, alloc, finder = bare(gpu, prepin=asked.append)
    va = alloc.allocate(4 * PIECE, "weights")
    assert b.resident_bytes == 4 * PIECE
    assert finder.pool is not None and finder.pool._pinning is not None
    finder.pool._pinning.join(10)
    alloc.pointer_to_data.pop(va)  # one freed, another made: the same count
    alloc.allocate(8 * PIECE, "kv_cache")
    assert b.resident_bytes == 8 * PIECE
    finder.pool._pinning.join(10)
    assert asked == [[4 * PIECE], [8 * PIECE]]
    b.close()


def test_threads_finding_the_allocator_at_once_make_one_pool(gpu: FakeGpu, monkeypatch):
    mods, alloc = fake_vllm.modules(str(gpu.libcuda))
    alloc.allocate(2 * PIECE, "weights")
    finder = SleepModeFinder(lambda: None, lambda n: None, modules=mods)
    made: list[object] = []
    init = SleepModePool.__init__

    def slow(self: SleepModePool, *a: object, **k: object) -> None:
        time.sleep(0.05)  # a slow pool: the threads' finds overlap
        init(self, *a, **k)  # type: ignore[arg-type]
        made.append(self)

    monkeypatch.setattr(SleepModePool, "__init__", slow)
    ts = [threading.Thread(target=finder) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert len(made) == 1 and finder.pool is made[0]
    finder.close()


# --- failures and races (a second review) ---------------------------------------------------


def test_a_failed_wake_of_vllms_loses_no_copy_and_counts_what_it_left(gpu: FakeGpu):
    b, alloc, _ = engine(gpu)
    w_va = alloc.allocate(4 * PIECE, "weights")
    kv_va = alloc.allocate(6 * PIECE, "kv_cache")
    weights = put(w_va, 4 * PIECE, 11)
    assert b.resident_bytes == 10 * PIECE
    alloc.sleep(offload_tags=("weights",))  # level 1: weights kept, KV cache dropped
    gpu.fail("cuMemCreate", skip=1)  # the KV cache's memory cannot be made
    with pytest.raises(RuntimeError, match=r"CUDA Error: .* at cuMemCreate"):  # vLLM's own
        alloc.wake_up()
    # Woken one allocation a call, vLLM's rollback undid the KV cache's alone: the
    # weights, whose copy vLLM let go once restored, stay mapped and counted.
    assert b.resident_bytes == gpu.physical_bytes == 4 * PIECE
    assert (b.swapped_bytes, b.discarded_bytes) == (0, 6 * PIECE)
    assert ctypes.string_at(w_va, 4 * PIECE) == weights
    alloc.wake_up()  # vLLM tries again: the KV cache mapped, the weights not twice
    assert b.resident_bytes == gpu.physical_bytes == 10 * PIECE
    assert ctypes.string_at(w_va, 4 * PIECE) == weights
    assert kv_va in alloc.pointer_to_data
    b.close()


def test_a_sleep_failing_after_an_unmap_counts_that_allocation_out(gpu: FakeGpu):
    b, alloc, _ = engine(gpu)
    w_va = alloc.allocate(4 * PIECE, "weights")
    kv_va = alloc.allocate(6 * PIECE, "kv_cache")
    weights, kv = put(w_va, 4 * PIECE, 14), put(kv_va, 6 * PIECE, 15)
    gpu.fail("cuMemRelease", skip=1)  # the KV cache's, once vLLM unmapped it
    with pytest.raises(SwapError, match="could not sleep"):
        b.swap_out(b.resident_bytes)
    # the driver says it is no longer mapped: out (its copy kept), not resident
    assert b.resident_bytes == 0 and b.swapped_bytes == 10 * PIECE
    b.swap_in()  # so it is woken, not read where nothing is mapped
    assert ctypes.string_at(w_va, 4 * PIECE) == weights
    assert ctypes.string_at(kv_va, 6 * PIECE) == kv
    b.close()


def test_a_failed_swap_in_is_counted_as_vllms_rollback_left_it(gpu: FakeGpu):
    b, alloc, _ = engine(gpu)
    w_va = alloc.allocate(4 * PIECE, "weights")
    kv_va = alloc.allocate(6 * PIECE, "kv_cache")
    weights, kv = put(w_va, 4 * PIECE, 13), put(kv_va, 6 * PIECE, 12)
    b.swap_out(b.resident_bytes)
    gpu.fail("cuMemCreate", skip=1)  # the second allocation's memory cannot be made
    with pytest.raises(SwapError, match="could not wake"):
        b.swap_in()
    # vLLM woken one allocation a call: the first back, the second's copy still kept
    assert b.resident_bytes == gpu.physical_bytes == 4 * PIECE
    assert (b.swapped_bytes, b.discarded_bytes) == (6 * PIECE, 0)
    b.swap_out(b.resident_bytes)  # the next revoke: nothing unmapped twice
    b.swap_in()  # the next grant: every copy comes back
    assert b.resident_bytes == gpu.physical_bytes == 10 * PIECE
    assert ctypes.string_at(w_va, 4 * PIECE) == weights
    assert ctypes.string_at(kv_va, 6 * PIECE) == kv
    b.close()


def test_a_revoke_while_vllms_wake_waits_is_woken_too_within_a_new_ask(gpu: FakeGpu):
    b, alloc, told = engine(gpu)
    alloc.allocate(4 * PIECE, "weights")
    alloc.allocate(6 * PIECE, "kv_cache")
    assert b.resident_bytes == 10 * PIECE
    alloc.sleep(offload_tags=("weights",))
    alloc.wake_up(tags=["weights"])  # weights back, the KV cache still dropped
    revokes = [lambda: b.swap_out(b.resident_bytes)]  # while the wake waits for the lease
    told.hold = lambda: revokes.pop()() if revokes else None  # type: ignore[method-assign]
    alloc.wake_up()
    assert b.resident_bytes == gpu.physical_bytes == 10 * PIECE
    assert told.grows[-1][0] == 10 * PIECE  # asked again for what the revoke took
    b.swap_in()  # nothing of gpushare's left to wake: nothing mapped twice
    assert b.resident_bytes == gpu.physical_bytes == 10 * PIECE
    b.close()


def test_vllms_allocations_and_frees_during_a_swap_neither_break_it_nor_linger(
    gpu: FakeGpu,
):
    b, alloc, _ = engine(gpu)
    alloc.allocate(4 * PIECE, "weights")
    assert b.resident_bytes == 4 * PIECE
    pool = b.foreign()
    assert isinstance(pool, SleepModePool)
    sleep, wake = pool._sleep, pool._wake
    made: list[int] = []

    def sleep_with_an_allocation(*a: object, **k: object) -> None:
        made.append(alloc.allocate(2 * PIECE, "weights"))  # the engine thread, meanwhile
        sleep(*a, **k)  # type: ignore[arg-type]

    pool._sleep = sleep_with_an_allocation  # type: ignore[method-assign]
    b.swap_out(b.resident_bytes)
    assert b.resident_bytes == gpu.physical_bytes == 2 * PIECE  # the new one untouched

    def wake_with_a_free(*a: object, **k: object) -> None:
        alloc.free(made[0])  # vLLM's free callback and its C extension's my_free
        wake(*a, **k)  # type: ignore[arg-type]

    pool._wake = wake_with_a_free  # type: ignore[method-assign]
    b.swap_in()
    assert made[0] not in alloc.pointer_to_data
    assert b.resident_bytes == gpu.physical_bytes == 4 * PIECE
    b.close()


def test_the_limit_counts_gpushares_swapped_memory_as_the_node_does(gpu: FakeGpu):
    stopped: list[str] = []
    b, alloc, _ = bare(gpu, limit=8 * PIECE, past_limit=stopped.append)
    b.allocate(6 * PIECE)
    alloc.allocate(2 * PIECE, "weights")
    assert b.resident_bytes == 8 * PIECE
    b.swap_out(6 * PIECE)  # ours covers the revoke
    alloc.allocate(2 * PIECE, "kv_cache")
    assert b.resident_bytes == 4 * PIECE and b.swapped_bytes == 6 * PIECE
    assert len(stopped) == 1
    b.close()


# --- a third review ------------------------------------------------------------------------


def test_vllms_wake_asks_again_when_the_lease_went_during_its_wait(gpu: FakeGpu):
    lease = {"held": False}
    mods, alloc = fake_vllm.modules(str(gpu.libcuda))

    def hold() -> None:
        lease["held"] = True

    revoked: list[int] = []

    def grow(n: int) -> None:
        if not revoked:  # a revoke right after the wait: swapped out, the lease gone
            revoked.append(b.swap_out(b.resident_bytes).bytes)
            lease["held"] = False

    finder = SleepModeFinder(
        lambda: None, grow, modules=mods, hold=hold, holding=lambda: lease["held"]
    )
    b = gpu.backend(foreign=finder)
    alloc.allocate(4 * PIECE, "weights")
    alloc.allocate(6 * PIECE, "kv_cache")
    assert b.resident_bytes == 10 * PIECE
    pool = finder.pool
    assert pool is not None
    alloc.sleep(offload_tags=("weights",))
    wake = pool._wake
    held_at_wake: list[bool] = []

    def noting(*a: object, **k: object) -> None:
        held_at_wake.append(lease["held"])
        wake(*a, **k)  # type: ignore[arg-type]

    pool._wake = noting  # type: ignore[method-assign]
    alloc.wake_up()
    assert held_at_wake == [True, True]  # each mapped only once the lease was held again
    assert b.resident_bytes == gpu.physical_bytes == 10 * PIECE
    b.close()


def test_a_level_one_sleep_that_fails_after_dropping_counts_the_dropped_as_dropped(
    gpu: FakeGpu,
):
    b, alloc, _ = engine(gpu)
    kv_va = alloc.allocate(6 * PIECE, "kv_cache")  # before the weights in vLLM's list
    alloc.allocate(4 * PIECE, "weights")
    assert b.resident_bytes == 10 * PIECE
    gpu.fail("cuMemHostAlloc")  # the weights' host copy cannot be made
    with pytest.raises(RuntimeError, match="out of memory"):  # PyTorch's, through vLLM
        alloc.sleep(offload_tags=("weights",))
    assert b.resident_bytes == gpu.physical_bytes == 4 * PIECE  # the KV cache went
    assert b.discarded_bytes == 6 * PIECE
    alloc.wake_up(tags=["kv_cache"])  # vLLM wakes its KV cache: mapped again
    assert b.resident_bytes == gpu.physical_bytes == 10 * PIECE
    assert kv_va in alloc.pointer_to_data
    b.close()

"""vLLM's sleep-mode memory counted and swapped with the session's own (the allocator as
vLLM has it, over the fake libcuda: :mod:`.fake_vllm`)."""

from __future__ import annotations

import ctypes
import logging
import random
import threading

import pytest

from gpushare.client.swap.base import SwapHooks
from gpushare.client.swap.vllm_sleep import SleepModeFinder, find_allocator
from gpushare.client.swap.vmm import VmmBackend

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
    mods, alloc = fake_vllm.modules(gpu.driver)
    finder = SleepModeFinder(told.on_change, told.grow, modules=mods, hold=told.hold)
    hooks = SwapHooks(on_change=told.on_change, wait_room=told.wait_room)
    b = gpu.backend(limit=limit, hooks=hooks, foreign=finder)
    return b, alloc, told


def test_vllms_allocator_is_found_once_it_holds_memory(gpu: FakeGpu):
    assert find_allocator({}) is None  # vLLM not loaded
    mods, alloc = fake_vllm.modules(gpu.driver)
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


def test_vllms_memory_past_the_limit_is_said_once_with_the_fix(
    gpu: FakeGpu, caplog: pytest.LogCaptureFixture
):
    b, alloc, _ = engine(gpu, limit=8 * PIECE)
    b.allocate(2 * PIECE)
    alloc.allocate(8 * PIECE, "kv_cache")
    with caplog.at_level(logging.ERROR, logger="gpushare.client.swap"):
        assert b.resident_bytes == 10 * PIECE  # the truth, which the node escalates
        assert b.resident_bytes == 10 * PIECE
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "--gpu-memory-utilization" in said[0]
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
    mods, alloc = fake_vllm.modules(gpu.driver)
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

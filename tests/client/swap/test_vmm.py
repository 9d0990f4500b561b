"""The VMM swap logic over gpushare's allocator library and the ctypes driver layer,
against the fake libcuda (host memory standing for the GPU's: a swapped-out range really
has no access)."""

from __future__ import annotations

import ctypes
import random
import threading
import time
from pathlib import Path

import pytest

from gpushare.client.swap.base import SwapHooks
from gpushare.client.swap.vmm import IdleWaiter, VmmBackend
from gpushare.errors import OutOfMemoryError, SwapError
from tests.support import wait_until

from .conftest import GRANULE, FakeGpu

PIECE = GRANULE
CUDA_ERROR_OUT_OF_MEMORY = 2


def perms(va: int) -> str:
    """The permissions of the mapping holding ``va`` in this process ('---p': none)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, mode = line.split()[:2]
        lo, hi = (int(x, 16) for x in span.split("-"))
        if lo <= va < hi:
            return mode
    return ""


def fill(b: VmmBackend, sizes: list[int], seed: int = 1) -> list[tuple[int, bytes]]:
    rng = random.Random(seed)
    out = []
    for n in sizes:
        va = b.allocate(n)
        data = rng.randbytes(n)
        ctypes.memmove(va, data, n)  # what a kernel would write
        out.append((va, data))
    return out


def intact(ranges: list[tuple[int, bytes]]) -> bool:
    return all(ctypes.string_at(va, len(d)) == d for va, d in ranges)


def test_swapped_memory_comes_back_at_the_same_addresses_intact(gpu: FakeGpu):
    b = gpu.backend()
    ranges = fill(b, [100 * 1024, 3 * PIECE + 5, 4 * 1024, 700 * 1024])
    total = b.resident_bytes
    assert total == gpu.physical_bytes == 2 * PIECE + 4 * PIECE + PIECE + 11 * PIECE
    r = b.swap_out(total)
    assert r.bytes == total and b.resident_bytes == 0 and b.swapped_bytes == total
    assert gpu.physical_bytes == 0  # the GPU memory is really released
    assert all(perms(va) == "---p" for va, _ in ranges)  # and GPU work there would fault
    r = b.swap_in()
    assert r.bytes == total and b.resident_bytes == total and b.swapped_bytes == 0
    assert intact(ranges)  # same addresses, same bytes
    b.close()


def test_swap_out_frees_piece_by_piece_newest_first_and_reports_each(gpu: FakeGpu):
    b = gpu.backend()
    (old_va, old), (new_va, new) = fill(b, [4 * PIECE, 4 * PIECE])
    seen = []
    b.on_change = lambda: seen.append((b.resident_bytes, gpu.physical_bytes))
    r = b.swap_out(2 * PIECE + 1)  # needs three pieces
    assert r.bytes == 3 * PIECE
    # The allocator's watcher thread reports the allocations above when it wakes (before
    # or during the swap-out): a report of figures unchanged since the one before is its.
    changes = [x for i, x in enumerate(seen) if x != (seen[i - 1] if i else (8 * PIECE,) * 2)]
    assert changes == [((8 - i) * PIECE, (8 - i) * PIECE) for i in (1, 2, 3)]
    assert ctypes.string_at(old_va, len(old)) == old  # the oldest allocation was left alone
    assert perms(new_va + 3 * PIECE) == "---p"
    assert ctypes.string_at(new_va, PIECE) == new[:PIECE]  # and so was the head of the newest


def test_swap_in_asks_room_for_each_piece_before_taking_it(gpu: FakeGpu):
    b = gpu.backend()
    ranges = fill(b, [6 * PIECE])
    b.swap_out(6 * PIECE)
    asked = []

    def wait_room(resident: int) -> None:
        assert gpu.physical_bytes == len(asked) * PIECE  # nothing taken ahead of the room
        asked.append(resident)

    b.wait_room = wait_room
    b.swap_in()
    assert asked == [i * PIECE for i in range(1, 7)]
    assert intact(ranges)


def test_a_room_that_never_comes_leaves_a_consistent_session(gpu: FakeGpu):
    b = gpu.backend()
    ranges = fill(b, [4 * PIECE])
    b.swap_out(4 * PIECE)

    def wait_room(resident: int) -> None:
        if resident > 2 * PIECE:
            raise SwapError("the node went away during this session's swap-in: try again")

    b.wait_room = wait_room
    with pytest.raises(SwapError, match="went away"):
        b.swap_in()
    assert (b.resident_bytes, b.swapped_bytes) == (2 * PIECE, 2 * PIECE)
    assert gpu.physical_bytes == 2 * PIECE
    b.wait_room = lambda resident: None
    b.swap_in()
    assert intact(ranges)


def test_host_buffers_are_pinned_ahead_and_reused(gpu: FakeGpu):
    b = gpu.backend(limit=16 * PIECE)
    pinned = gpu.calls("cuMemHostAlloc")
    assert pinned == 16 and b.host.pinned_bytes == 16 * PIECE
    ranges = fill(b, [16 * PIECE])
    for _ in range(5):
        b.swap_out(16 * PIECE)
        b.swap_in()
    assert gpu.calls("cuMemHostAlloc") == pinned and b.host.late_pins == 0
    assert intact(ranges)


def test_short_of_pinned_buffers_a_swap_pins_on_the_spot(gpu: FakeGpu):
    b = gpu.backend(host_bytes=PIECE)
    ranges = fill(b, [3 * PIECE])
    b.swap_out(3 * PIECE)
    assert b.host.late_pins == 2
    b.swap_in()
    assert intact(ranges)


def test_small_segments_share_host_buffers_and_events(gpu: FakeGpu):
    # PyTorch's 2 MiB segments, here a granule each: 8 of them fit one piece-sized
    # buffer and go in one batch (one event), not one buffer and one event each.
    b = gpu.backend(piece=8 * GRANULE, host_bytes=8 * GRANULE)
    ranges = fill(b, [GRANULE] * 8)
    records = gpu.calls("cuEventRecord")
    b.swap_out(8 * GRANULE)
    assert b.host.late_pins == 0 and b.host.free_buffers == 0
    assert gpu.calls("cuEventRecord") - records == 1
    b.swap_in()
    assert b.host.free_buffers == 1 and intact(ranges)


def test_the_limit_is_enforced_at_allocation(gpu: FakeGpu):
    b = gpu.backend(limit=4 * PIECE)
    b.allocate(3 * PIECE)
    with pytest.raises(OutOfMemoryError, match="past its memory limit"):
        b.allocate(PIECE + 1)
    va = b.allocate(PIECE)  # exactly up to the limit is fine
    b.swap_out(4 * PIECE)
    with pytest.raises(OutOfMemoryError):  # swapped bytes count against it too
        b.allocate(1)
    b.free(va)
    assert b.swapped_bytes == 3 * PIECE
    with pytest.raises(ValueError, match="no allocation"):
        b.free(va)


def test_a_failed_swap_out_keeps_the_memory_on_the_gpu(gpu: FakeGpu):
    b = gpu.backend()
    ranges = fill(b, [8 * PIECE])
    gpu.fail("cuMemcpyDtoHAsync_v2", 999, skip=5)  # the sixth copy
    free_before = b.host.free_buffers
    with pytest.raises(SwapError, match="unknown error"):
        b.swap_out(8 * PIECE)
    # Pieces whose copies were done went; the rest stayed on the GPU, mapped.
    out = b.swapped_bytes
    assert 0 < out < 8 * PIECE and b.resident_bytes == gpu.physical_bytes == 8 * PIECE - out
    assert b.host.free_buffers == free_before - out // PIECE  # no buffer lost
    b.swap_out(8 * PIECE)  # nothing was left claimed: the rest goes now
    assert b.swapped_bytes == 8 * PIECE
    b.swap_in()
    assert intact(ranges)


def test_a_gpu_full_at_swap_in_is_an_error_and_nothing_is_lost(gpu: FakeGpu, monkeypatch):
    b = gpu.backend()
    ranges = fill(b, [8 * PIECE])
    b.swap_out(8 * PIECE)
    monkeypatch.setenv("FAKE_CUDA_CAPACITY", str(3 * PIECE))  # someone else took the GPU
    with pytest.raises(SwapError, match="cuMemCreate failed: out of memory"):
        b.swap_in()
    assert (b.resident_bytes, b.swapped_bytes) == (3 * PIECE, 5 * PIECE)
    monkeypatch.delenv("FAKE_CUDA_CAPACITY")
    b.swap_in()
    assert intact(ranges)


def test_a_failed_access_grant_at_swap_in_leaves_the_piece_swapped_and_unmapped(gpu: FakeGpu):
    b = gpu.backend()
    ranges = fill(b, [4 * PIECE])
    b.swap_out(4 * PIECE)
    gpu.fail("cuMemSetAccess", 999, skip=1)  # the second piece's, mapped by then
    with pytest.raises(SwapError, match="cuMemSetAccess failed"):
        b.swap_in()
    assert (b.resident_bytes, b.swapped_bytes) == (PIECE, 3 * PIECE)
    assert gpu.physical_bytes == PIECE
    va = ranges[0][0]
    assert perms(va + PIECE) == "---p"  # a reservation again, not a mapping
    b.swap_in()  # maps there again
    assert intact(ranges) and b.swapped_bytes == 0
    b.close()


def test_freeing_swapped_memory_returns_its_host_buffers(gpu: FakeGpu):
    b = gpu.backend()
    (va, _), *_ = fill(b, [4 * PIECE])
    free0 = b.host.free_buffers
    b.swap_out(4 * PIECE)
    assert b.host.free_buffers == free0 - 4
    b.free(va)
    b.swap_in()  # a swap takes back what frees returned
    assert b.host.free_buffers == free0 and b.swapped_bytes == 0


def test_a_free_during_a_swap_is_finished_by_the_swap(gpu: FakeGpu):
    # PyTorch may free a segment (empty_cache in another thread) while its pieces move.
    b = gpu.backend()
    (va, _), (keep_va, keep) = fill(b, [4 * PIECE, 2 * PIECE])
    freed = []

    def progress() -> None:
        if not freed:
            freed.append(va)
            b.free(va)  # the first piece of the newest went; now the older one is freed

    b.on_change = progress
    b.swap_out(6 * PIECE)
    assert not gpu.shim.owns(va)
    assert b.swapped_bytes == 2 * PIECE and b.resident_bytes == 0  # only `keep` is left
    b.on_change = lambda: None
    b.swap_in()
    assert ctypes.string_at(keep_va, len(keep)) == keep
    assert gpu.physical_bytes == 2 * PIECE  # nothing of the freed one stayed behind


def test_swaps_push_the_context_and_leave_the_threads_own(gpu: FakeGpu):
    b = gpu.backend()
    ranges = fill(b, [2 * PIECE])
    gpu.cu.fake_cuda_push_foreign()  # the workload's own context is current here
    b.swap_out(2 * PIECE)
    b.swap_in()
    assert gpu.cu.fake_cuda_foreign_current()  # still: pushed and popped, not switched
    assert intact(ranges)


def test_closing_frees_the_host_buffers_with_a_context(gpu: FakeGpu):
    b = gpu.backend(limit=8 * PIECE)
    assert gpu.cu.fake_cuda_pinned() == 8 * PIECE
    b.close()  # from a thread with no current context: the fake refuses frees without one
    assert gpu.cu.fake_cuda_pinned() == 0


def test_closing_gives_back_the_stream_the_events_and_the_context(gpu: FakeGpu):
    alive = gpu.cu.fake_cuda_alive
    alive.argtypes = [ctypes.c_char_p]
    b = gpu.backend()
    ranges = fill(b, [2 * PIECE])
    b.swap_out(2 * PIECE)
    b.swap_in()
    assert intact(ranges)
    # the self-test's stream and event went back at once; the backend's are in use
    assert alive(b"streams") == 1 and alive(b"events") > 1
    held = alive(b"contexts")  # the allocator library's hold and the driver's
    assert held == 2
    for va, _ in ranges:
        b.free(va)
    b.close()
    assert alive(b"streams") == 0 and alive(b"events") == 0
    gpu.driver.close()
    gpu.driver.close()  # once only: a second close gives back nothing more
    assert alive(b"contexts") == held - 1
    gpu.shim.configure(str(gpu.libcuda), 0, 64 * GRANULE, GRANULE)  # again: not a new hold
    assert alive(b"contexts") == held - 1


@pytest.mark.parametrize(("peers", "granted"), [(True, [0, 1, 2]), (False, [0])])
def test_mapped_memory_is_reachable_by_the_devices_peers(
    gpu: FakeGpu, monkeypatch: pytest.MonkeyPatch, peers: bool, granted: list[int]
):
    """As PyTorch's expandable segments: another GPU of the process that can reach this
    one as a peer (a peer copy, NCCL's P2P) may read and write its memory."""
    monkeypatch.setenv("FAKE_CUDA_DEVICES", "3")
    if not peers:
        monkeypatch.setenv("FAKE_CUDA_NO_PEERS", "1")
    ids = (ctypes.c_int * 16)()

    def last_access() -> list[int]:
        return sorted(ids[:n]) if (n := gpu.cu.fake_cuda_access(ids, 16)) else []

    b = gpu.backend()
    assert gpu.driver.access_devices == granted
    fill(b, [PIECE])  # mapped by the allocator library, in C
    assert last_access() == granted
    b.swap_out(PIECE)
    ids[:] = [-1] * 16
    b.swap_in()  # mapped again by the swap-in, in Python
    assert last_access() == granted
    b.close()


def test_allocation_and_free_are_reported(gpu: FakeGpu):
    b = gpu.backend()
    reports = []
    b.on_change = lambda: reports.append(b.resident_bytes)
    va = b.allocate(PIECE)  # in C: a byte down a pipe, reported by a thread
    wait_until(lambda: reports, what="the report")
    assert reports[-1] == PIECE
    b.free(va)
    b.close()


def test_a_swap_out_does_not_hang_behind_gpu_work_that_waits_on_something_else():
    """The torch backend's wait before a swap-out (``IdleWaiter``): a synchronize stuck
    behind pending work (an NCCL kernel waiting for its peers) holds the caller, the
    client's reader thread, no longer than the bound; the one synchronize goes on, and
    the next wait, once the work is done, returns."""
    import threading
    import time

    pending = threading.Event()  # the collective's peers arrive
    syncs = []

    def synchronize() -> None:
        syncs.append(threading.current_thread().name)
        pending.wait(30)

    w = IdleWaiter(synchronize)
    t0 = time.monotonic()
    with pytest.raises(SwapError, match="still runs this session's work"):
        w.wait(0.2)
    assert time.monotonic() - t0 < 5  # the reader thread is free again
    with pytest.raises(SwapError):
        w.wait(0.1)
    assert w.started == 1 and syncs == ["gpushare-sync"]  # one synchronize, not one a wait
    pending.set()
    w.wait(5)
    w.wait(5)  # a new one, done at once
    assert w.started == 2

    def failing() -> None:
        raise RuntimeError("CUDA error: an illegal memory access")

    with pytest.raises(SwapError, match="illegal memory access"):
        IdleWaiter(failing).wait(5)


def copied_back(b: VmmBackend, va: int, data: bytes) -> None:
    """All of ``b`` swapped out and in: the range at ``va`` was copied, not dropped."""
    r = b.swap_out(b.resident_bytes)
    assert (r.bytes, r.discarded) == (len(data), 0)
    b.swap_in()
    assert ctypes.string_at(va, len(data)) == data


# --- discardable memory: dropped, not copied; back zeroed -----------------------------------


def test_discardable_memory_is_dropped_first_not_copied_and_comes_back_zeroed(
    gpu: FakeGpu, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("FAKE_CUDA_DIRTY", "1")  # new GPU memory holds what was there
    b = gpu.backend()
    (keep_va, keep), (cache_va, _) = fill(b, [2 * PIECE, 3 * PIECE])
    d = b.discardable(cache_va, 3 * PIECE)
    assert d.bytes == 3 * PIECE and d.drops == 0
    copies = gpu.calls("cuMemcpyDtoHAsync_v2")
    r = b.swap_out(PIECE)  # one piece asked: the cache's newest piece, dropped
    assert (r.bytes, r.discarded) == (0, PIECE)
    assert gpu.calls("cuMemcpyDtoHAsync_v2") == copies  # nothing copied to host
    assert (b.resident_bytes, b.swapped_bytes, b.discarded_bytes) == (4 * PIECE, 0, PIECE)
    assert gpu.physical_bytes == 4 * PIECE and d.drops == 1
    r = b.swap_out(b.resident_bytes)  # the rest of the cache dropped before anything moves
    assert (r.bytes, r.discarded) == (2 * PIECE, 2 * PIECE)
    assert (b.resident_bytes, b.swapped_bytes, b.discarded_bytes) == (0, 2 * PIECE, 3 * PIECE)
    assert gpu.physical_bytes == 0 and d.drops == 3
    assert perms(cache_va) == "---p"
    r = b.swap_in()
    assert r.bytes == 2 * PIECE  # only the copied bytes move back
    assert (b.resident_bytes, b.swapped_bytes, b.discarded_bytes) == (5 * PIECE, 0, 0)
    assert ctypes.string_at(keep_va, len(keep)) == keep  # the rest intact
    assert ctypes.string_at(cache_va, 3 * PIECE) == bytes(3 * PIECE)  # the cache: zeros
    b.close()


def test_only_whole_pieces_within_the_range_are_discardable(gpu: FakeGpu):
    b = gpu.backend()
    ((va, data),) = fill(b, [4 * PIECE])
    d = b.discardable(va + PIECE // 2, 2 * PIECE)  # covers piece 1 only wholly
    assert d.bytes == PIECE
    r = b.swap_out(b.resident_bytes)
    assert (r.bytes, r.discarded) == (3 * PIECE, PIECE)
    b.swap_in()
    got = ctypes.string_at(va, 4 * PIECE)
    assert got[:PIECE] == data[:PIECE] and got[2 * PIECE :] == data[2 * PIECE :]
    assert got[PIECE : 2 * PIECE] == bytes(PIECE)
    b.close()


def test_a_dropped_piece_keeps_its_claim_on_the_limit_and_frees_cleanly(gpu: FakeGpu):
    b = gpu.backend(limit=8 * PIECE)
    ((va, _),) = fill(b, [6 * PIECE])
    b.discardable(va, 6 * PIECE)
    b.swap_out(6 * PIECE)
    assert (b.resident_bytes, b.discarded_bytes) == (0, 6 * PIECE)
    with pytest.raises(OutOfMemoryError):  # it comes back at the next grant: still counted
        b.allocate(3 * PIECE)
    b.free(va)  # freed while dropped: nothing left of it anywhere
    assert (b.resident_bytes, b.swapped_bytes, b.discarded_bytes) == (0, 0, 0)
    b.allocate(8 * PIECE)
    b.close()


def test_memory_no_longer_discardable_is_copied_again(gpu: FakeGpu):
    b = gpu.backend()
    ((va, data),) = fill(b, [2 * PIECE])
    d = b.discardable(va, 2 * PIECE)
    b.keep(d)  # the workload put what cannot be rebuilt there
    copied_back(b, va, data)
    b.close()


def test_a_mark_given_up_during_a_swap_out_leaves_the_figures_whole(gpu: FakeGpu):
    # Seen (a review): a mark's finalizer running mid-swap (the tensor's last reference
    # dropped in a report) left a dropped piece counted as swapped with no host copy,
    # and the swap-in copied from host address 0 (a segfault).
    b = gpu.backend()
    ((va, data),) = fill(b, [2 * PIECE])
    d = b.discardable(va, 2 * PIECE)
    b.on_change = lambda: b.keep(d)  # given up after the first piece went
    r = b.swap_out(2 * PIECE)
    assert (r.bytes, r.discarded) == (0, 2 * PIECE)  # as the swap decided at its start
    assert (b.resident_bytes, b.swapped_bytes, b.discarded_bytes) == (0, 0, 2 * PIECE)
    b.on_change = lambda: None
    b.swap_in()
    assert ctypes.string_at(va, 2 * PIECE) == bytes(2 * PIECE)
    ctypes.memmove(va, data, len(data))  # rebuilt: and no longer discardable
    copied_back(b, va, data)
    b.close()


def test_a_mark_whose_memory_is_no_longer_the_caches_is_copied(gpu: FakeGpu):
    # Suspected (a review): a tensor's storage freed or replaced while the tensor lives
    # (resize_(0), set_) leaves its memory marked for whatever PyTorch puts there next.
    b = gpu.backend()
    ((va, data),) = fill(b, [2 * PIECE])
    owner = {"va": va}  # where the marked tensor's storage is now
    b.discardable(va, 2 * PIECE, still=lambda: owner["va"] == va)
    owner["va"] = 0  # its storage went; another tensor's bytes are there now
    copied_back(b, va, data)
    b.close()


def test_a_mark_given_up_before_its_first_drop_still_hears_of_it(gpu: FakeGpu):
    # Seen (a review): its pieces were dropped (the swap decided so at its start) but its
    # drops stayed 0: a view of its storage got zeros unannounced.
    b = gpu.backend()
    ((va, _),) = fill(b, [2 * PIECE])
    d = b.discardable(va, 2 * PIECE)
    real = b.driver.unmap

    def unmap(*args: int) -> None:
        if d in b._marks:
            b.keep(d)  # a finalizer, run by a collection inside the swap
        real(*args)

    b.driver.unmap = unmap  # type: ignore[method-assign]
    r = b.swap_out(b.resident_bytes)
    assert r.discarded == 2 * PIECE and d.drops == 2
    b.close()


def test_a_mark_whose_check_fails_is_copied_not_dropped(gpu: FakeGpu):
    b = gpu.backend()
    ((va, data),) = fill(b, [2 * PIECE])
    b.discardable(va, 2 * PIECE, still=lambda: 1 / 0 > 0)
    copied_back(b, va, data)  # the swap goes on
    b.close()


def test_an_allocation_past_the_grants_bound_waits_for_the_node_first(gpu: FakeGpu):
    """As on a simulated GPU: the allocator library asks (the session's grow: past the
    bound it yields with the bytes it needs) before it allocates, and the allocation
    goes on once the node's grant allows it."""
    bound = [2 * PIECE]
    asked: list[tuple[int, int]] = []  # (bytes in all, physical bytes when asked)
    granted = threading.Event()

    def grow(total: int) -> None:
        asked.append((total, gpu.physical_bytes))
        if total > bound[0]:  # the session yields; the node's grant comes later
            assert granted.wait(10)
            bound[0] = total

    b = gpu.backend(limit=4 * PIECE, hooks=SwapHooks(grow=grow))
    b.allocate(2 * PIECE)  # within the bound: asked, no wait
    got: list[int] = []
    t = threading.Thread(target=lambda: got.append(b.allocate(PIECE)))
    t.start()
    wait_until(lambda: len(asked) >= 2, what="the second allocation asked")
    time.sleep(0.05)  # a quiet period: memory made while it waits would show by now
    assert t.is_alive() and gpu.physical_bytes == 2 * PIECE  # nothing made while it waits
    granted.set()
    t.join(10)
    assert got and gpu.physical_bytes == 3 * PIECE
    assert asked == [(2 * PIECE, 0), (3 * PIECE, 2 * PIECE)]
    with pytest.raises(OutOfMemoryError):  # past the limit: refused, nothing asked
        b.allocate(2 * PIECE)
    assert len(asked) == 2
    b.close()
    b2_asked = len(asked)
    gpu.shim.alloc(PIECE)  # after detach the library asks nobody
    assert len(asked) == b2_asked

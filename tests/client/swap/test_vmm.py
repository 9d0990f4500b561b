"""The VMM swap logic, on a driver modelled over host memory (no GPU needed)."""

from __future__ import annotations

import random

import pytest

from gpushare.client.swap.cuda import CudaError
from gpushare.client.swap.vmm import VmmBackend, mem_available
from gpushare.errors import OutOfMemoryError, SwapError

from .fake_cuda import FakeDriver

KiB = 1024
PIECE = 64 * KiB


@pytest.fixture
def fake() -> FakeDriver:
    return FakeDriver(capacity=16 * 2**20)


def backend(fake: FakeDriver, limit: int = 4 * 2**20, **kw) -> VmmBackend:
    b = VmmBackend(fake, limit, piece_bytes=PIECE, **kw)
    b.progress_every_s = 0.0  # every piece reported: the fake moves them at once
    assert b.wait_for_host_buffers(10)
    return b


def fill(fake: FakeDriver, b: VmmBackend, sizes: list[int], seed: int = 1):
    rng = random.Random(seed)
    out = []
    for n in sizes:
        va = b.allocate(n)
        data = rng.randbytes(n)
        fake.write(va, data)
        out.append((va, data))
    return out


def test_swapped_memory_comes_back_at_the_same_addresses_intact(fake):
    b = backend(fake)
    ranges = fill(fake, b, [100 * KiB, 3 * PIECE + 5, 4 * KiB, 700 * KiB])
    total = b.resident_bytes
    assert total == fake.physical_bytes > 0
    r = b.swap_out(total)
    assert r.bytes == total and b.resident_bytes == 0 and b.swapped_bytes == total
    assert fake.physical_bytes == 0  # the GPU memory is really released
    with pytest.raises(CudaError, match="illegal memory access"):
        fake.read(ranges[0][0], 1)  # and GPU work on it would fault
    r = b.swap_in()
    assert r.bytes == total and b.resident_bytes == total and b.swapped_bytes == 0
    for va, data in ranges:  # same addresses, same bytes
        assert fake.read(va, len(data)) == data


def test_swap_out_frees_piece_by_piece_newest_first_and_reports_each(fake):
    b = backend(fake)
    (old_va, old), (new_va, new) = fill(fake, b, [4 * PIECE, 4 * PIECE])
    seen = []
    b.on_change = lambda: seen.append((b.resident_bytes, fake.physical_bytes))
    r = b.swap_out(2 * PIECE + 1)  # needs three pieces
    assert r.bytes == 3 * PIECE
    assert seen == [((8 - i) * PIECE, (8 - i) * PIECE) for i in (1, 2, 3)]
    assert fake.read(old_va, len(old)) == old  # the oldest allocation was left alone
    with pytest.raises(CudaError):
        fake.read(new_va + 3 * PIECE, 1)
    assert fake.read(new_va, PIECE) == new[:PIECE]  # and so was the head of the newest


def test_swap_in_asks_room_for_each_piece_before_taking_it(fake):
    b = backend(fake)
    ranges = fill(fake, b, [6 * PIECE])
    b.swap_out(6 * PIECE)
    asked = []

    def wait_room(resident: int) -> None:
        assert fake.physical_bytes == b.resident_bytes  # nothing taken ahead of the room
        asked.append(resident)

    b.wait_room = wait_room
    b.swap_in()
    assert asked == [i * PIECE for i in range(1, 7)]
    assert fake.read(ranges[0][0], 6 * PIECE) == ranges[0][1]


def test_a_room_that_never_comes_leaves_a_consistent_session(fake):
    b = backend(fake)
    ranges = fill(fake, b, [4 * PIECE])
    b.swap_out(4 * PIECE)

    def wait_room(resident: int) -> None:
        if resident > 2 * PIECE:
            raise SwapError("the node went away during this session's swap-in: try again")

    b.wait_room = wait_room
    with pytest.raises(SwapError, match="went away"):
        b.swap_in()
    assert (b.resident_bytes, b.swapped_bytes) == (2 * PIECE, 2 * PIECE)
    assert fake.physical_bytes == 2 * PIECE
    b.wait_room = lambda resident: None
    b.swap_in()
    assert fake.read(ranges[0][0], 4 * PIECE) == ranges[0][1]


def test_host_buffers_are_pinned_ahead_and_reused(fake):
    b = backend(fake, limit=1 * 2**20)
    pinned = fake.calls["host_alloc"]
    assert pinned == 2**20 // PIECE and b.host.pinned_bytes == 2**20
    ranges = fill(fake, b, [2**20])
    for _ in range(5):
        b.swap_out(2**20)
        b.swap_in()
    assert fake.calls["host_alloc"] == pinned and b.host.late_pins == 0
    assert fake.read(ranges[0][0], 2**20) == ranges[0][1]


def test_short_of_pinned_buffers_a_swap_pins_on_the_spot(fake):
    b = backend(fake, host_bytes=PIECE)
    ranges = fill(fake, b, [3 * PIECE])
    b.swap_out(3 * PIECE)
    assert b.host.late_pins == 2
    b.swap_in()
    assert fake.read(ranges[0][0], 3 * PIECE) == ranges[0][1]


def test_the_limit_is_enforced_at_allocation(fake):
    b = backend(fake, limit=4 * PIECE)
    b.allocate(3 * PIECE)
    with pytest.raises(OutOfMemoryError, match="past its memory limit"):
        b.allocate(PIECE + 1)
    va = b.allocate(PIECE)  # exactly up to the limit is fine
    b.swap_out(4 * PIECE)
    with pytest.raises(OutOfMemoryError):  # swapped bytes count against it too
        b.allocate(1)
    b.free(va)
    assert b.swapped_bytes == 3 * PIECE and len(fake.reserved) == 1
    with pytest.raises(ValueError, match="no allocation"):
        b.free(va)


def test_a_failed_swap_out_keeps_the_memory_on_the_gpu(fake):
    b = backend(fake)
    ranges = fill(fake, b, [8 * PIECE])
    fake.fail["copy_dtoh"] = CudaError("cuMemcpyDtoHAsync", 999, "unknown error")
    free_before = len(b.host._free)
    with pytest.raises(SwapError, match="unknown error"):
        b.swap_out(8 * PIECE)
    assert b.resident_bytes == 8 * PIECE and b.swapped_bytes == 0
    assert len(b.host._free) == free_before  # no buffer lost
    assert fake.read(ranges[0][0], 8 * PIECE) == ranges[0][1]


def test_a_gpu_full_at_swap_in_is_an_error_and_nothing_is_lost(fake):
    b = backend(fake)
    ranges = fill(fake, b, [8 * PIECE])
    b.swap_out(8 * PIECE)
    fake.capacity = 3 * PIECE  # someone else took the GPU meanwhile
    with pytest.raises(SwapError, match="out of memory"):
        b.swap_in()
    assert (b.resident_bytes, b.swapped_bytes) == (3 * PIECE, 5 * PIECE)
    fake.capacity = 16 * 2**20
    b.swap_in()
    assert fake.read(ranges[0][0], 8 * PIECE) == ranges[0][1]


def test_freeing_swapped_memory_returns_its_host_buffers(fake):
    b = backend(fake)
    (va, _), *_ = fill(fake, b, [4 * PIECE])
    free0 = len(b.host._free)
    b.swap_out(4 * PIECE)
    assert len(b.host._free) == free0 - 4
    b.free(va)
    assert len(b.host._free) == free0 and b.swapped_bytes == 0 and not fake.reserved


def test_mem_available_reads_meminfo(tmp_path):
    (tmp_path / "meminfo").write_text("MemTotal:  100 kB\nMemAvailable:   2048 kB\n")
    assert mem_available(str(tmp_path)) == 2048 * 1024
    assert mem_available(str(tmp_path / "missing")) == 0

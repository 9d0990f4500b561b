import time

import pytest

from gpushare.client.swap.sim import SimBackend
from gpushare.errors import GpushareError, OutOfMemoryError, SwapError, SwapIntegrityError

G = 2**30


@pytest.fixture
def backend():
    b = SimBackend(10 * G, scale=1024, bandwidth=1e15)
    yield b
    b.close()


def test_bytes_survive_swap_out_and_in(backend):
    m = backend.allocate(3 * G + 12345)
    m.fill(42)
    r = backend.swap_out(2 * G)
    assert r.bytes >= 2 * G and backend.swapped_bytes == r.bytes
    assert backend.resident_bytes + backend.swapped_bytes == 3 * G + 12345
    with pytest.raises(SwapError, match="outside a lease"):
        m.verify(42)  # part of it is off the "device"
    r = backend.swap_in()
    assert backend.swapped_bytes == 0 and m.verify(42)


def test_writes_persist_across_swaps(backend):
    m = backend.allocate(G)
    m.fill(1)
    m.write(100, b"hello")
    backend.swap_out(G)
    backend.swap_in()
    assert m.read(100, 5) == b"hello" and not m.verify(1)


def test_corruption_in_host_memory_is_detected(backend):
    m = backend.allocate(G)
    m.fill(7)
    backend.swap_out(G)
    backend._host[10] ^= 0xFF  # a bit flip while swapped out
    with pytest.raises(SwapIntegrityError, match="checksum"):
        backend.swap_in()


def test_limit_is_enforced(backend):
    backend.allocate(8 * G)
    with pytest.raises(OutOfMemoryError, match="memory limit"):
        backend.allocate(3 * G)


def test_access_outside_a_lease_is_refused(backend):
    def refuse():
        raise GpushareError("outside a lease")

    backend.check_access = refuse
    with pytest.raises(GpushareError):
        backend.allocate(G)


def test_swap_time_follows_the_model():
    b = SimBackend(4 * G, scale=1024, bandwidth=20e9)
    m = b.allocate(2 * G)
    m.fill(3)
    r = b.swap_out(2 * G)
    assert r.seconds >= 2 * G / 20e9  # never faster than the modelled link
    assert r.seconds < 10 * (2 * G / 20e9)


def test_a_swaps_chunks_stream_back_to_back_unless_another_booked_between():
    from gpushare.simlink import OUT, SimLink

    link = SimLink()
    bw, n = 1e9, 10_000_000  # 10 ms a chunk
    start = time.monotonic()
    first = link.book(OUT, n, bw)
    time.sleep(0.03)  # the process is late to book its next chunk
    second = link.book(OUT, n, bw, after=first)
    assert second == pytest.approx(first + 0.01, abs=1e-6)  # streamed: no gap
    late = link.book(OUT, n, bw)  # without after: from when it booked
    assert late >= start + 0.03 + 0.01
    link.close()


def test_freed_memory_returns_its_host_slots(backend):
    for _ in range(100):  # would run out of host slots if they leaked
        m = backend.allocate(9 * G)
        m.free()
    assert backend.resident_bytes == 0


def test_the_link_serializes_a_lane_and_slows_both_when_both_are_busy(tmp_path):
    from gpushare.simlink import DUPLEX, IN, OUT, SimLink

    path = str(tmp_path / "link0")
    SimLink.create(path)
    a, b = SimLink(path), SimLink(path)  # two sessions' processes, one link
    # 5 s per booking at the full rate: the lanes stay busy however slowly a loaded
    # machine runs this (booking is arithmetic: nothing waits), and each booking's
    # "now" is bracketed by the clock read before and after it, not guessed within 10 ms
    bw, n = 1e9, 5_000_000_000
    t0 = time.monotonic()
    first = a.book(OUT, n, bw)
    assert t0 + 5 <= first <= time.monotonic() + 5  # from when it was booked
    second = b.book(OUT, n, bw)  # the same lane: after the first, sharing the rate
    assert second == pytest.approx(first + 5)
    t1 = time.monotonic()
    both = b.book(IN, n, bw)  # the other lane is busy: the duplex rate
    assert t1 + 5 / DUPLEX <= both <= time.monotonic() + 5 / DUPLEX
    lone = SimLink()  # not shared: this process's own lanes
    t2 = time.monotonic()
    assert t2 + 5 <= lone.book(OUT, n, bw) <= time.monotonic() + 5
    for link in (a, b, lone):
        link.close()


def test_discardable_memory_is_dropped_first_and_made_again_empty():
    """A server's cache: taken back without a byte copied to host memory (the modelled
    link's time is not spent), made again zeroed at the swap-in; other memory is kept."""
    b = SimBackend(10 * G, scale=1024, bandwidth=1e9)  # 1 GB/s: a copy of 1 GiB is ~1 s
    try:
        weights = b.allocate(G)
        weights.fill(7)
        cache = b.allocate(2 * G, discardable=True)
        cache.fill(8)
        t0 = time.monotonic()
        r = b.swap_out(2 * G)
        assert time.monotonic() - t0 < 0.5  # nothing moved over the link
        assert (r.bytes, r.discarded) == (0, 2 * G)
        assert (b.resident_bytes, b.swapped_bytes, b.discarded_bytes) == (G, 0, 2 * G)
        assert cache.drops == 2048 // 256 and weights.drops == 0
        r = b.swap_out(3 * G)  # more than the cache: the rest is copied as ever
        assert (r.bytes, r.discarded) == (G, 0)
        b.swap_in()
        assert (b.resident_bytes, b.swapped_bytes, b.discarded_bytes) == (3 * G, 0, 0)
        assert weights.verify(7)  # kept, checked
        assert not cache.verify(8) and cache.read(0, 4) == b"\0\0\0\0"  # made again, empty
    finally:
        b.close()

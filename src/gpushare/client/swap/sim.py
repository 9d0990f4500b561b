"""The ``sim`` swap backend: a simulated GPU's memory, as real bytes.

A session's simulated device memory is real memory scaled down by ``scale`` (default
1024: a 30 GiB session holds 30 MiB), cut in chunks. Swapping out copies chunks into a
host buffer made ahead of time (as pinned buffers must be, in the background at attach)
and frees them; swapping in copies them back and checks each chunk's CRC-32 against the
one taken on the way out. A mismatch raises :class:`SwapIntegrityError`, never ignored.

Timing model (:class:`SimLink`): the simulated GPU's PCIe link has one lane each way, at
``bandwidth`` bytes/s (default 55 GB/s, the pinned copy rate measured on an H200). Each
chunk books its lane: it starts when the lane is free (sessions moving the same way take
turns) and runs at the full rate, or at :data:`DUPLEX` of it while the other lane is
busy (the H200 measured 91-94 GB/s both ways at once, against 2 x 55). The chunk's real
copy runs, then the rest of its booked time is slept, so a switch costs what it would on
that GPU, and a swap-out overlapped with another session's swap-in comes to about 0.58
of the two one after the other, as measured there. The sessions' processes share the
lanes through a small file the node makes per simulated GPU.

Faults: with ``failure_rate`` P, each swap-out fails with probability P before it moves
anything (as when host memory is exhausted), so the daemon's handling can be exercised.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import zlib
from dataclasses import dataclass, field

from gpushare.client.swap.base import NO_HOOKS, SwapBackend, SwapHooks, SwapResult
from gpushare.errors import OutOfMemoryError, SwapError, SwapIntegrityError
from gpushare.simlink import IN, OUT, SimLink
from gpushare.units import format_size

log = logging.getLogger("gpushare.client.swap")
DEFAULT_SCALE = 1024
DEFAULT_BANDWIDTH = 55e9  # bytes/s each way
CHUNK_BYTES = 256 * 2**20  # device bytes per chunk: the swap granularity


_SWAPPED = "simulated GPU memory touched while swapped out: GPU work outside a lease"


@dataclass
class _Chunk:
    nbytes: int  # device bytes it stands for
    slot: int  # its place in the host buffer
    data: bytearray | None  # on the "device" when not None
    crc: int = 0
    discardable: bool = False  # a cache its workload can rebuild: dropped, never copied
    dropped: bool = False  # dropped at a swap-out: made again, empty, at the swap-in
    owner: SimMemory | None = field(default=None, repr=False, compare=False)


class SimMemory:
    """One allocation on a simulated GPU. ``read``/``write`` work on the real, scaled
    bytes (``real_nbytes`` of them); touching a swapped-out part raises :class:`SwapError`,
    as GPU work outside a lease would fault."""

    def __init__(self, backend: SimBackend, chunks: list[_Chunk], nbytes: int) -> None:
        self._backend = backend
        self.drops = 0  # chunks of it dropped so far (discardable: rebuild after a grant)
        for c in chunks:
            c.owner = self
        self._chunks = chunks
        self.nbytes = nbytes
        self.chunk_real = backend.chunk_real
        self.real_nbytes = sum(len(c.data) for c in chunks if c.data is not None)

    def _locate(self, real_off: int) -> tuple[bytearray, int]:
        i, off = divmod(real_off, self.chunk_real)
        c = self._chunks[i]
        if c.data is None:
            raise SwapError(
                "simulated GPU memory touched while swapped out: GPU work outside a lease"
            )
        return c.data, off

    def write(self, real_off: int, data: bytes) -> None:
        self._backend.check_access()
        pos = 0
        while pos < len(data):
            buf, off = self._locate(real_off + pos)
            n = min(len(buf) - off, len(data) - pos)
            buf[off : off + n] = data[pos : pos + n]
            pos += n

    def read(self, real_off: int, n: int) -> bytes:
        self._backend.check_access()
        out = bytearray()
        while len(out) < n:
            buf, off = self._locate(real_off + len(out))
            out += buf[off : off + min(len(buf) - off, n - len(out))]
        return bytes(out)

    def fill(self, seed: int) -> None:
        """Write a pattern that :meth:`verify` can check later."""
        self._backend.check_access()
        for i, c in enumerate(self._chunks):
            assert c.data is not None, "fill() needs the memory resident"
            c.data[:] = _pattern(seed, i, len(c.data))

    def verify(self, seed: int) -> bool:
        self._backend.check_access()
        for i, c in enumerate(self._chunks):
            if c.data is None:
                raise SwapError(_SWAPPED)
            if c.data != _pattern(seed, i, len(c.data)):
                return False
        return True

    def free(self) -> None:
        self._backend._free(self._chunks)
        self._chunks = []


def _pattern(seed: int, index: int, n: int) -> bytes:
    # Cheap, position-dependent and seed-dependent: a shifted or stale chunk fails.
    head = (seed * 1_000_003 + index).to_bytes(8, "little")
    return (head * (n // 8 + 1))[:n]


class SimBackend(SwapBackend):
    name = "sim"
    simulated = True

    def __init__(
        self,
        limit: int,
        scale: int = DEFAULT_SCALE,
        bandwidth: float = DEFAULT_BANDWIDTH,
        chunk_bytes: int = CHUNK_BYTES,
        failure_rate: float = 0.0,
        link: str = "",
        hooks: SwapHooks = NO_HOOKS,
    ) -> None:
        super().__init__(hooks)
        self.failure_rate = failure_rate
        self._rng = random.Random()
        self.checksums_verified = 0  # chunks whose CRC-32 matched on the way back
        if scale < 1 or bandwidth <= 0 or chunk_bytes < scale:
            raise ValueError("sim backend: scale >= 1, bandwidth > 0, chunk_bytes >= scale")
        self.limit = limit
        self.scale = scale
        self.bandwidth = bandwidth
        self.chunk_bytes = chunk_bytes
        self.chunk_real = chunk_bytes // scale
        try:
            self.link = SimLink(link)
        except OSError as e:  # another mount namespace, say: this process's own lanes
            log.warning("simulated link %s not shared (%s): timing per process", link, e)
            self.link = SimLink()
        self._chunks: list[_Chunk] = []
        self._free_slots = list(range(-(-limit // chunk_bytes) - 1, -1, -1))
        self._host = bytearray()
        # The host buffer exists before the first swap: made now, in the background.
        self._host_ready = threading.Event()
        threading.Thread(target=self._make_host, name="gpushare-sim-host", daemon=True).start()

    def set_limit(self, limit: int) -> None:
        """Allocations are held to ``limit`` from now on; a larger one gets the slots
        (and host memory) its chunks need."""
        self._host_ready.wait()
        have = len(self._host) // self.chunk_real if self.chunk_real else 0
        need = -(-limit // self.chunk_bytes)
        if need > have:  # popped last: the slots there are first taken
            self._free_slots[:0] = range(need - 1, have - 1, -1)
            self._host.extend(bytes((need - have) * self.chunk_real))
        self.limit = limit

    def _make_host(self) -> None:
        self._host = bytearray(len(self._free_slots) * self.chunk_real)
        self._host_ready.set()

    @property
    def resident_bytes(self) -> int:
        return sum(c.nbytes for c in self._chunks if c.data is not None)

    @property
    def swapped_bytes(self) -> int:
        return sum(c.nbytes for c in self._chunks if c.data is None and not c.dropped)

    @property
    def discarded_bytes(self) -> int:
        return sum(c.nbytes for c in self._chunks if c.dropped)

    def allocate(self, nbytes: int, discardable: bool = False) -> SimMemory:
        """Allocate ``nbytes`` of simulated GPU memory (inside a lease only).
        ``discardable``: a cache the workload can rebuild (a server's KV cache): when the
        node takes memory back it is dropped first, nothing of it copied to host memory,
        and made again, zeroed, at the next grant (:attr:`SimMemory.drops` counts it)."""
        self.check_access()
        used = self.resident_bytes + self.swapped_bytes
        if nbytes <= 0:
            raise ValueError("allocation size must be positive")
        if used + nbytes > self.limit:
            raise OutOfMemoryError(
                f"allocating {format_size(nbytes)} would take this session past its memory"
                f" limit of {format_size(self.limit)} ({format_size(used)} in use): free"
                " memory, or attach with a larger limit (memory_limit=, GPUSHARE_MEMORY_LIMIT,"
                " gpushare run --memory-limit)"
            )
        # Past what its grant lent it (mode auto): the node is asked first; the session
        # yields meanwhile and holds again once that much fits.
        self.grow(used + nbytes)
        self.check_access()
        chunks = []
        left = nbytes
        while left > 0:
            n = min(left, self.chunk_bytes)
            data = bytearray(-(-n // self.scale))
            chunks.append(_Chunk(n, self._free_slots.pop(), data, discardable=discardable))
            left -= n
        self._chunks.extend(chunks)
        self.on_change()
        return SimMemory(self, chunks, nbytes)

    def _free(self, chunks: list[_Chunk]) -> None:
        ids = {id(c) for c in chunks}
        self._chunks = [c for c in self._chunks if id(c) not in ids]
        self._free_slots.extend(c.slot for c in chunks)
        self.on_change()

    def synchronize(self) -> None:
        """Nothing is queued on a simulated device: its copies are synchronous."""

    def swap_out(self, nbytes: int) -> SwapResult:
        if self.failure_rate and self._rng.random() < self.failure_rate:
            raise SwapError("simulated swap-out failure (host memory exhausted)")
        self._host_ready.wait()
        t0 = time.perf_counter()
        dropped = 0
        for c in reversed(self._chunks):  # what can be rebuilt goes first, for free
            if dropped >= nbytes:
                break
            if c.discardable and c.data is not None:
                c.data, c.dropped = None, True
                dropped += c.nbytes
                self._dropped_from(c)
                self.progress()
        moved, done = 0, 0.0
        for c in reversed(self._chunks):
            if moved + dropped >= nbytes:
                break
            if c.data is None:
                continue
            done = self.link.book(OUT, c.nbytes, self.bandwidth, after=done)
            off = c.slot * self.chunk_real
            self._host[off : off + len(c.data)] = c.data
            c.crc = zlib.crc32(c.data)
            moved += c.nbytes
            _sleep_until(done)
            c.data = None  # the device memory is freed once its copy is done
            self.progress()
        return SwapResult(moved, time.perf_counter() - t0, dropped)

    @staticmethod
    def _dropped_from(c: _Chunk) -> None:
        if c.owner is not None:
            c.owner.drops += 1

    def swap_in(self) -> SwapResult:
        self._host_ready.wait()
        t0 = time.perf_counter()
        moved, done = 0, 0.0
        for c in self._chunks:
            if c.data is not None:
                continue
            waited = self.room_for(self.resident_bytes + c.nbytes)  # not transfer time
            t0 += waited
            if waited > 1e-3:
                done = 0.0  # the stream stopped for room: the next chunk starts anew
            if c.dropped:  # made again, empty: its workload rebuilds it
                c.data, c.dropped = bytearray(-(-c.nbytes // self.scale)), False
                continue
            done = self.link.book(IN, c.nbytes, self.bandwidth, after=done)
            real = -(-c.nbytes // self.scale)
            off = c.slot * self.chunk_real
            data = bytearray(self._host[off : off + real])
            if zlib.crc32(data) != c.crc:
                raise SwapIntegrityError(
                    f"simulated swap-in of a {c.nbytes}-byte chunk failed its checksum"
                )
            c.data = data
            self.checksums_verified += 1
            moved += c.nbytes
            _sleep_until(done)
            self.progress()
        return SwapResult(moved, time.perf_counter() - t0)

    def close(self) -> None:
        self._chunks = []
        self._host = bytearray()
        self.link.close()


def _sleep_until(t: float) -> None:
    left = t - time.monotonic()
    if left > 0:
        time.sleep(left)

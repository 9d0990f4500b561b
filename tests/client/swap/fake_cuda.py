"""A CUDA driver over host memory, modelled on the VMM calls gpushare makes.

Only for machines without a GPU. It keeps the driver's rules that the backend relies on
(a mapping needs a reservation and a live handle; touching an unmapped address faults;
physical memory is bounded by the device's capacity; cuMemCreate past it fails with
CUDA_ERROR_OUT_OF_MEMORY) and counts the calls, so tests can see what a swap did.
"""

from __future__ import annotations

import ctypes
from collections import Counter

from gpushare.client.swap.cuda import CudaError


class FakeDriver:
    def __init__(self, capacity: int, granularity: int = 4096) -> None:
        self.capacity = capacity
        self._gran = granularity
        self._next_va = 0x7F00_0000_0000
        self.reserved: dict[int, int] = {}  # va -> size
        self.phys: dict[int, bytearray] = {}  # handle -> bytes
        self.mapped: dict[int, tuple[int, int]] = {}  # va -> (size, handle)
        self.host: dict[int, ctypes.Array[ctypes.c_char]] = {}
        self._next_handle = 1
        self.calls: Counter[str] = Counter()
        self.fail: dict[str, CudaError] = {}  # call -> error raised once
        self.current = False

    def _call(self, name: str) -> None:
        self.calls[name] += 1
        if name in self.fail:
            raise self.fail.pop(name)

    @property
    def physical_bytes(self) -> int:
        return sum(len(b) for b in self.phys.values())

    # --- the Driver interface -------------------------------------------------------

    def make_current(self) -> None:
        self.current = True

    def granularity(self) -> int:
        return self._gran

    def reserve(self, size: int) -> int:
        self._call("reserve")
        assert size % self._gran == 0, "reservations are whole granules"
        va = self._next_va
        self._next_va += size + self._gran  # a guard gap, as real reservations have
        self.reserved[va] = size
        return va

    def unreserve(self, va: int, size: int) -> None:
        self._call("unreserve")
        assert self.reserved.pop(va) == size
        assert not [m for m in self.mapped if va <= m < va + size], "freed while mapped"

    def create(self, size: int) -> int:
        self._call("create")
        if self.physical_bytes + size > self.capacity:
            raise CudaError("cuMemCreate", 2, "out of memory")
        h = self._next_handle
        self._next_handle += 1
        self.phys[h] = bytearray(size)
        return h

    def release(self, handle: int) -> None:
        self._call("release")
        assert handle not in {h for _, h in self.mapped.values()}, "released while mapped"
        del self.phys[handle]

    def map(self, va: int, size: int, handle: int) -> None:
        self._call("map")
        assert any(r <= va and va + size <= r + n for r, n in self.reserved.items())
        assert len(self.phys[handle]) == size
        assert va not in self.mapped
        self.mapped[va] = (size, handle)

    def unmap(self, va: int, size: int) -> None:
        self._call("unmap")
        assert self.mapped.pop(va)[0] == size

    def host_alloc(self, size: int) -> int:
        self._call("host_alloc")
        buf = ctypes.create_string_buffer(size)
        self.host[ctypes.addressof(buf)] = buf
        return ctypes.addressof(buf)

    def host_free(self, ptr: int) -> None:
        self._call("host_free")
        del self.host[ptr]

    def new_stream(self) -> int:
        return 1

    def copy_dtoh(self, dst: int, src: int, size: int, stream: int) -> None:
        self._call("copy_dtoh")
        ctypes.memmove(dst, bytes(self.read(src, size)), size)

    def copy_htod(self, dst: int, src: int, size: int, stream: int) -> None:
        self._call("copy_htod")
        self.write(dst, ctypes.string_at(src, size))

    def record(self, stream: int) -> int:
        self._call("record")
        return 1  # copies here are done when issued

    def wait(self, event: int) -> None:
        self._call("wait")

    # --- "kernels": what GPU work would read and write --------------------------------

    def _locate(self, va: int) -> tuple[bytearray, int]:
        for base, (size, h) in self.mapped.items():
            if base <= va < base + size:
                return self.phys[h], va - base
        raise CudaError("kernel", 700, f"an illegal memory access was encountered at {va:#x}")

    def write(self, va: int, data: bytes) -> None:
        pos = 0
        while pos < len(data):
            buf, off = self._locate(va + pos)
            n = min(len(buf) - off, len(data) - pos)
            buf[off : off + n] = data[pos : pos + n]
            pos += n

    def read(self, va: int, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            buf, off = self._locate(va + len(out))
            out += buf[off : off + min(len(buf) - off, n - len(out))]
        return bytes(out)

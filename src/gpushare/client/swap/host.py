"""Host memory for the bytes a swap-out copies: how much this process may pin, and the
pinned buffers themselves.

A swap-out copies a piece of GPU memory (client/swap/vmm.py) into pinned host memory.
Pinning runs at about 1 GiB/s, far too slow for a switch, so :class:`HostBuffers` pins
its buffers in the background from attach and reuses them; how many it pins is bounded
by what the host has available and, in a container, by the memory cgroup's room
(:func:`host_memory_available`): a pod that pins past its limit is OOM-killed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from pathlib import Path

from gpushare.client.swap.cuda import Driver, give_back
from gpushare.errors import SwapError

log = logging.getLogger("gpushare.client.swap")
_HOST_ALIGN = 4096


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


# --- how much host memory to pin ---------------------------------------------------------


def mem_available(proc: str = "/proc") -> int:
    """MemAvailable from ``{proc}/meminfo``, in bytes (0 if unknown)."""
    try:
        with open(os.path.join(proc, "meminfo")) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


# (limit, usage, reclaimable cache in memory.stat) in cgroup v2 and v1
_V2 = ("memory.max", "memory.current", "inactive_file")
_V1 = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
_UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a number near 2**63


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        v = int(text)
    except ValueError:
        return None
    return None if v >= _UNLIMITED else v


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            k, _, v = line.partition(" ")
            if k == key:
                return int(v)
    except (OSError, ValueError):
        pass
    return 0


def cgroup_memory_room(proc: str = "/proc", cgroup: str = "/sys/fs/cgroup") -> int | None:
    """Bytes this process's memory cgroup (and every cgroup above it) still allows: its
    limit less what it uses (its reclaimable file cache not counted, as the kubelet
    counts a pod's working set). None when no limit applies. v2 and v1 hierarchies;
    ``proc`` and ``cgroup`` are parameters so that recorded trees can be tested."""
    try:
        lines = Path(proc, "self", "cgroup").read_text().splitlines()
    except OSError:
        return None
    room: int | None = None
    for line in lines:
        _, controllers, path = [*line.split(":", 2), "", ""][:3]
        if controllers == "":  # v2: 0::/path
            base, files = Path(cgroup), _V2
        elif "memory" in controllers.split(","):  # v1: N:memory:/path
            base, files = Path(cgroup, "memory"), _V1
        else:
            continue
        limit_f, usage_f, stat_key = files
        parts = [p for p in path.strip().split("/") if p]
        for depth in range(len(parts), -1, -1):  # from this cgroup up to the root
            d = base.joinpath(*parts[:depth])
            limit = _read_int(d / limit_f)
            if limit is None:
                continue
            used = (_read_int(d / usage_f) or 0) - _stat(d / "memory.stat", stat_key)
            here = max(0, limit - max(0, used))
            room = here if room is None else min(room, here)
    return room


def host_memory_available(proc: str = "/proc", cgroup: str = "/sys/fs/cgroup") -> int:
    """What this process may still take of host memory: the host's available memory,
    within its cgroup's room (a pod pinning past its limit is OOM-killed). 0: unknown."""
    avail = mem_available(proc)
    room = cgroup_memory_room(proc, cgroup)
    if room is None:
        return avail
    return min(avail, room) if avail else room


# --- pinned host memory --------------------------------------------------------------------


class HostBuffers:
    """Pinned host buffers of one size: ``target`` bytes of them made in the background,
    handed out in slots (a piece's bytes; small pieces share a buffer) and taken back.
    Past the target, a buffer is pinned on the spot (slow: counted in
    :attr:`late_pins`, so the figure shows)."""

    def __init__(self, driver: Driver, size: int, target: int) -> None:
        self._driver = driver
        self.size = size
        self.count_target = max(0, target // size)
        self._free: list[int] = []  # whole buffers
        self._all: list[int] = []
        self._refs: dict[int, int] = {}  # buffer -> slots out
        self._slot_of: dict[int, int] = {}  # slot address -> its buffer
        self._cur = 0  # the buffer slots are cut from
        self._used = 0
        self._cond = threading.Condition()
        self._stop = False
        self.late_pins = 0
        self.pin_seconds = 0.0
        self.ready = threading.Event()
        self.error: str = ""
        threading.Thread(target=self._pin, name="gpushare-pin", daemon=True).start()

    @property
    def pinned_bytes(self) -> int:
        return len(self._all) * self.size

    @property
    def free_buffers(self) -> int:
        """Whole buffers not holding anything."""
        with self._cond:
            return len(self._free) + (1 if self._cur and not self._refs.get(self._cur) else 0)

    def _pin(self) -> None:
        t0 = time.perf_counter()
        try:
            with self._driver.context():
                for _ in range(self.count_target):
                    if self._stop:
                        break
                    ptr = self._driver.host_alloc(self.size)
                    with self._cond:
                        self._all.append(ptr)
                        self._free.append(ptr)
                        self._cond.notify_all()
        except SwapError as e:  # host memory short: later swaps pin on the spot, or fail
            self.error = str(e)
            log.warning("pinning host buffers stopped at %d bytes: %s", self.pinned_bytes, e)
        finally:
            self.pin_seconds = time.perf_counter() - t0
            self.ready.set()
            with self._cond:
                self._cond.notify_all()

    def take(self, n: int) -> int:
        """A slot of ``n`` (at most :attr:`size`) bytes; the caller's context current."""
        n = round_up(n, _HOST_ALIGN)
        with self._cond:
            if self._cur and self._used + n <= self.size:
                return self._slot(self._cur, n)
            while not self._free and not self.ready.is_set():
                self._cond.wait()  # the pinner is at work: its next buffer comes soonest
            buf = self._free.pop() if self._free else 0
        if not buf:
            buf = self._driver.host_alloc(self.size)  # raises SwapError when out of memory
            with self._cond:
                self._all.append(buf)
                self.late_pins += 1
        with self._cond:
            old = self._cur
            if old and not self._refs.get(old):
                self._free.append(old)
            self._cur, self._used = buf, 0
            return self._slot(buf, n)

    def _slot(self, buf: int, n: int) -> int:
        addr = buf + self._used
        self._used += n
        self._refs[buf] = self._refs.get(buf, 0) + 1
        self._slot_of[addr] = buf
        return addr

    def give(self, addr: int) -> None:
        with self._cond:
            buf = self._slot_of.pop(addr)
            self._refs[buf] -= 1
            if not self._refs[buf]:
                del self._refs[buf]
                if buf == self._cur:
                    self._used = 0
                else:
                    self._free.append(buf)
            self._cond.notify_all()

    def close(self) -> None:
        """Free the buffers not holding swapped bytes."""
        self._stop = True
        self.ready.wait()
        with self._cond, contextlib.suppress(SwapError), self._driver.context():
            if self._cur and not self._refs.get(self._cur):
                self._free.append(self._cur)
                self._cur = 0
            for ptr in self._free:
                give_back(self._driver.host_free, ptr)
                self._all.remove(ptr)
            self._free = []

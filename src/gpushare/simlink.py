"""The PCIe link of a simulated GPU, shared by the node (which makes its file) and the
workloads' ``sim`` backends (which book its lanes). Its timing model is described in
:mod:`gpushare.client.swap.sim`."""

from __future__ import annotations

import contextlib
import fcntl
import math
import mmap
import os
import secrets
import struct
import threading
import time
from collections.abc import Iterator

DUPLEX = 92 / 110  # each direction's share of the full rate while both are busy
OUT, IN = 0, 1  # the link's lanes: device to host, host to device
_LANES = struct.Struct("=dd")  # per lane: CLOCK_MONOTONIC time it is booked until
# A lane booked further ahead than this (or not a number) holds garbage, not bookings:
# it is taken as free, so no writer of the file can stall the others' swaps for long.
MAX_LEAD_S = 60.0


def book(booked: list[float], lane: int, nbytes: int, bandwidth: float, now: float) -> float:
    """The timing model: ``nbytes`` on ``lane`` start when it is free (transfers the same
    way take turns) and run at ``bandwidth``, or at :data:`DUPLEX` of it while the other
    lane is busy; ``booked`` (each lane's end time) is updated, the end returned. Pure:
    the shared link and ``gpushare simulate``'s virtual one both book with it."""
    start = max(now, booked[lane])
    rate = bandwidth * (DUPLEX if booked[1 - lane] > start else 1.0)
    end = start + nbytes / rate
    booked[lane] = end
    return end


class SimLink:
    """The PCIe link of one simulated GPU: when each lane is booked until.

    With ``path`` (a file the node made), every session's process books the same lanes,
    under an fcntl lock; without, the lanes are this process's own. Times are
    CLOCK_MONOTONIC, which all processes share; a process killed mid-swap leaves a
    booking that simply runs out, and a booking further ahead than :data:`MAX_LEAD_S`
    is taken for garbage.
    """

    SIZE = _LANES.size

    def __init__(self, path: str = "") -> None:
        self._lock = threading.Lock()
        self._fd = -1
        if path:
            self._fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                size = os.fstat(self._fd).st_size
                if size < self.SIZE:
                    raise OSError(
                        f"simulated link file {path} has {size} bytes, not {self.SIZE}:"
                        " the node is (re)starting; timing per process"
                    )
                self._mem: mmap.mmap | bytearray = mmap.mmap(self._fd, self.SIZE)
            except BaseException:
                os.close(self._fd)
                self._fd = -1
                raise
        else:
            self._mem = bytearray(self.SIZE)

    @staticmethod
    def create(path: str, mode: int = 0o600) -> None:
        """Make the shared file: a new one, renamed into place (a process mapping the
        old one keeps it whole; it is never truncated), never through a symlink. The
        node makes its own through its checked directory (``gpushare.node.keep.safefs``)."""
        d, name = os.path.split(os.path.abspath(path))
        tmp = os.path.join(d, f".{name}.{secrets.token_hex(6)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
        try:
            os.fchmod(fd, mode)
            os.write(fd, bytes(SimLink.SIZE))
        finally:
            os.close(fd)
        os.rename(tmp, path)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._lock:
            if self._fd < 0:
                yield
                return
            fcntl.lockf(self._fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.lockf(self._fd, fcntl.LOCK_UN)

    def book(self, lane: int, nbytes: int, bandwidth: float, after: float = 0.0) -> float:
        """Book ``nbytes`` on ``lane``; returns when (monotonic) the transfer is done.
        ``after``: the end of this swap's previous chunk on the lane. If no one booked
        the lane since, this chunk follows it back to back, as a copy engine streams a
        swap's chunks, not from when the process got round to booking it (a few
        milliseconds a chunk, which made a 4 GiB swap-in take 0.10 s, not 0.078)."""
        with self._locked():
            now = time.monotonic()
            booked = [
                t if math.isfinite(t) and t <= now + MAX_LEAD_S else now
                for t in _LANES.unpack_from(self._mem)
            ]
            if after and booked[lane] == after:
                now = min(now, after)
            end = book(booked, lane, nbytes, bandwidth, now)
            _LANES.pack_into(self._mem, 0, *booked)
            return end

    def close(self) -> None:
        if isinstance(self._mem, mmap.mmap):
            self._mem.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

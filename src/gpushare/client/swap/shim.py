"""gpushare's allocator library (``gpushare_alloc.c``): built, found and driven from here.

The library keeps a session's swappable GPU memory: allocation and free run in C, with
no GIL, under whatever lock the caller (PyTorch's allocator) holds; Python's swap loop
(:mod:`gpushare.client.swap.vmm`) moves its pieces. It is a plain shared library, not a
Python extension: it is built once per source version with the system C compiler
(``cc``) into a cache folder, or taken prebuilt from ``GPUSHARE_SHIM``.

``gpushare run`` puts it in the command's ``LD_PRELOAD`` (its ``cudaMalloc`` and
``cudaFree`` then serve PyTorch's caching allocator); a program that attaches by itself
loads it here and hands its allocator functions to a ``torch.cuda.MemPool``.

    python -m gpushare.client.swap.shim        # build if needed; print its path
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpushare.errors import GpushareError, OutOfMemoryError, SwapError

SOURCE = Path(__file__).with_name("gpushare_alloc.c")
LIB_PREFIX = "libgpushare_alloc"
ENV_SHIM = "GPUSHARE_SHIM"  # a prebuilt library to use instead of building one
_GS_LIMIT, _GS_DRIVER = 1, 2


class ShimUnavailableError(GpushareError):
    """gpushare's allocator library cannot be built or loaded here."""


def cache_dir() -> Path:
    """Where built libraries are kept: ``GPUSHARE_CACHE``, else the user's cache."""
    env = os.environ.get("GPUSHARE_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gpushare"


def _fallback_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"gpushare-{os.getuid()}"


def shim_path(build: bool = True) -> str:
    """The library's path, built here first if needed (and ``build``)."""
    env = os.environ.get(ENV_SHIM)
    if env:
        if not os.path.isfile(env):
            raise ShimUnavailableError(
                f"{ENV_SHIM}={env} is not a file: point it at a built {LIB_PREFIX}.so or unset it"
            )
        return env
    src = SOURCE.read_bytes()
    digest = hashlib.sha256(src + platform.machine().encode()).hexdigest()[:16]
    name = f"{LIB_PREFIX}-{digest}.so"
    for folder in (cache_dir(), _fallback_dir()):
        if (folder / name).is_file():
            return str(folder / name)
    if not build:
        raise ShimUnavailableError(f"gpushare's allocator library is not built ({name})")
    return _build(name)


def _build(name: str) -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise ShimUnavailableError(
            "gpushare's allocator library needs a C compiler to be built once (none found:"
            " install gcc), or a prebuilt one in GPUSHARE_SHIM"
        )
    why = ""
    for folder in (cache_dir(), _fallback_dir()):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=folder)
            os.close(fd)
        except OSError as e:
            why = f"{folder}: {e.strerror}"
            continue
        cmd = [cc, "-O2", "-shared", "-fPIC", "-o", tmp, str(SOURCE), "-ldl", "-lpthread"]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True)
            failed = out.stderr.strip()[-500:] if out.returncode else ""
        except OSError as e:
            failed = str(e)
        if failed:
            os.unlink(tmp)
            raise ShimUnavailableError(
                f"building gpushare's allocator library failed ({' '.join(cmd)}): {failed};"
                " install a C compiler (gcc) or set GPUSHARE_SHIM to a prebuilt one"
            )
        os.replace(tmp, folder / name)  # atomic: processes building at once all win
        return str(folder / name)
    raise ShimUnavailableError(
        f"no writable folder for gpushare's allocator library ({why}): set GPUSHARE_CACHE"
    )


def preloaded() -> str:
    """The library's path if this process was started with it in ``LD_PRELOAD``."""
    for entry in os.environ.get("LD_PRELOAD", "").replace(":", " ").split():
        if os.path.basename(entry).startswith(LIB_PREFIX) and _mapped(entry):
            return entry
    return ""


def _mapped(path: str) -> bool:
    try:
        real = os.path.realpath(path)
        with open("/proc/self/maps") as f:
            return any(line.rstrip().endswith(real) for line in f)
    except OSError:
        return False


class _Piece(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("id", "va", "size", "handle", "host", "flags")]


_GS_DISCARD, _GS_DROPPED = 1, 2


@dataclass
class Piece:
    """A claimed piece: where it is now (``handle`` 0: swapped out, bytes at ``host``;
    ``dropped``: out with nothing to copy back). ``discard``: it lies wholly in memory
    marked discardable (dropped at a swap-out rather than copied)."""

    id: int
    va: int
    size: int
    handle: int
    host: int
    discard: bool = False
    dropped: bool = False


GROW_FN = ctypes.CFUNCTYPE(None, ctypes.c_ulonglong)
_u64 = ctypes.c_ulonglong


class Shim:
    """The library loaded in this process (one store of memory per process)."""

    def __init__(self, path: str) -> None:
        try:
            self.lib = ctypes.CDLL(path)
        except OSError as e:
            raise ShimUnavailableError(f"cannot load gpushare's allocator library: {e}") from None
        self.path = path
        lib = self.lib
        for name, res, args in (
            ("gs_error", ctypes.c_char_p, []),
            ("gs_configure", ctypes.c_int, [ctypes.c_char_p, ctypes.c_int, _u64, _u64]),
            ("gs_granularity", _u64, []),
            ("gs_piece_bytes", _u64, []),
            ("gs_set_limit", None, [_u64]),
            ("gs_route", None, [ctypes.c_int]),
            ("gs_pause", None, [ctypes.c_int]),
            ("gs_notify", None, [ctypes.c_int]),
            ("gs_resident", _u64, []),
            ("gs_swapped", _u64, []),
            ("gs_discarded", _u64, []),
            ("gs_mark", _u64, [_u64, _u64, ctypes.c_int]),
            ("gs_npieces", ctypes.c_int, []),
            ("gs_mallocs_seen", _u64, []),
            ("gs_interposing", ctypes.c_int, []),
            ("gs_alloc", ctypes.c_int, [_u64, ctypes.POINTER(_u64)]),
            ("gs_free", ctypes.c_int, [_u64]),
            ("gs_owns", ctypes.c_int, [_u64]),
            ("gs_claim_out", ctypes.c_int, [_u64, ctypes.POINTER(_Piece), ctypes.c_int]),
            ("gs_claim_in", ctypes.c_int, [ctypes.POINTER(_Piece), ctypes.c_int]),
            ("gs_settle", None, [ctypes.c_uint64, _u64, ctypes.c_uint64]),
            ("gs_returned", ctypes.c_int, [ctypes.POINTER(ctypes.c_uint64), ctypes.c_int]),
            ("gs_defer_release", None, [_u64, _u64]),
            ("gs_retry", ctypes.c_int, []),
            ("gs_pending", _u64, []),
            ("gs_on_grow", None, [GROW_FN]),
        ):
            fn = getattr(lib, name)
            fn.restype = res
            fn.argtypes = args

    def error(self) -> str:
        return (self.lib.gs_error() or b"").decode(errors="replace")

    def configure(self, libcuda: str, device: int, limit: int, piece_bytes: int) -> None:
        if self.lib.gs_configure(libcuda.encode(), device, limit, piece_bytes):
            raise SwapError(self.error())

    @property
    def granularity(self) -> int:
        return int(self.lib.gs_granularity())

    @property
    def piece_bytes(self) -> int:
        return int(self.lib.gs_piece_bytes())

    @property
    def resident(self) -> int:
        return int(self.lib.gs_resident())

    @property
    def swapped(self) -> int:
        return int(self.lib.gs_swapped())

    @property
    def discarded(self) -> int:
        """Bytes of discardable pieces dropped (neither on the GPU nor on the host)."""
        return int(self.lib.gs_discarded())

    def mark(self, va: int, size: int, on: bool = True) -> int:
        """Mark the pieces wholly within ``[va, va + size)`` discardable (or no longer):
        the bytes marked."""
        return int(self.lib.gs_mark(va, size, int(on)))

    @property
    def interposing(self) -> bool:
        """Whether this library's ``cudaMalloc`` is the one every library finds."""
        return bool(self.lib.gs_interposing())

    @property
    def mallocs_seen(self) -> int:
        return int(self.lib.gs_mallocs_seen())

    def set_limit(self, limit: int) -> None:
        self.lib.gs_set_limit(limit)

    def route(self, on: bool) -> None:
        """Serve ``cudaMalloc`` on the configured device from gpushare (preload)."""
        self.lib.gs_route(int(on))

    def pause(self, on: bool) -> None:
        """Pause (and resume) serving ``cudaMalloc``: while a CUDA graph captures."""
        self.lib.gs_pause(int(on))

    def notify(self, fd: int) -> None:
        """A byte is written to ``fd`` after each allocation and free (-1: none)."""
        self.lib.gs_notify(fd)

    def alloc(self, size: int) -> int:
        va = _u64()
        rc = self.lib.gs_alloc(size, ctypes.byref(va))
        if rc == _GS_LIMIT:
            raise OutOfMemoryError(self.error())
        if rc:
            raise SwapError(self.error())
        return int(va.value)

    def free(self, va: int) -> None:
        if self.lib.gs_free(va):
            raise ValueError(f"no allocation at {va:#x}")

    def owns(self, va: int) -> bool:
        return bool(self.lib.gs_owns(va))

    def _claimed(self, arr: ctypes.Array[_Piece], n: int) -> list[Piece]:
        return [
            Piece(
                p.id, p.va, p.size, p.handle, p.host,
                discard=bool(p.flags & _GS_DISCARD), dropped=bool(p.flags & _GS_DROPPED),
            )
            for p in arr[:n]
        ]  # fmt: skip

    def claim_out(self, nbytes: int) -> list[Piece]:
        """Resident pieces, newest first, until ``nbytes``; each busy until settled."""
        if nbytes <= 0:
            return []
        arr = (_Piece * (self.lib.gs_npieces() + 1))()
        return self._claimed(arr, self.lib.gs_claim_out(nbytes, arr, len(arr)))

    def claim_in(self) -> list[Piece]:
        """Swapped-out pieces, oldest first; each busy until settled."""
        arr = (_Piece * (self.lib.gs_npieces() + 1))()
        return self._claimed(arr, self.lib.gs_claim_in(arr, len(arr)))

    def settle(self, piece: Piece, handle: int, host: int) -> None:
        """A claimed piece's step is over: its physical memory now (0: none) and host copy."""
        piece.handle, piece.host = handle, host
        self.lib.gs_settle(piece.id, handle, host)

    def on_grow(self, fn: Callable[[int], None] | None) -> Any:
        """Call ``fn(bytes)`` before each allocation (None: no more), from the allocating
        thread, outside the library's locks: it may block (the session yields for room
        past its grant's bound). ``fn`` must not raise. Returns the C callback, which the
        caller keeps alive while it is set."""
        cb = GROW_FN(fn) if fn is not None else GROW_FN()
        self.lib.gs_on_grow(cb)
        return cb

    def defer_release(self, handle: int, size: int) -> None:
        """A handle (unmapped) whose release failed: kept, counted resident, and released
        at a later :meth:`retry`."""
        self.lib.gs_defer_release(handle, size)

    @property
    def pending(self) -> int:
        """Physical bytes whose unmap or release failed and waits for :meth:`retry`
        (counted in :attr:`resident`: still the GPU's)."""
        return int(self.lib.gs_pending())

    def retry(self) -> int:
        """Try again the unmaps, releases and address frees that failed; how many are
        still pending."""
        return int(self.lib.gs_retry())

    def returned(self) -> list[int]:
        """Host copies of pieces freed while swapped out (their buffers are free again)."""
        out: list[int] = []
        arr = (ctypes.c_uint64 * 256)()
        while n := self.lib.gs_returned(arr, len(arr)):
            out += arr[:n]
        return out


_loaded: dict[str, Shim] = {}


def load(path: str | None = None) -> Shim:
    """The library in this process: the preloaded one, else ``path``, else built here."""
    path = path or preloaded() or shim_path()
    if path not in _loaded:
        _loaded[path] = Shim(path)
    return _loaded[path]


if __name__ == "__main__":  # pragma: no cover - a command-line helper
    try:
        print(shim_path())
    except ShimUnavailableError as e:
        sys.exit(f"gpushare: {e}")

"""The CUDA edge for machines without a GPU, built at test time from C: a libcuda
(``fake_libcuda.c``: cuda.h's calls over host memory), a CUDA runtime
(``fake_libcudart.c``) and a library calling it as PyTorch's does (``fake_consumer.c``),
beside gpushare's own allocator library built by the code that builds it for users."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpushare.client.swap import shim as shim_mod
from gpushare.client.swap.base import NO_HOOKS, ForeignPool, SwapHooks, no_pool
from gpushare.client.swap.cuda import CudaDriver
from gpushare.client.swap.shim import Shim
from gpushare.client.swap.vmm import VmmBackend

HERE = Path(__file__).parent
GRANULE = 64 * 1024  # the fake's granularity in these tests: small pieces, small memory


@dataclass
class Native:
    dir: Path
    libcuda: Path
    libcudart: Path
    consumer: Path
    shim: Path


@pytest.fixture(scope="session")
def native(tmp_path_factory: pytest.TempPathFactory) -> Native:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler here to build the CUDA fakes and gpushare's allocator")
    d = tmp_path_factory.mktemp("native")

    def build(out: str, src: str, *extra: str) -> Path:
        cmd = [cc, "-shared", "-fPIC", "-O1", "-o", str(d / out), str(HERE / src), *extra]
        subprocess.run(cmd, check=True)
        return d / out

    libcuda = build("libcuda.so.1", "fake_libcuda.c")
    libcudart = build("libcudart.so.13", "fake_libcudart.c", "-Wl,-soname,libcudart.so.13")
    consumer = build(
        "libconsumer.so", "fake_consumer.c", f"-L{d}", "-l:libcudart.so.13", f"-Wl,-rpath,{d}"
    )
    mp = pytest.MonkeyPatch()
    mp.setenv("GPUSHARE_CACHE", str(d / "cache"))
    mp.delenv("GPUSHARE_SHIM", raising=False)
    try:
        path = Path(shim_mod.shim_path())  # built as for users
    finally:
        mp.undo()
    return Native(d, libcuda, libcudart, consumer, path)


class FakeGpu:
    """One test's GPU: its own copies of the fake libcuda and of gpushare's library, so
    that no state is shared with another test."""

    def __init__(self, native: Native, tmp: Path) -> None:
        self.libcuda = tmp / "libcuda.so.1"
        shutil.copy(native.libcuda, self.libcuda)
        shim_copy = tmp / "libgpushare_alloc-test.so"
        shutil.copy(native.shim, shim_copy)
        self.cu = ctypes.CDLL(str(self.libcuda))
        self.cu.fake_cuda_created.restype = ctypes.c_size_t
        self.cu.fake_cuda_pinned.restype = ctypes.c_size_t
        self.cu.fake_cuda_log.restype = ctypes.c_char_p
        self.cu.fake_cuda_calls.argtypes = [ctypes.c_char_p]
        self.cu.fake_cuda_fail.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int]
        self.cu.fake_cuda_alive.argtypes = [ctypes.c_char_p]
        self.cu.fake_cuda_mapped.restype = ctypes.c_size_t
        self.shim = Shim(str(shim_copy))
        self._driver: CudaDriver | None = None

    @property
    def driver(self) -> CudaDriver:
        if self._driver is None:
            self._driver = CudaDriver(0, lib=str(self.libcuda))
        return self._driver

    def close(self) -> None:
        """The driver's hold on the primary context given back, if it was made."""
        if self._driver is not None:
            self._driver.close()

    @property
    def physical_bytes(self) -> int:
        return int(self.cu.fake_cuda_created())

    @property
    def mapped_bytes(self) -> int:
        return int(self.cu.fake_cuda_mapped())

    def alive(self, what: str) -> int:
        """What was made and not given back: "handles", "mappings", "reservations",
        "streams", "events", "host" (pinned allocations), "contexts"; or "faults"."""
        return int(self.cu.fake_cuda_alive(what.encode()))

    def calls(self, name: str) -> int:
        return int(self.cu.fake_cuda_calls(name.encode()))

    def fail(self, name: str, code: int = 999, skip: int = 0) -> None:
        """The call after ``skip`` more calls of ``name`` fails once, with ``code``."""
        self.cu.fake_cuda_fail(name.encode(), code, skip)

    def log(self) -> list[str]:
        return [x for x in (self.cu.fake_cuda_log() or b"").decode().split(";") if x]

    def backend(
        self,
        limit: int = 64 * GRANULE,
        piece: int = GRANULE,
        host_bytes: int | None = None,
        hooks: SwapHooks = NO_HOOKS,
        foreign: Callable[[], ForeignPool | None] = no_pool,
        past_limit: Callable[[str], None] | None = None,
    ) -> VmmBackend:
        self.shim.configure(str(self.libcuda), 0, limit, piece)
        b = VmmBackend(
            self.driver,
            self.shim,
            limit,
            host_bytes=host_bytes,
            hooks=hooks,
            foreign=foreign,
            past_limit=past_limit,
        )
        b.progress_every_s = 0.0  # every piece reported: the fake moves them at once
        assert b.wait_for_host_buffers(10)
        return b


@pytest.fixture
def gpu(native: Native, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeGpu:
    monkeypatch.setenv("FAKE_CUDA_GRANULARITY", str(GRANULE))
    monkeypatch.delenv("FAKE_CUDA_CAPACITY", raising=False)
    monkeypatch.delenv("FAKE_CUDA_CORRUPT", raising=False)
    monkeypatch.delenv("FAKE_CUDA_DIRTY", raising=False)  # fresh memory holds garbage
    monkeypatch.delenv("FAKE_CUDA_FAIL", raising=False)
    # this test's GPU, shared with the processes it starts (a second tenant's memory)
    monkeypatch.setenv("FAKE_CUDA_SHARED", str(tmp_path / "fake-gpu"))
    return FakeGpu(native, tmp_path)

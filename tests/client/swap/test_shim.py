"""gpushare's allocator library (``gpushare_alloc.c``) as PyTorch meets it.

Preload route: a process started with the library in ``LD_PRELOAD`` loads a library
linked against the CUDA runtime (``fake_consumer.c``, where libc10_cuda.so stands; the
runtime is ``fake_libcudart.c``), which calls ``cudaMalloc``/``cudaFree`` through the
dynamic linker as PyTorch's caching allocator does. What that allocator relies on is
checked: an out-of-memory answer past the limit that a free (its cache emptied) turns
into a success on retry, frees that really give the memory back (``empty_cache``),
a free that waits for queued work before unmapping (as ``cudaFree`` does), and every
other call (another device, a graph capture, before attach) left to the runtime.
Pool route: the allocator functions a ``torch.cuda.MemPool`` is given."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import tempfile
import textwrap

import pytest

from .conftest import GRANULE, FakeGpu, Native

PRELOADED = textwrap.dedent("""
    import ctypes, json, sys
    from gpushare.client.swap import shim
    libcuda, consumer_path, cudart_path = sys.argv[1:4]
    G = int(sys.argv[4])
    s = shim.load()  # the preloaded one
    out = {"preloaded": bool(shim.preloaded()), "interposing": s.interposing}
    c = ctypes.CDLL(consumer_path)  # RTLD_LOCAL, as Python loads extension modules
    c.consumer_malloc.argtypes = [ctypes.c_size_t, ctypes.POINTER(ctypes.c_uint64)]
    c.consumer_free.argtypes = [ctypes.c_uint64]
    rt = ctypes.CDLL(cudart_path)
    cu = ctypes.CDLL(libcuda)
    cu.fake_cuda_created.restype = ctypes.c_size_t
    cu.fake_cuda_log.restype = ctypes.c_char_p

    def malloc(n):
        p = ctypes.c_uint64()
        return c.consumer_malloc(n, ctypes.byref(p)), p.value

    rc, p = malloc(G)  # before attach: the runtime's
    out["before"] = [rc, s.owns(p), rt.fake_cudart_mallocs()]
    c.consumer_free(p)
    out["before_free"] = rt.fake_cudart_frees()
    s.configure(libcuda, 0, 4 * G, 2 * G)
    s.route(True)
    ra, a = malloc(2 * G)
    rb, b = malloc(2 * G)
    out["ours"] = [ra, rb, s.owns(a), s.owns(b), s.resident, cu.fake_cuda_created()]
    out["past_limit"] = malloc(1)[0]  # cudaErrorMemoryAllocation: PyTorch empties its cache
    cu.fake_cuda_log_clear()
    out["free"] = c.consumer_free(a)  # ... which frees a segment
    out["free_log"] = cu.fake_cuda_log().decode()
    out["after_free"] = [s.resident, cu.fake_cuda_created(), s.owns(a)]
    rc, a2 = malloc(1)  # ... and retries: it fits now
    out["retry"] = [rc, s.owns(a2)]
    s.pause(True)  # a CUDA graph captures: its pool's memory stays the runtime's
    rc, g = malloc(G)
    out["paused"] = [rc, s.owns(g), rt.fake_cudart_mallocs()]
    s.pause(False)
    c.consumer_set_device(1)  # another device of this process: the runtime's
    rc, o = malloc(G)
    out["other_device"] = [rc, s.owns(o), rt.fake_cudart_mallocs()]
    c.consumer_free(g); c.consumer_free(o)
    out["frees"] = rt.fake_cudart_frees()
    c.consumer_set_device(0)
    out["seen"] = s.mallocs_seen
    print(json.dumps(out))
""")


def test_preloaded_cudamalloc_serves_pytorchs_caching_allocator(native: Native, gpu: FakeGpu):
    env = {
        **os.environ,
        "LD_PRELOAD": str(native.shim),
        "FAKE_CUDA_GRANULARITY": str(GRANULE),
    }
    env.pop("GPUSHARE_SHIM", None)
    args = [str(gpu.libcuda), str(native.consumer), str(native.libcudart), str(GRANULE)]
    pr = subprocess.run(
        [sys.executable, "-c", PRELOADED, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert pr.returncode == 0, pr.stderr
    out = json.loads(pr.stdout)
    G = GRANULE
    assert out["preloaded"] and out["interposing"]
    assert out["before"] == [0, False, 1] and out["before_free"] == 1
    assert out["ours"] == [0, 0, True, True, 4 * G, 4 * G]
    assert out["past_limit"] == 2  # cudaErrorMemoryAllocation
    assert "past its memory limit" in pr.stderr
    assert out["free"] == 0
    log = out["free_log"].split(";")
    assert log.index("cuCtxSynchronize") < log.index("cuMemUnmap")  # as cudaFree: wait first
    assert out["after_free"] == [2 * G, 2 * G, False]  # the GPU memory is really given back
    assert out["retry"] == [0, True]
    assert out["paused"] == [0, False, 2] and out["other_device"] == [0, False, 3]
    assert out["frees"] == 3
    assert out["seen"] == 7


def test_without_preload_nothing_is_interposed(gpu: FakeGpu):
    assert not gpu.shim.interposing


def test_the_pool_functions_never_raise_into_c(gpu: FakeGpu, capfd):
    # What a torch.cuda.MemPool is given: C functions, called as PyTorch calls them.
    gpu.backend(limit=4 * GRANULE)
    alloc_t = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
    free_t = ctypes.CFUNCTYPE(
        None, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p
    )
    alloc = alloc_t(ctypes.cast(gpu.shim.lib.gs_pool_alloc, ctypes.c_void_p).value)
    free = free_t(ctypes.cast(gpu.shim.lib.gs_pool_free, ctypes.c_void_p).value)
    va = alloc(3 * GRANULE, 0, None)
    assert va and gpu.shim.resident == 3 * GRANULE
    assert alloc(2 * GRANULE, 0, None) is None  # NULL: PyTorch raises its OOM error
    free(0xDEAD000, GRANULE, 0, None)  # not ours: said, never raised into C
    err = capfd.readouterr().err
    assert "past its memory limit" in err and "not gpushare's memory" in err
    free(va, 3 * GRANULE, 0, None)
    assert gpu.shim.resident == 0 and gpu.physical_bytes == 0


def test_a_full_gpu_is_an_allocation_failure_not_a_crash(gpu: FakeGpu, monkeypatch):
    b = gpu.backend(limit=64 * GRANULE)
    monkeypatch.setenv("FAKE_CUDA_CAPACITY", str(3 * GRANULE))
    from gpushare.errors import SwapError

    with pytest.raises(SwapError, match="cuMemCreate failed: out of memory"):
        b.allocate(4 * GRANULE)
    assert gpu.shim.resident == 0 and gpu.physical_bytes == 0  # undone
    assert b.allocate(3 * GRANULE)


def test_the_library_is_built_once_and_cached(native: Native, tmp_path, monkeypatch):
    from gpushare.client.swap import shim

    monkeypatch.setenv("GPUSHARE_CACHE", str(native.dir / "cache"))
    monkeypatch.delenv("GPUSHARE_SHIM", raising=False)
    assert shim.shim_path(build=False) == str(native.shim)
    monkeypatch.setenv("GPUSHARE_SHIM", str(tmp_path / "nope.so"))
    with pytest.raises(shim.ShimUnavailableError, match=r"GPUSHARE_SHIM=.* is not a file"):
        shim.shim_path()
    monkeypatch.delenv("GPUSHARE_SHIM")
    monkeypatch.setenv("GPUSHARE_CACHE", str(tmp_path / "empty"))
    monkeypatch.setenv("CC", str(tmp_path / "no-cc"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    with pytest.raises(shim.ShimUnavailableError, match="building gpushare's allocator"):
        shim.shim_path()


@pytest.mark.parametrize(
    "call",
    [
        "cuInit",
        "cuDeviceGet",
        "cuDevicePrimaryCtxRetain",
        "cuDeviceGetCount",
        "cuDeviceCanAccessPeer",
        "cuMemGetAllocationGranularity",
    ],
)
def test_a_failed_configure_names_the_call_and_holds_no_context(
    gpu: FakeGpu, monkeypatch: pytest.MonkeyPatch, call: str
):
    from gpushare.errors import SwapError

    monkeypatch.setenv("FAKE_CUDA_DEVICES", "2")  # a peer asked about
    gpu.fail(call, 999)
    with pytest.raises(SwapError, match=f"{call} failed"):
        gpu.shim.configure(str(gpu.libcuda), 0, 4 * GRANULE, GRANULE)
    assert gpu.alive("contexts") == 0  # the primary context's hold given back
    gpu.shim.configure(str(gpu.libcuda), 0, 4 * GRANULE, GRANULE)  # and again, nothing failing
    assert gpu.alive("contexts") == 1  # the library's one hold

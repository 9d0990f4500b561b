"""The ``torch`` backend: its choice and errors everywhere; on a CUDA GPU (``pytest -m gpu``)
the limit, swapped content, stable addresses and CUDA graph replays."""

from __future__ import annotations

import ctypes
import logging

import pytest

from gpushare import protocol as p
from gpushare.client.session import _make_backend
from gpushare.client.swap import torch as tb
from gpushare.client.swap.torch import default_host_bytes, find_device
from gpushare.client.swap.vmm import VmmBackend
from gpushare.errors import GpushareError

from .fake_cuda import FakeDriver

torch = pytest.importorskip("torch", reason="PyTorch is not installed")
CUDA = torch.cuda.is_available()
GiB = 2**30


def welcome(simulated: bool) -> p.Welcome:
    return p.Welcome(
        session=1,
        name="t",
        gpu=0,
        gpu_name="NVIDIA H200" if not simulated else "sim",
        simulated=simulated,
        memory_limit=GiB,
        weight=1.0,
        idle_release_s=0.5,
    )


@pytest.mark.skipif(CUDA, reason="checks the error where CUDA is missing")
def test_a_real_gpu_without_cuda_pytorch_is_a_clear_error():
    with pytest.raises(GpushareError, match="needs PyTorch with CUDA"):
        _make_backend(None, welcome(simulated=False))


def test_backends_refuse_the_wrong_kind_of_gpu():
    with pytest.raises(GpushareError, match="backend='sim'"):
        _make_backend("torch", welcome(simulated=True))
    with pytest.raises(GpushareError, match="backend='torch'"):
        _make_backend("sim", welcome(simulated=False))
    with pytest.raises(GpushareError, match="choose 'torch' or 'sim'"):
        _make_backend("jax", welcome(simulated=True))
    assert _make_backend(None, welcome(simulated=True)).name == "sim"


class _Props:
    def __init__(self, uuid: str) -> None:
        self.uuid = uuid


class _Cuda:
    def __init__(self, uuids: list[str]) -> None:
        self.uuids = uuids

    def device_count(self) -> int:
        return len(self.uuids)

    def get_device_properties(self, i: int) -> _Props:
        return _Props(self.uuids[i])


class _Torch:
    def __init__(self, uuids: list[str]) -> None:
        self.cuda = _Cuda(uuids)


def test_the_cuda_device_is_found_by_the_nodes_gpu_uuid():
    t = _Torch(["aaaa-1", "bbbb-2", "cccc-3"])
    assert find_device(t, "GPU-bbbb-2", 0) == 1
    assert find_device(t, "", 2) == 2  # no UUID: the node's index
    assert find_device(_Torch(["zzzz"]), "GPU-bbbb-2", 5) == 0  # the only one visible
    with pytest.raises(GpushareError, match="CUDA_VISIBLE_DEVICES"):
        find_device(t, "GPU-dddd", 7)


def test_pinned_host_memory_defaults_to_the_limit_within_half_the_host(tmp_path, monkeypatch):
    (tmp_path / "meminfo").write_text("MemAvailable: 8388608 kB\n")  # 8 GiB
    monkeypatch.delenv("GPUSHARE_HOST_MEMORY", raising=False)
    assert default_host_bytes(2 * GiB, str(tmp_path)) == 2 * GiB
    assert default_host_bytes(20 * GiB, str(tmp_path)) == 4 * GiB
    monkeypatch.setenv("GPUSHARE_HOST_MEMORY", "1GiB")
    assert default_host_bytes(20 * GiB, str(tmp_path)) == GiB


def test_the_allocator_functions_pytorch_calls_never_raise_into_c(caplog):
    # The backend minus PyTorch: its allocate/free as C function pointers, called as
    # PyTorch's pluggable allocator calls them, over the modelled driver.
    piece = 64 * 1024
    b = tb.TorchBackend.__new__(tb.TorchBackend)
    VmmBackend.__init__(b, FakeDriver(2**20), 4 * piece, piece_bytes=piece)
    keep = tb._ALLOC(b._alloc), tb._FREE(b._free)
    alloc = tb._ALLOC(ctypes.cast(keep[0], ctypes.c_void_p).value)
    free = tb._FREE(ctypes.cast(keep[1], ctypes.c_void_p).value)
    va = alloc(3 * piece, 0, None)
    assert va and b.resident_bytes == 3 * piece
    with caplog.at_level(logging.WARNING, "gpushare.client.swap"):
        assert alloc(2 * piece, 0, None) is None  # NULL: PyTorch raises its OOM error
        free(0xDEAD000, piece, 0, None)  # not ours: logged, never raised into C
    assert "past its memory limit" in caplog.text and "could not free" in caplog.text
    free(va, 3 * piece, 0, None)
    assert b.resident_bytes == 0


# --- on a CUDA GPU --------------------------------------------------------------------


@pytest.fixture(scope="module")
def backend():
    # One per process, as in a workload: a second would route into its own pool while
    # the first's segments stay cached (and count against the per-process fraction).
    from gpushare.client.swap.torch import TorchBackend

    b = TorchBackend(8 * GiB, host_bytes=8 * GiB)
    assert b.wait_for_host_buffers(120), "pinning 8 GiB took over two minutes"
    yield b
    b.close()
    torch.cuda.set_per_process_memory_fraction(1.0, b.device)
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: run 'pytest -m gpu' on one")
def test_the_memory_limit_raises_out_of_memory_in_the_workload(backend):
    ok = torch.empty(4 * GiB, dtype=torch.uint8, device=backend.device)
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(6 * GiB, dtype=torch.uint8, device=backend.device)
    assert backend.resident_bytes >= 4 * GiB  # the allowed one is ours, swappable
    del ok


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: run 'pytest -m gpu' on one")
def test_swapped_tensors_come_back_intact_at_the_same_addresses(backend):
    dev = backend.device
    xs = [torch.randn(n, device=dev) for n in (1, 1000, 2**20, 300 * 2**20)]
    copies = [x.cpu() for x in xs]
    ptrs = [x.data_ptr() for x in xs]
    free0, _ = torch.cuda.mem_get_info(dev)
    held = backend.resident_bytes
    r = backend.swap_out(held)
    assert r.bytes == held and backend.resident_bytes == 0
    free1, _ = torch.cuda.mem_get_info(dev)
    assert free1 - free0 >= held * 0.99  # the GPU memory was really given back
    backend.swap_in()
    assert [x.data_ptr() for x in xs] == ptrs
    assert all(torch.equal(x.cpu(), c) for x, c in zip(xs, copies, strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: run 'pytest -m gpu' on one")
def test_a_model_and_its_optimizer_train_on_after_a_swap(backend):
    dev = backend.device
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10)
    ).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 512, device=dev), torch.randint(0, 10, (64,), device=dev)
    for _ in range(3):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    before = [q.detach().cpu() for q in model.parameters()]
    state = [s["exp_avg"].cpu() for s in opt.state.values()]
    backend.swap_out(backend.resident_bytes)
    backend.swap_in()
    assert all(torch.equal(a.cpu(), b) for a, b in zip(model.parameters(), before, strict=True))
    assert all(
        torch.equal(s["exp_avg"].cpu(), b) for s, b in zip(opt.state.values(), state, strict=True)
    )
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()  # autograd's thread: ours too
    opt.step()
    assert torch.isfinite(torch.cat([q.flatten() for q in model.parameters()])).all()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: run 'pytest -m gpu' on one")
def test_a_cuda_graph_replays_after_a_swap(backend):
    dev = backend.device
    w = torch.randn(1024, 1024, device=dev)
    a = torch.randn(64, 1024, device=dev)
    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s):  # warm-up, as capture requires
        (a @ w).relu()
    torch.cuda.current_stream(dev).wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = (a @ w).relu()
    backend.swap_out(backend.resident_bytes)
    backend.swap_in()
    new = torch.randn(64, 1024, device=dev)
    a.copy_(new)
    g.replay()
    torch.cuda.synchronize(dev)
    assert torch.allclose(out, (new @ w).relu(), atol=1e-3)

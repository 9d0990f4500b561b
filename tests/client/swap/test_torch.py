"""The ``torch`` backend: its choice and errors everywhere; on a CUDA GPU (``pytest -m gpu``)
the limit, swapped content, stable addresses and CUDA graph replays."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest

from gpushare import protocol as p
from gpushare.client.session import _backend_for
from gpushare.client.swap.base import NO_HOOKS
from gpushare.client.swap.torch import (
    check_allocator_settings,
    choose_route,
    default_host_bytes,
    find_device,
    strip_alloc_conf,
)
from gpushare.errors import GpushareError

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
        _backend_for(None, welcome(simulated=False))(NO_HOOKS)


def test_backends_refuse_the_wrong_kind_of_gpu():
    with pytest.raises(GpushareError, match="backend='sim'"):
        _backend_for("torch", welcome(simulated=True))
    with pytest.raises(GpushareError, match="backend='torch'"):
        _backend_for("sim", welcome(simulated=False))
    with pytest.raises(GpushareError, match="choose 'torch' or 'sim'"):
        _backend_for("jax", welcome(simulated=True))
    assert _backend_for(None, welcome(simulated=True))(NO_HOOKS).name == "sim"


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
    assert find_device(_Torch(["aaaa-1", "mig-cccc-3"]), "MIG-cccc-3", 0) == 1  # an instance
    with pytest.raises(GpushareError, match="CUDA_VISIBLE_DEVICES"):
        find_device(t, "GPU-dddd", 7)


def test_pinned_host_memory_defaults_to_the_limit_within_half_the_host(tmp_path, monkeypatch):
    (tmp_path / "meminfo").write_text("MemAvailable: 8388608 kB\n")  # 8 GiB
    monkeypatch.delenv("GPUSHARE_HOST_MEMORY", raising=False)
    none = str(tmp_path / "no-cgroup")
    assert default_host_bytes(2 * GiB, str(tmp_path), none) == 2 * GiB
    assert default_host_bytes(20 * GiB, str(tmp_path), none) == 4 * GiB
    (tmp_path / "self").mkdir()
    (tmp_path / "self" / "cgroup").write_text("0::/pod\n")
    (tmp_path / "cg" / "pod").mkdir(parents=True)
    (tmp_path / "cg" / "pod" / "memory.max").write_text(str(3 * GiB))
    (tmp_path / "cg" / "pod" / "memory.current").write_text(str(GiB))
    # the pod may take 2 GiB more, not the host's 8: half of it is pinned
    assert default_host_bytes(20 * GiB, str(tmp_path), str(tmp_path / "cg")) == GiB
    monkeypatch.setenv("GPUSHARE_HOST_MEMORY", "1GiB")
    assert default_host_bytes(20 * GiB, str(tmp_path), none) == GiB


def test_the_route_is_preload_where_preloaded_and_can_be_forced():
    assert choose_route(True, {}) == "preload"
    assert choose_route(False, {}) == "pool"
    assert choose_route(True, {"GPUSHARE_TORCH_ROUTE": "pool"}) == "pool"
    with pytest.raises(GpushareError, match="not started with gpushare's allocator in LD_PRELOAD"):
        choose_route(False, {"GPUSHARE_TORCH_ROUTE": "preload"})
    with pytest.raises(GpushareError, match="choose 'preload' or 'pool'"):
        choose_route(False, {"GPUSHARE_TORCH_ROUTE": "ld"})


def test_unswappable_allocator_settings_are_stripped():
    conf = "max_split_size_mb:128,expandable_segments:True,garbage_collection_threshold:0.6"
    assert strip_alloc_conf(conf) == (
        "max_split_size_mb:128,garbage_collection_threshold:0.6",
        ["expandable_segments:True"],
    )
    assert strip_alloc_conf("backend:cudaMallocAsync") == ("", ["backend:cudaMallocAsync"])
    assert strip_alloc_conf("expandable_segments:False") == ("expandable_segments:False", [])


class _AllocTorch:
    """What check_allocator_settings reads and sets of PyTorch."""

    def __init__(self, settings: str, backend: str = "native", setter: bool = True) -> None:
        self.set: list[str] = []
        self._C = type("C", (), {})()
        self._C._accelerator_getAllocatorSettings = lambda: settings
        if setter:
            self._C._accelerator_setAllocatorSettings = self.set.append
        self.cuda = type("Cuda", (), {"get_allocator_backend": staticmethod(lambda: backend)})()


def test_expandable_segments_are_turned_off_at_attach_and_async_refused(caplog):
    t = _AllocTorch("")
    assert check_allocator_settings(t, {}) == [] and t.set == []
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    with caplog.at_level(logging.WARNING, "gpushare.client.swap"):
        notes = check_allocator_settings(t, env)
    assert t.set == ["expandable_segments:False"] and "turned PyTorch's expandable" in caplog.text
    assert notes
    t = _AllocTorch("expandable_segments:True")  # set in the program, not the environment
    check_allocator_settings(t, {})
    assert t.set == ["expandable_segments:False"]
    with pytest.raises(GpushareError, match="cannot turn it off at run time"):
        check_allocator_settings(_AllocTorch("expandable_segments:True", setter=False), {})
    with pytest.raises(GpushareError, match="backend:cudaMallocAsync"):
        check_allocator_settings(_AllocTorch("", backend="cudaMallocAsync"), {})
    with pytest.raises(GpushareError, match="backend:cudaMallocAsync"):
        check_allocator_settings(_AllocTorch(""), {"PYTORCH_ALLOC_CONF": "backend:cudaMallocAsync"})


# --- on a CUDA GPU --------------------------------------------------------------------


@pytest.fixture(scope="module")
def backend():
    # One per process, as in a workload: a second would route into its own pool while
    # the first's segments stay cached (and count against the per-process fraction).
    from gpushare.client.swap.torch import TorchBackend

    # The GPU check sizes the pinned buffers from the host's memory (past them, a swap
    # pins on the spot: slower, the same content).
    host = int(os.environ.get("GPUSHARE_GPU_TEST_BYTES", 8 * GiB))
    b = TorchBackend(8 * GiB, host_bytes=host)
    assert b.wait_for_host_buffers(120), f"pinning {host / GiB:.1f} GiB took over two minutes"
    yield b
    b.close()
    torch.cuda.set_per_process_memory_fraction(1.0, b.device)
    torch.cuda.empty_cache()


def count_equal(x, value: int) -> int:
    """How many of ``x``'s elements are ``value``, 16 Mi at a time: the session's memory is
    near its limit, and a whole-tensor count makes an int64 copy (on the first H200 run a
    512 MiB tensor's sum asked for 4 GiB more: out of memory)."""
    return sum(int((c == value).sum()) for c in x.reshape(-1).split(16 * 2**20))


def take_the_cache(dev) -> list:
    """Tensors holding every large block PyTorch's cache keeps free (a MemPool's cache is
    not emptied), so that the next large allocation is new memory from gpushare's
    allocator. On the first H200 run the 4 GiB an earlier test freed served it instead."""
    held = []
    for seg in torch.cuda.memory_snapshot():
        if seg["device"] != dev.index or seg["segment_type"] != "large":
            continue
        for blk in seg["blocks"]:
            if blk["state"] == "inactive":
                held.append(torch.empty(blk["size"], dtype=torch.uint8, device=dev))
    return held


@pytest.fixture
def gpu(backend):
    """The module's backend, its memory all back on the GPU after each test: one that
    failed between a swap-out and its swap-in (as on the first H200 run) leaves the next
    nothing swapped to miscount."""
    yield backend
    if backend.swapped_bytes:
        backend.swap_in()


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
def test_an_allocation_asks_for_room_before_the_memory_is_made_on_the_gpu(backend):
    # What a session past its grant's bound does (yields, asks the node again): here a
    # hook noting the bytes asked for and the memory the GPU had meanwhile.
    from gpushare.client.swap.base import NO_HOOKS

    asked: list[tuple[int, int]] = []
    cached = take_the_cache(torch.device("cuda", backend.device))
    before = backend.resident_bytes
    backend.set_grow(lambda total: asked.append((total, backend.resident_bytes)))
    try:
        x = torch.empty(512 * 2**20, dtype=torch.uint8, device=backend.device)
    finally:
        backend.set_grow(NO_HOOKS.grow)
        del cached
    assert asked, "the allocator library did not ask before allocating"
    total, had = asked[-1]
    assert total >= had + 512 * 2**20  # asked with the bytes to come, before they came
    assert backend.resident_bytes - before >= 512 * 2**20
    del x
    torch.cuda.empty_cache()


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


# PyTorch's caching allocator behaviours under the preload route, in a process started
# with gpushare's allocator in LD_PRELOAD (as gpushare run starts it).
PRELOADED = textwrap.dedent("""
    import json, torch
    from gpushare.client.swap.torch import TorchBackend
    GiB = 2**30
    b = TorchBackend(8 * GiB, host_bytes=GiB)
    out = {"route": b.route}
    dev = b.device
    # empty_cache gives our memory back
    x = torch.empty(3 * GiB, dtype=torch.uint8, device=dev)
    held = b.resident_bytes
    del x
    torch.cuda.empty_cache()
    out["empty_cache"] = [held, b.resident_bytes]
    # an out-of-memory answer makes PyTorch free its cache and retry
    xs = [torch.empty(GiB, dtype=torch.uint8, device=dev) for _ in range(7)]
    del xs  # 7 GiB cached, free
    y = torch.empty(5 * GiB + 12345, dtype=torch.uint8, device=dev)  # needs a new segment
    out["oom_retry"] = [y.numel(), b.resident_bytes <= 8 * GiB]
    del y
    torch.cuda.empty_cache()
    # record_stream: blocks freed while a side stream uses them are reclaimed
    side = torch.cuda.Stream(dev)
    for _ in range(40):
        t = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev)
        with torch.cuda.stream(side):
            t.add_(1)
        t.record_stream(side)
        del t
        torch.cuda.synchronize(dev)
    out["record_stream_reserved"] = torch.cuda.memory_reserved(dev)
    # and a swap keeps tensors at their addresses
    z = torch.randn(2**26, device=dev)
    ref, ptr = z.cpu(), z.data_ptr()
    b.swap_out(b.resident_bytes)
    out["swapped"] = b.swapped_bytes
    b.swap_in()
    out["intact"] = bool(torch.equal(z.cpu(), ref)) and z.data_ptr() == ptr
    print(json.dumps(out))
""")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: run 'pytest -m gpu' on one")
def test_pytorchs_caching_allocator_keeps_its_behaviour_under_the_preload_route():
    from gpushare.client.swap import shim

    env = {**os.environ, "LD_PRELOAD": shim.shim_path()}
    pr = subprocess.run(
        [sys.executable, "-c", PRELOADED], capture_output=True, text=True, env=env, timeout=300
    )
    assert pr.returncode == 0, pr.stderr
    import json

    out = json.loads(pr.stdout.strip().splitlines()[-1])
    assert out["route"] == "preload", pr.stderr
    held, after = out["empty_cache"]
    assert held >= 3 * GiB and after < 64 * 2**20, out
    assert out["oom_retry"] == [5 * GiB + 12345, True], out
    assert out["record_stream_reserved"] <= 2 * GiB, out  # not 40 blocks of 256 MiB
    assert out["swapped"] > 0 and out["intact"], out


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: run 'pytest -m gpu' on one")
def test_a_discardable_tensor_is_dropped_not_copied_and_comes_back_zeroed(gpu):
    backend = gpu
    dev = backend.device
    keep = torch.randn(2**20, device=dev)
    kept = keep.cpu()
    cache = torch.ones(512 * 2**20, dtype=torch.uint8, device=dev)  # two pieces at least
    try:
        d = backend.discardable_tensor(cache)
        assert d.bytes >= 256 * 2**20 and d.drops == 0
        held = backend.resident_bytes
        r = backend.swap_out(held)
        assert r.discarded == d.bytes  # the marked pieces go first, none copied
        assert backend.discarded_bytes == d.bytes and d.drops > 0
        backend.swap_in()
        assert torch.equal(keep.cpu(), kept)
        assert count_equal(cache, 1) == cache.numel() - d.bytes  # the dropped pieces: zeros
        assert backend.discarded_bytes == 0
    finally:
        del cache  # its mark goes with it, even when an assertion above keeps the frame


def test_discardable_marks_nothing_where_no_session_serves_the_tensor():
    import gpushare

    x = torch.zeros(4096, dtype=torch.uint8)  # run bare: the same call, nothing marked
    d = gpushare.discardable(x)
    assert (d.va, d.size, d.bytes, d.drops) == (x.data_ptr(), 4096, 0, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: run 'pytest -m gpu' on one")
def test_a_discardable_tensors_freed_storage_is_not_dropped_under_the_next_one(gpu):
    backend = gpu
    dev = backend.device
    cache = torch.ones(512 * 2**20, dtype=torch.uint8, device=dev)
    d = backend.discardable_tensor(cache)
    assert d.bytes > 0
    cache.untyped_storage().resize_(0)  # freed while the tensor lives (as FSDP does)
    other = torch.full((512 * 2**20,), 7, dtype=torch.uint8, device=dev)  # may reuse it
    try:
        r = backend.swap_out(backend.resident_bytes)
        assert r.discarded == 0
        backend.swap_in()
        assert count_equal(other, 7) == other.numel()
    finally:
        del cache, other


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: run 'pytest -m gpu' on one")
def test_vllm_style_sleep_mode_memory_is_counted_and_swapped_on_the_gpu(gpu):
    # vLLM's allocator is not here: one following it (fake_vllm: the driver's own
    # cuMemCreate and cuMemMap beside gpushare's allocator, called as vLLM's C extension
    # calls them) in this process, under the session's backend.
    from gpushare.client.swap.vllm_sleep import SleepModeFinder

    from . import fake_vllm

    backend = gpu
    mods, alloc = fake_vllm.modules("libcuda.so.1")  # vLLM's extension: the driver's own
    finder = SleepModeFinder(lambda: None, lambda n: None, modules=mods)
    saved, backend.foreign = backend.foreign, finder
    n = 256 * 2**20
    try:
        vas = {tag: alloc.allocate(n, tag) for tag in ("weights", "kv_cache")}
        datas = {tag: os.urandom(n) for tag in vas}
        for tag, va in vas.items():
            alloc.write(va, datas[tag])
        held = backend.resident_bytes
        assert held >= 2 * n  # vLLM's memory counted with the session's
        free0, _ = torch.cuda.mem_get_info(backend.device)
        backend.swap_out(held)
        assert backend.resident_bytes == 0 and backend.swapped_bytes >= 2 * n
        free1, _ = torch.cuda.mem_get_info(backend.device)
        assert free1 - free0 >= held * 0.99  # vLLM's memory really given back too
        backend.swap_in()
        assert backend.resident_bytes == held
        for tag, va in vas.items():
            assert alloc.read(va, n) == datas[tag], f"{tag} changed"
    finally:
        finder.close()
        backend.foreign = saved
        alloc.free_all()

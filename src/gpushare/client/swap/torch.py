"""The ``torch`` swap backend: a PyTorch workload's CUDA memory, swappable and bounded.

At attach, on the session's device:

* PyTorch's allocator settings are checked: ``expandable_segments`` (PyTorch then maps
  memory itself through the driver, out of gpushare's reach) is turned off, with a
  warning; ``backend:cudaMallocAsync`` (no caching allocator at all) is refused;
* a self-test swaps a few MiB through the driver (reserve, map, copy, unmap, map again,
  compare) before any of the workload's memory depends on it: a driver that fails it is
  a clear error at attach, never a corrupted session;
* the memory limit is set with ``torch.cuda.set_per_process_memory_fraction``, and
  gpushare's allocator refuses past it too: going over raises PyTorch's
  ``torch.OutOfMemoryError`` in that workload, and nowhere else;
* PyTorch's new segments on that device come from gpushare's allocator library
  (:mod:`~gpushare.client.swap.shim`), by one of two routes:

  - ``preload`` (the process was started with the library in ``LD_PRELOAD``, as
    ``gpushare run`` does): the library's ``cudaMalloc``/``cudaFree`` serve PyTorch's
    caching allocator, which works as it does without gpushare (``empty_cache`` frees,
    an out-of-memory error first frees the cache and retries, blocks freed after
    ``record_stream`` are reclaimed). Checked at attach: if PyTorch's ``cudaMalloc`` does
    not reach the library, the pool route is taken, with a warning;
  - ``pool`` (a program that attaches by itself): a ``torch.cuda.MemPool`` given the
    library's allocator functions receives every allocation on the device. PyTorch
    then treats the device as capturing into a pool: ``empty_cache`` keeps the memory,
    an out-of-memory error does not free the cache first, and blocks freed after
    ``record_stream`` stay cached. Said in a warning at attach.

  ``GPUSHARE_TORCH_ROUTE=preload|pool`` forces one. Either way allocation and free run
  in C, without the GIL, under PyTorch's allocator lock;
* while a CUDA graph is being captured the routing pauses, so the graph's own memory
  stays in its private pool (on the GPU; memory the graph reads, such as parameters and
  static inputs, is ours and swaps at stable addresses, so replays stay valid);
* pinned host buffers start being made in the background, within the host's available
  memory and the process's memory cgroup.

Before a swap-out, the workload's queued GPU work is waited for, and (preload route)
PyTorch's cache of free blocks is emptied first: cached bytes are freed, not copied.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
import weakref
from collections.abc import Mapping
from typing import Any

from gpushare.client.swap import shim
from gpushare.client.swap.base import NO_HOOKS, SwapHooks, SwapResult
from gpushare.client.swap.cuda import CudaDriver, self_test
from gpushare.client.swap.host import host_memory_available
from gpushare.client.swap.vllm_sleep import SleepModeFinder
from gpushare.client.swap.vmm import PIECE_BYTES, Discardable, IdleWaiter, VmmBackend
from gpushare.errors import GpushareError, SwapError
from gpushare.units import parse_size

log = logging.getLogger("gpushare.client.swap")

_capture_lock = threading.Lock()
_active: list[TorchBackend] = []  # backends whose routing a graph capture pauses


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        raise GpushareError(
            "the torch backend needs PyTorch: pip install torch (a CUDA build)"
        ) from None
    if not torch.cuda.is_available():
        raise GpushareError(
            "the torch backend needs PyTorch with CUDA and a visible GPU: this PyTorch"
            f" ({torch.__version__}) sees none; check the driver and CUDA_VISIBLE_DEVICES"
        )
    return torch


def find_device(torch: Any, uuid: str, index: int) -> int:
    """The CUDA device of the node's GPU: by UUID, else the only one visible, else the
    node's index (which CUDA numbers the same way with CUDA_DEVICE_ORDER=PCI_BUS_ID)."""
    n = torch.cuda.device_count()
    if uuid:
        want = uuid.removeprefix("GPU-").removeprefix("MIG-").lower()  # a MIG instance's too
        for i in range(n):
            got = str(getattr(torch.cuda.get_device_properties(i), "uuid", "")).lower()
            if got and got.removeprefix("gpu-").removeprefix("mig-") == want:
                return i
    if n == 1:
        return 0
    if 0 <= index < n:
        return index
    raise GpushareError(
        f"the node's GPU {index} ({uuid or 'no UUID'}) is not among the {n} CUDA devices"
        " this process sees: set CUDA_VISIBLE_DEVICES or NVIDIA_VISIBLE_DEVICES to it"
    )


def limit_process_memory(torch: Any, limit: int, device: int) -> float:
    """Cap this process's PyTorch memory on ``device`` at ``limit`` bytes: past it,
    PyTorch raises its out-of-memory error here, and nowhere else. Returns the fraction."""
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = float(min(1.0, limit / total))
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction


def default_host_bytes(limit: int, proc: str = "/proc", cgroup: str = "/sys/fs/cgroup") -> int:
    """Pinned host memory to make at attach: ``GPUSHARE_HOST_MEMORY``, else the limit,
    but at most half of what this process may still take of host memory (the host's
    available memory, within its memory cgroup: two sessions can then pin both)."""
    env = os.environ.get("GPUSHARE_HOST_MEMORY")
    if env:
        return parse_size(env)
    avail = host_memory_available(proc, cgroup)
    return min(limit, avail // 2) if avail else limit


# --- PyTorch's allocator settings ------------------------------------------------------

ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
ENV_ROUTE = "GPUSHARE_TORCH_ROUTE"


def _conf_items(conf: str) -> list[tuple[str, str]]:
    out = []
    for item in conf.split(","):
        key, _, value = item.strip().partition(":")
        if key:
            out.append((key.strip(), value.strip()))
    return out


def _unswappable(key: str, value: str) -> str:
    """Why an allocator setting takes memory out of gpushare's reach ('' if it does not)."""
    if key == "expandable_segments" and value.lower() == "true":
        return "expandable segments (PyTorch maps their memory itself, past cudaMalloc)"
    if key == "backend" and value == "cudaMallocAsync":
        return "the cudaMallocAsync backend (no caching allocator, no cudaMalloc)"
    return ""


def strip_alloc_conf(conf: str) -> tuple[str, list[str]]:
    """``conf`` less the settings gpushare cannot swap under; and those, as said."""
    kept, dropped = [], []
    for key, value in _conf_items(conf):
        if _unswappable(key, value):
            dropped.append(f"{key}:{value}")
        else:
            kept.append(f"{key}:{value}" if value else key)
    return ",".join(kept), dropped


def check_allocator_settings(torch: Any, environ: Mapping[str, str] | None = None) -> list[str]:
    """Turn off what PyTorch may still change (expandable segments), refuse what it
    may not (the cudaMallocAsync backend). Returns the warnings given."""
    env = os.environ if environ is None else environ
    confs = [env.get(v, "") for v in ALLOC_CONF_VARS]
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if getter is not None:
        confs.append(str(getter()))
    items = [kv for conf in confs for kv in _conf_items(conf)]
    backend = getattr(torch.cuda, "get_allocator_backend", lambda: "native")()
    if backend == "cudaMallocAsync" or ("backend", "cudaMallocAsync") in items:
        raise GpushareError(
            "PyTorch's allocator is set to backend:cudaMallocAsync (PYTORCH_CUDA_ALLOC_CONF),"
            " which gpushare cannot swap: remove that setting (gpushare run does)"
        )
    notes = []
    if any(_unswappable(k, v) for k, v in items):
        setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
        if setter is None:
            raise GpushareError(
                "PYTORCH_CUDA_ALLOC_CONF asks for expandable_segments, which gpushare cannot"
                " swap, and this PyTorch cannot turn it off at run time: remove the setting"
            )
        setter("expandable_segments:False")
        notes.append(
            "gpushare turned PyTorch's expandable_segments off (PYTORCH_CUDA_ALLOC_CONF):"
            " PyTorch maps expandable segments itself, where gpushare cannot swap them"
        )
    for note in notes:
        log.warning("%s", note)
    return notes


def choose_route(preloaded: bool, environ: Mapping[str, str] | None = None) -> str:
    """``preload`` where the allocator library was preloaded, else ``pool``; or as
    ``GPUSHARE_TORCH_ROUTE`` says."""
    env = os.environ if environ is None else environ
    want = env.get(ENV_ROUTE, "")
    if want not in ("", "preload", "pool"):
        raise GpushareError(f"{ENV_ROUTE}={want!r} is not a route: choose 'preload' or 'pool'")
    if want == "preload" and not preloaded:
        raise GpushareError(
            f"{ENV_ROUTE}=preload, but this process was not started with gpushare's allocator"
            " in LD_PRELOAD: run it with 'gpushare run', or with"
            " LD_PRELOAD=$(python -m gpushare.client.swap.shim)"
        )
    return want or ("preload" if preloaded else "pool")


SYNC_WAIT_S = 5.0  # a swap-out waits this long at most for the session's GPU work

POOL_WARNING = (
    "gpushare: this process was not started with gpushare's allocator in LD_PRELOAD, so its"
    " CUDA memory goes through a MemPool: torch.cuda.empty_cache() keeps it, an out-of-memory"
    " error does not first free PyTorch's cache, and blocks freed after record_stream are not"
    " reclaimed. Start the program with 'gpushare run' (or"
    " LD_PRELOAD=$(python -m gpushare.client.swap.shim)) to keep PyTorch's allocator as it is"
)


class TorchBackend(VmmBackend):
    name = "torch"
    simulated = False

    def __init__(
        self,
        limit: int,
        gpu_uuid: str = "",
        gpu_index: int = 0,
        host_bytes: int | None = None,
        hooks: SwapHooks = NO_HOOKS,
    ) -> None:
        torch = _torch()
        self._torch = torch
        self.device = find_device(torch, gpu_uuid, gpu_index)
        check_allocator_settings(torch)
        preloaded = shim.preloaded()
        self.route = choose_route(bool(preloaded))
        try:
            lib = shim.load(preloaded or None)
        except shim.ShimUnavailableError as e:
            raise GpushareError(f"the torch backend cannot start: {e}") from None
        driver = CudaDriver(self.device)
        self_test(driver)  # before any of the workload's memory goes through it
        limit_process_memory(torch, limit, self.device)
        lib.configure("libcuda.so.1", self.device, limit, PIECE_BYTES)
        # vLLM's sleep-mode memory, once vLLM makes its allocator (after attach).
        self.sleep_mode = SleepModeFinder(
            lambda: self.on_change(),
            lambda n: self.grow(self.store.resident + n),
            prepin=self._pin_for_vllm,
            hold=lambda: self.hold(),
            holding=lambda: self.holding(),
            mapped=driver.mapped,
        )
        super().__init__(
            driver,
            lib,
            limit,
            host_bytes=default_host_bytes(limit) if host_bytes is None else host_bytes,
            hooks=hooks,
            foreign=self.sleep_mode,
        )
        self.lib = lib
        self._first_limit = limit
        self._idle = IdleWaiter(lambda: torch.cuda.synchronize(self.device))
        self.pool: Any = None
        self._routing = False
        _patch_graph_capture(torch)
        with _capture_lock:
            if self.route == "preload" and not self._preload_reaches_pytorch():
                log.warning(
                    "gpushare: PyTorch's cudaMalloc does not reach gpushare's preloaded"
                    " allocator (a CUDA runtime linked statically?): using a MemPool"
                )
                self.route = "pool"
            if self.route == "pool":
                log.warning("%s", POOL_WARNING)
                self._make_pool()
            _active.append(self)

    def set_limit(self, limit: int) -> None:
        """PyTorch's cap moved to ``limit`` (never past the limit the allocator was
        configured with at the start: its host memory and pieces were sized by it)."""
        self.limit = min(limit, self._first_limit)
        limit_process_memory(self._torch, self.limit, self.device)

    def _preload_reaches_pytorch(self) -> bool:
        """Route ``cudaMalloc`` here, and check that a new PyTorch segment came through."""
        torch, lib = self._torch, self.lib
        lib.route(True)
        with torch.cuda.device(self.device):
            torch.cuda.empty_cache()
            free_cached = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
            seen = lib.mallocs_seen
            try:
                x = torch.empty(free_cached + 2**21, dtype=torch.uint8, device=self.device)
            except RuntimeError:  # past the limit: what counts is that it was asked here
                came = lib.mallocs_seen > seen
            else:
                came = lib.mallocs_seen > seen and lib.owns(x.data_ptr())
                del x
            torch.cuda.empty_cache()
        if not came:
            lib.route(False)
        return came

    def _make_pool(self) -> None:
        torch = self._torch
        alloc_fn = ctypes.cast(self.lib.lib.gs_pool_alloc, ctypes.c_void_p).value
        free_fn = ctypes.cast(self.lib.lib.gs_pool_free, ctypes.c_void_p).value
        allocator = torch._C._cuda_customAllocator(alloc_fn, free_fn)
        with torch.cuda.device(self.device):  # the pool is the session's device's
            self.pool = torch.cuda.MemPool(allocator)
        self._route(True)

    def _route(self, on: bool) -> None:
        """Pool route: send every new allocation on the device to our pool (or stop)."""
        if on and not self._routing:
            self._torch._C._cuda_beginAllocateToPool(self.device, self.pool.id)
        elif not on and self._routing:
            self._torch._C._cuda_endAllocateToPool(self.device, self.pool.id)
        self._routing = on

    def _pause(self, on: bool) -> None:
        """A CUDA graph captures (``on``) or is done: its memory is not ours."""
        if self.route == "preload":
            self.lib.pause(on)
        else:
            self._route(not on)

    def synchronize(self) -> None:
        self._torch.cuda.synchronize(self.device)

    def limit_fix(self) -> str:
        total = self._torch.cuda.get_device_properties(self.device).total_memory
        return (
            f"Start vLLM with --gpu-memory-utilization {self.limit / total:.2f} or less"
            f" (this process's limit of the GPU's {total} bytes)"
        )

    def _pin_for_vllm(self, sizes: list[int]) -> None:
        """Pinned host memory of these sizes, made and let go at once: PyTorch's cache of
        pinned memory keeps it for vLLM's sleep, which asks for the same sizes (within
        half of what the host can still give)."""
        budget = host_memory_available() // 2
        held = []
        try:
            for n in sorted(sizes, reverse=True):
                if n > budget:
                    continue
                held.append(self._torch.empty(n, dtype=self._torch.uint8, pin_memory=True))
                budget -= n
        except RuntimeError as e:  # out of host memory: vLLM's sleep pins the rest itself
            log.info("gpushare: pinning host memory ahead for vLLM stopped: %s", e)
        del held

    def discardable_tensor(self, tensor: Any) -> Discardable:
        """Mark ``tensor``'s storage (a KV cache, say) as memory the workload can rebuild:
        dropped rather than copied when the node takes memory back, zeros when it comes
        back; the mark's ``drops`` grows each time (rebuild then). The mark goes with
        the tensor's storage as it is now, checked before each swap-out: once the tensor
        is collected, or its storage freed or replaced, that memory may be another
        tensor's, and it is copied."""
        dev = tensor.device
        if dev.type != "cuda" or dev.index != self.device:
            raise ValueError(
                f"a discardable tensor must be on this session's GPU (cuda:{self.device}),"
                f" not {dev}"
            )
        st = tensor.untyped_storage()
        va, size, ref = st.data_ptr(), st.nbytes(), weakref.ref(tensor)

        def still() -> bool:
            t = ref()
            if t is None:
                return False
            s = t.untyped_storage()
            return bool(s.data_ptr() == va and s.nbytes() == size)

        return self.discardable(va, size, still)

    def swap_out(self, nbytes: int) -> SwapResult:
        torch = self._torch
        # No kernel may touch what leaves. Bounded, and off this thread: a swap-out the
        # node asks of a session with no grant runs on the client's reader thread, which
        # must not hang behind a pending collective (it reads what frees it).
        self._idle.wait(SYNC_WAIT_S)
        if nbytes > 0 and self.route == "preload":
            # Blocks PyTorch caches but nothing uses are freed, not copied (a MemPool's
            # cache cannot be emptied: the pool route copies them).
            before = self.resident_bytes
            with torch.cuda.device(self.device):
                torch.cuda.empty_cache()
            nbytes -= before - self.resident_bytes
        return super().swap_out(max(0, nbytes))

    def close(self) -> None:
        with _capture_lock:
            if self in _active:
                _active.remove(self)
            if self.route == "preload":
                self.lib.route(False)  # later allocations are the runtime's again
            else:
                self._route(False)
        super().close()
        with contextlib.suppress(SwapError):
            self.driver.close()  # our hold on the primary context: PyTorch keeps its own


_patched = False


def _patch_graph_capture(torch: Any) -> None:
    """Pause our routing while any CUDA graph captures (see the module doc)."""
    global _patched
    if _patched:
        return
    cls = torch.cuda.CUDAGraph
    begin, end = cls.capture_begin, cls.capture_end

    def capture_begin(self: Any, *args: Any, **kwargs: Any) -> Any:
        with _capture_lock:
            for b in _active:
                b._pause(True)
        try:
            return begin(self, *args, **kwargs)
        except BaseException:
            _resume()
            raise

    def capture_end(self: Any) -> Any:
        try:
            return end(self)
        finally:
            _resume()

    cls.capture_begin, cls.capture_end = capture_begin, capture_end
    _patched = True


def _resume() -> None:
    with _capture_lock:
        for b in _active:
            b._pause(False)

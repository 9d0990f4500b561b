"""The ``torch`` swap backend: a PyTorch workload's CUDA memory, swappable and bounded.

At attach, on the session's device:

* the memory limit is set with ``torch.cuda.set_per_process_memory_fraction``, and the
  allocator below refuses past it too: going over raises PyTorch's
  ``torch.OutOfMemoryError`` in that workload, and nowhere else;
* a ``torch.cuda.MemPool`` whose segments come from :class:`~gpushare.client.swap.vmm.VmmBackend`
  (CUDA virtual memory) receives every later allocation on that device, from every
  thread (autograd's included), so all of it can be swapped out and back at the same
  addresses without the program's help;
* while a CUDA graph is being captured the routing pauses, so the graph's own memory
  stays in its private pool (on the GPU; memory the graph reads, such as parameters and
  static inputs, is ours and swaps at stable addresses, so replays stay valid);
* pinned host buffers start being made in the background.

The allocator's two functions are ctypes callbacks (PyTorch calls them only when its
caching allocator needs a new segment, or empties its cache), so they take the GIL:
a program whose Python threads free CUDA tensors while another thread makes PyTorch grow
its cache could, in principle, deadlock on the GIL and the allocator's lock. Training
loops and inference servers with one Python thread doing GPU work do not.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from typing import Any

from gpushare.client.swap.base import SwapResult
from gpushare.client.swap.cuda import CudaDriver
from gpushare.client.swap.vmm import VmmBackend, mem_available
from gpushare.errors import GpushareError, OutOfMemoryError
from gpushare.units import parse_size

log = logging.getLogger("gpushare.client.swap")

_ALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
_FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
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
        want = uuid.removeprefix("GPU-").lower()
        for i in range(n):
            got = str(getattr(torch.cuda.get_device_properties(i), "uuid", "")).lower()
            if got and got.removeprefix("gpu-") == want:
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


def default_host_bytes(limit: int, proc: str = "/proc") -> int:
    """Pinned host memory to make at attach: ``GPUSHARE_HOST_MEMORY``, else the limit,
    but at most half the host's available memory (two sessions can then pin both)."""
    env = os.environ.get("GPUSHARE_HOST_MEMORY")
    if env:
        return parse_size(env)
    avail = mem_available(proc)
    return min(limit, avail // 2) if avail else limit


class TorchBackend(VmmBackend):
    name = "torch"
    simulated = False

    def __init__(
        self,
        limit: int,
        gpu_uuid: str = "",
        gpu_index: int = 0,
        host_bytes: int | None = None,
    ) -> None:
        torch = _torch()
        self._torch = torch
        self.device = find_device(torch, gpu_uuid, gpu_index)
        limit_process_memory(torch, limit, self.device)
        super().__init__(
            CudaDriver(self.device),
            limit,
            host_bytes=default_host_bytes(limit) if host_bytes is None else host_bytes,
        )
        # Keep the callbacks alive as long as PyTorch may call them (the process).
        self._c_alloc = _ALLOC(self._alloc)
        self._c_free = _FREE(self._free)
        alloc_fn = ctypes.cast(self._c_alloc, ctypes.c_void_p).value
        free_fn = ctypes.cast(self._c_free, ctypes.c_void_p).value
        allocator = torch._C._cuda_customAllocator(alloc_fn, free_fn)
        self.pool = torch.cuda.MemPool(allocator)
        self._routing = False
        _patch_graph_capture(torch)
        with _capture_lock:
            self._route(True)
            _active.append(self)

    def _route(self, on: bool) -> None:
        """Send every new allocation on the device to our pool (or stop)."""
        if on and not self._routing:
            self._torch._C._cuda_beginAllocateToPool(self.device, self.pool.id)
        elif not on and self._routing:
            self._torch._C._cuda_endAllocateToPool(self.device, self.pool.id)
        self._routing = on

    def _alloc(self, size: int, device: int, stream: int) -> int:
        # Called by PyTorch's allocator: never raise into C; 0 makes it raise OOM.
        try:
            return self.allocate(size)
        except OutOfMemoryError as e:
            log.warning("%s", e)
        except Exception as e:
            log.error("gpushare could not allocate %d bytes of GPU memory: %s", size, e)
        return 0

    def _free(self, ptr: int | None, size: int, device: int, stream: int) -> None:
        try:
            if ptr:
                self.free(ptr)
        except Exception as e:
            log.error("gpushare could not free GPU memory at %#x: %s", ptr or 0, e)

    def synchronize(self) -> None:
        self._torch.cuda.synchronize(self.device)

    def swap_out(self, nbytes: int) -> SwapResult:
        self._torch.cuda.synchronize(self.device)  # no kernel may touch what leaves
        return super().swap_out(nbytes)

    def close(self) -> None:
        with _capture_lock:
            if self in _active:
                _active.remove(self)
            self._route(False)
        super().close()


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
                b._route(False)
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
            b._route(True)

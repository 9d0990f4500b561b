"""vLLM's sleep-mode allocator as vLLM has it (``vllm/device_allocator/cumem.py``: the
``CuMemAllocator`` singleton and its ``AllocationData``), over the fake libcuda: vLLM's C
extension reserves an address range and creates and maps memory there; ``sleep`` copies
the offloaded tags' bytes to host memory (a synchronous ``cudaMemcpy``) and unmaps and
releases every allocation, whatever its state; ``wake_up`` creates and maps memory again
at the same addresses and copies back what was kept, and if that fails part way unmaps
what it mapped (host copies it had let go of are lost). vLLM needs CUDA, so its own
allocator cannot run here; this follows its names and behaviour, bytes and all, through
the driver (the fake libcuda here, a GPU's under ``pytest -m gpu``)."""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

from gpushare.client.swap.cuda import Driver


@dataclass
class HostCopy:
    """What vLLM's ``cpu_backup_tensor`` holds: a pinned host copy of an allocation."""

    ptr: int
    size: int


@dataclass
class AllocationData:
    handle: tuple[int, int, int, int]  # (device, size, address, memory handle)
    tag: str
    cpu_backup_tensor: Any = None


class CuMemAllocator:
    instance: CuMemAllocator | None = None
    default_tag = "default"

    def __init__(self, driver: Driver) -> None:
        self.driver = driver
        self.pointer_to_data: dict[int, AllocationData] = {}
        with driver.context():
            self.stream = driver.new_stream()  # its copies, waited for at once

    def allocate(self, size: int, tag: str) -> int:
        """What a tensor made inside ``use_memory_pool(tag)`` gets (the C extension's
        ``my_malloc`` and the malloc callback)."""
        with self.driver.context():
            va = self.driver.reserve(size)
            h = self.driver.create(size)
            self.driver.map(va, size, h)
        self.pointer_to_data[va] = AllocationData((0, size, va, h), tag)
        return va

    def sleep(self, offload_tags: tuple[str, ...] | str | None = None) -> None:
        if offload_tags is None:
            offload_tags = (self.default_tag,)
        elif isinstance(offload_tags, str):
            offload_tags = (offload_tags,)
        with self.driver.context():
            for va, data in self.pointer_to_data.items():
                _, size, _, h = data.handle
                if data.tag in offload_tags:
                    backup = HostCopy(self.driver.host_alloc(size), size)  # pinned, as vLLM's
                    self.driver.copy_dtoh(backup.ptr, va, size, self.stream)
                    self.driver.synchronize()  # vLLM's cudaMemcpy is synchronous
                    data.cpu_backup_tensor = backup
                self.driver.unmap(va, size)  # raises if it is not mapped (as CUDA does)
                self.driver.release(h)

    def wake_up(self, tags: list[str] | None = None) -> None:
        mapped = []  # on a failure vLLM unmaps what this call mapped, copied back or not
        try:
            with self.driver.context():
                for va, data in self.pointer_to_data.items():
                    if tags is None or data.tag in tags:
                        dev, size, _, _ = data.handle
                        h = self.driver.create(size)
                        self.driver.map(va, size, h)
                        data.handle = (dev, size, va, h)
                        mapped.append(va)
                        backup = data.cpu_backup_tensor
                        if backup is not None:
                            self.driver.copy_htod(va, backup.ptr, size, self.stream)
                            self.driver.synchronize()
                            self.driver.host_free(backup.ptr)
                            data.cpu_backup_tensor = None
        except Exception:
            with self.driver.context():
                for va in mapped:
                    _, size, _, h = self.pointer_to_data[va].handle
                    self.driver.unmap(va, size)
                    self.driver.release(h)
            raise

    def free_all(self) -> None:
        """What vLLM's free callback and C extension do as the tensors go (mapped ones)."""
        with self.driver.context():
            for va, data in self.pointer_to_data.items():
                _, size, _, h = data.handle
                self.driver.unmap(va, size)
                self.driver.release(h)
                self.driver.unreserve(va, size)
        self.pointer_to_data.clear()

    def get_current_usage(self) -> int:
        return sum(d.handle[1] for d in self.pointer_to_data.values())


def modules(driver: Driver) -> tuple[dict[str, Any], CuMemAllocator]:
    """A ``sys.modules`` in which vLLM made its allocator (as its worker does at
    ``load_model`` with sleep mode on)."""
    mod = types.ModuleType("vllm.device_allocator.cumem")
    cls = type("CuMemAllocator", (CuMemAllocator,), {})  # the singleton is this test's
    inst = cls(driver)
    cls.instance = inst
    mod.CuMemAllocator = cls  # type: ignore[attr-defined]
    return {"vllm.device_allocator.cumem": mod}, inst

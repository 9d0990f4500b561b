"""GPU discovery through a fake NVML module shaped like nvidia-ml-py's pynvml."""

import types

import pytest

from gpushare.node.host.gpus import find_gpus, nvml_gpus, simulated_gpus
from gpushare.node.observe.utilization import NvmlUtilization


class NVMLError(Exception):
    pass


def fake_nvml(devices, init_error=None):
    m = types.ModuleType("pynvml")

    def nvmlInit():
        if init_error:
            raise NVMLError(init_error)

    m.nvmlInit = nvmlInit
    m.nvmlDeviceGetCount = lambda: len(devices)
    m.nvmlDeviceGetHandleByIndex = lambda i: devices[i]
    m.nvmlDeviceGetName = lambda h: h["name"]  # bytes in old bindings, str in new
    m.nvmlDeviceGetUUID = lambda h: h["uuid"]
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=h["mem"], free=0, used=0)
    # MIG as nvidia-ml-py has it: the mode as [current, pending] (NotSupported on a GPU
    # without MIG), a number of slots, a handle per slot holding an instance (NotFound
    # for an empty one); an instance's handle answers name, UUID, memory and processes.
    m.NVML_DEVICE_MIG_ENABLE = 1

    def nvmlDeviceGetMigMode(h):
        if "mig" not in h:
            raise NVMLError("Not Supported")
        return [1, 1] if h["mig"] is not None else [0, 0]

    def nvmlDeviceGetMaxMigDeviceCount(h):
        if not h.get("mig"):
            raise NVMLError("Not Supported")
        return len(h["mig"])

    def nvmlDeviceGetMigDeviceHandleByIndex(h, i):
        if not h.get("mig") or h["mig"][i] is None:
            raise NVMLError("Not Found")
        return h["mig"][i]

    m.nvmlDeviceGetMigMode = nvmlDeviceGetMigMode
    m.nvmlDeviceGetMaxMigDeviceCount = nvmlDeviceGetMaxMigDeviceCount
    m.nvmlDeviceGetMigDeviceHandleByIndex = nvmlDeviceGetMigDeviceHandleByIndex
    m.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=h["util"], memory=0)
    m.nvmlDeviceGetComputeRunningProcesses = lambda h: [
        types.SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in h.get("procs", [])
    ]
    return m


G = 2**30


def test_a_mig_gpu_is_its_instances_each_with_its_own_memory():
    slices = [
        {"name": "NVIDIA H200 MIG 3g.71gb", "uuid": "MIG-aaaa", "mem": 71 * G, "procs": [(7, G)]},
        None,  # an empty slot
        {"name": "NVIDIA H200 MIG 1g.18gb", "uuid": "MIG-bbbb", "mem": 18 * G, "util": 0},
    ]
    nv = fake_nvml(
        [
            {"name": "NVIDIA H200", "uuid": "GPU-mig", "mem": 140 * G, "mig": slices, "util": 0},
            {"name": "NVIDIA H200", "uuid": "GPU-whole", "mem": 140 * G, "mig": None, "util": 40},
            {"name": "NVIDIA H200", "uuid": "GPU-old", "mem": 140 * G, "util": 50},  # no MIG
        ]
    )
    gpus = nvml_gpus(nv)
    assert [(g.index, g.uuid, g.memory_bytes, g.nvml_index, g.mig_index) for g in gpus] == [
        (0, "MIG-aaaa", 71 * G, 0, 0),
        (1, "MIG-bbbb", 18 * G, 0, 2),
        (2, "GPU-whole", 140 * G, 1, -1),
        (3, "GPU-old", 140 * G, 2, -1),
    ]
    # The node's samplers read each instance through its own handle: its processes'
    # memory; no device utilization (NVML has none for an instance: the lease's model).
    mig = NvmlUtilization(nv, gpus[0].nvml_index, gpus[0].mig_index)
    assert mig.device() is None and mig.memory() == {7: G}
    whole = NvmlUtilization(nv, gpus[2].nvml_index, gpus[2].mig_index)
    assert whole.device() == 0.4 and whole.memory() == {}
    # MIG on and no instance yet: nothing of that GPU to share
    assert nvml_gpus(fake_nvml([{"name": "x", "uuid": "GPU-e", "mem": G, "mig": [None]}])) == []


def test_nvml_devices_become_gpus():
    nv = fake_nvml(
        [
            {"name": b"NVIDIA H200", "uuid": "GPU-aaa", "mem": 150_000_000_000},
            {"name": "NVIDIA H200", "uuid": b"GPU-bbb", "mem": 150_000_000_000},
        ]
    )
    gpus = nvml_gpus(nv)
    assert [(g.index, g.name, g.uuid, g.simulated) for g in gpus] == [
        (0, "NVIDIA H200", "GPU-aaa", False),
        (1, "NVIDIA H200", "GPU-bbb", False),
    ]


def test_no_driver_is_a_reason_not_a_crash(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml([], "Driver Not Loaded"))
    gpus, why, nvml = find_gpus()
    assert gpus == [] and "Driver Not Loaded" in why and nvml is None


def test_missing_bindings_name_the_fix():
    gpus, why, _ = find_gpus("gpushare_no_such_module")
    assert gpus == [] and "pip install" in why


@pytest.mark.parametrize("n", [1, 3])
def test_simulated_gpus_are_marked(n):
    gpus = simulated_gpus(n, 80 * 2**30)
    assert len(gpus) == n and all(g.simulated and "Simulated" in g.name for g in gpus)
    assert len({g.uuid for g in gpus}) == n

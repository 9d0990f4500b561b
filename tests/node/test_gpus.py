"""GPU discovery through a fake NVML module shaped like nvidia-ml-py's pynvml."""

import types

import pytest

from gpushare.node.gpus import find_gpus, nvml_gpus, simulated_gpus


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
    return m


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

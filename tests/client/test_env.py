"""The workload's environment, as KAI Scheduler and the downward API leave it."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from gpushare.client.env import (
    SHARING_MODE_ANNOTATION,
    WorkloadEnv,
    memory_figures,
    parse_quantity,
    program_name,
    rank_gpu,
    read_annotations,
    read_env,
)
from tests.support import FIXTURES

FIX = FIXTURES
UUID = "GPU-3666b35e-61f4-d92f-83ca-269ddb7c2712"


def test_kai_fractional_pod():
    env = read_env(
        {
            "GPU_PORTION": "0.5",
            "NVIDIA_VISIBLE_DEVICES": UUID,
            "POD_NAME": "train-half-gpu",
            "POD_UID": "u-1",
        },
        FIX / "podinfo-kai",
    )
    assert env.portion == 0.5 and env.memory is None
    assert env.gpu is None and env.gpu_uuid == UUID
    assert env.pod == "train-half-gpu" and env.pod_uid == "u-1"


def test_annotation_fraction_when_kai_sets_no_env():
    env = read_env({}, FIX / "podinfo-kai")
    assert env.portion == 0.5


def test_gpu_memory_annotation_in_mib():
    env = read_env({"NVIDIA_VISIBLE_DEVICES": "1,2"}, FIX / "podinfo-kai-memory")
    assert env.memory == 2000 * 2**20 and env.gpu == 1


def test_explicit_memory_wins():
    env = read_env({"GPUSHARE_MEMORY": "3GiB"}, FIX / "podinfo-kai-memory")
    assert env.memory == 3 * 2**30


def test_go_quoted_values():
    assert read_annotations(FIX / "podinfo-kai-memory")["note"] == 'a "quoted" value'
    assert read_annotations(FIX / "nowhere") == {}


@pytest.mark.parametrize("visible", ["all", "none", "void", ""])
def test_visible_devices_that_name_no_one_gpu(visible):
    env = read_env({"NVIDIA_VISIBLE_DEVICES": visible}, FIX / "nowhere")
    assert env.gpu is None and env.gpu_uuid == ""


@pytest.mark.parametrize(("key", "value"), [("GPU_PORTION", "1.5"), ("GPU_PORTION", "half")])
def test_bad_fraction_names_the_fix(key, value):
    with pytest.raises(ValueError, match="gpu-fraction annotation"):
        read_env({key: value}, FIX / "nowhere")


@pytest.mark.parametrize(
    ("argv0", "orig", "name"),
    [
        ("train.py", ["python3", "train.py", "--lr", "1"], "train.py"),
        ("/opt/job/train.py", ["python3", "-u", "/opt/job/train.py"], "train.py"),
        ("-c", ["python3", "-c", "import gpushare"], "python-c"),
        ("-c", ["python3", "-ic", "import gpushare"], "python-c"),  # -i -c
        ("-m", ["python3", "-X", "dev", "-um", "mnist"], "mnist"),
        ("/x/site-packages/mnist/__main__.py", ["python3", "-m", "mnist", "--e", "2"], "mnist"),
        ("-m", ["python3", "-W", "error", "-mtorch.distributed.run"], "torch.distributed.run"),
        ("", [], "python"),
        ("-c", [], "python"),
    ],
)
def test_a_sessions_default_name_is_its_program(argv0, orig, name):
    assert program_name(argv0, orig) == name


@pytest.mark.parametrize(
    ("env", "gpu"),
    [
        ({}, None),  # not a rank
        ({"LOCAL_RANK": "1"}, 1),
        ({"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "2,3"}, 3),
        ({"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": "1", "NVIDIA_VISIBLE_DEVICES": "4,6"}, 6),
        ({"LOCAL_RANK": "1", "NVIDIA_VISIBLE_DEVICES": "all"}, 1),
        ({"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "0"}, None),  # fewer than ranks
        ({"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": "GPU-1a2b"}, None),  # a UUID: unknown
    ],
)
def test_a_ranks_gpu_is_its_local_rank_through_the_visible_devices(env, gpu):
    assert rank_gpu(env) == gpu


# Memory request and limit, as KAI Scheduler writes them (issue 23). Each pod below is a
# recorded downward-API annotations file written into a tmp dir.

GiB, MiB = 2**30, 2**20
NV = "nvidia.com/container.{}.gpu-memory.{}"  # NvFractions, Kubernetes quantities
PORTION_LIMIT = "kai.scheduler/container.{}.gpu-memory.portion.limit"


def podinfo(tmp_path, **notes: str):
    """A downward-API folder with these annotations (and kubelet's own, as a pod has)."""
    lines = ['kubernetes.io/config.source="api"']
    lines += [f"{k}={json.dumps(v)}" for k, v in notes.items()]
    (tmp_path / "annotations").write_text("\n".join(lines) + "\n")
    return tmp_path


def test_existing_pods_get_no_limit_and_no_mode():
    for fix in ("podinfo-kai", "podinfo-kai-memory", "nowhere"):
        env = read_env({}, FIX / fix)
        assert (env.memory_limit, env.portion_limit, env.sharing_mode) == (None, None, "")


def test_old_constructors_still_build_a_workload_env():
    env = WorkloadEnv("s", 1, None, None, "", "", "", "", "")
    assert (env.memory_limit, env.portion_limit, env.sharing_mode) == (None, None, "")
    with pytest.raises(dataclasses.FrozenInstanceError):
        env.memory_limit = 2  # type: ignore[misc]


def test_gpushare_memory_limit_beside_the_request():
    env = read_env({"GPUSHARE_MEMORY": "20GiB", "GPUSHARE_MEMORY_LIMIT": "60GiB"}, FIX / "x")
    assert (env.memory, env.memory_limit, env.portion_limit) == (20 * GiB, 60 * GiB, None)
    with pytest.raises(ValueError, match=r"^GPUSHARE_MEMORY_LIMIT: cannot read size"):
        read_env({"GPUSHARE_MEMORY_LIMIT": "lots"}, FIX / "x")


def test_env_limits_in_order_of_precedence(tmp_path):
    pod = podinfo(tmp_path, **{"gpu-memory": "4096", "gpu-memory.limit": "16Gi"})
    env = {
        "GPUSHARE_MEMORY_LIMIT": "12GiB",
        "GPU_MEMORY_LIMIT": str(10 * GiB),
        "NVIDIA_GPU_MEMORY_LIMIT": "9216",
        "CUDA_DEVICE_MEMORY_LIMIT": "8192m",
    }
    seen = []
    for var in [*env, None]:
        seen.append(read_env(env, pod).memory_limit)
        env.pop(var or "", None)
    assert seen == [12 * GiB, 10 * GiB, 9 * GiB, 8 * GiB, 16 * GiB]


@pytest.mark.parametrize(
    ("value", "size"), [(str(40 * GiB), 40 * GiB), ("40GiB", 40 * GiB), ("1.5GiB", 3 * GiB // 2)]
)
def test_kai_gpu_memory_limit_is_bytes_or_a_size(value, size):
    assert read_env({"GPU_MEMORY_LIMIT": value}, FIX / "x").memory_limit == size


def test_kai_gpu_memory_limit_in_mib_by_mistake_is_refused():
    # KAI's withdrawn first GPU_MEMORY_LIMIT wrote MiB; as bytes it would hold to nothing.
    with pytest.raises(ValueError, match=r"reads as 2000 bytes.*GPU_MEMORY_LIMIT=2000MiB"):
        read_env({"GPU_MEMORY_LIMIT": "2000"}, FIX / "x")


def test_hamicore_limit_beside_a_fraction(tmp_path):
    # KAI's hamicore binder plugin: CUDA_DEVICE_MEMORY_LIMIT=<MiB>m, with GPU_PORTION.
    env = read_env(
        {"GPU_PORTION": "0.25", "CUDA_DEVICE_MEMORY_LIMIT": "20480m"},
        podinfo(tmp_path, **{"gpu-fraction": "0.25"}),
    )
    assert (env.portion, env.memory, env.memory_limit) == (0.25, None, 20 * GiB)
    assert read_env({"CUDA_DEVICE_MEMORY_LIMIT": "20g"}, FIX / "x").memory_limit == 20 * GiB
    with pytest.raises(ValueError, match=r"CUDA_DEVICE_MEMORY_LIMIT=.20GiB.*20480m"):
        read_env({"CUDA_DEVICE_MEMORY_LIMIT": "20GiB"}, FIX / "x")


def test_nvfractions_request_and_limit_of_this_container(tmp_path):
    pod = podinfo(
        tmp_path,
        **{
            NV.format("gpu-workload", "request"): "4096Mi",
            NV.format("gpu-workload", "limit"): "8Gi",
            "nvidia.com/container.gpu-workload.gpus.devices": "GPU-0",  # the binder's
        },
    )
    for environ in ({"CONTAINER_NAME": "gpu-workload"}, {}):  # unset: the one named
        env = read_env(environ, pod)
        assert (env.memory, env.memory_limit) == (4096 * MiB, 8 * GiB)
    env = read_env({"CONTAINER_NAME": "sidecar"}, pod)  # the fraction is another's
    assert (env.memory, env.memory_limit) == (None, None)


def test_nvfractions_node_runtime_env_in_mib(tmp_path):
    # kai-gpu-fractioning's fractiond injects both, whole MiB, before the container starts.
    env = {"NVIDIA_GPU_MEMORY_REQUEST": "4096", "NVIDIA_GPU_MEMORY_LIMIT": "8192"}
    pod = podinfo(tmp_path, **{NV.format("t", "request"): "4Gi", NV.format("t", "limit"): "8Gi"})
    for folder in (pod, FIX / "nowhere"):  # with or without the downward-API volume
        got = read_env(env, folder)
        assert (got.memory, got.memory_limit) == (4 * GiB, 8 * GiB)
    plural = {"NVIDIA_GPU_MEMORY_REQUESTS": "4096", "NVIDIA_GPU_MEMORY_LIMITS": "8192"}
    got = read_env(plural, FIX / "nowhere")  # fractiond's first spelling
    assert (got.memory, got.memory_limit) == (4 * GiB, 8 * GiB)
    with pytest.raises(ValueError, match=r"NVIDIA_GPU_MEMORY_LIMIT='8Gi'.*whole number of MiB"):
        read_env({"NVIDIA_GPU_MEMORY_LIMIT": "8Gi"}, FIX / "nowhere")


def test_nvfractions_fraction_pod_is_held_to_what_the_driver_enforces(tmp_path):
    # A gpu-fraction pod: the binder wrote sizes from the fractions, fractiond injected
    # them; the request stays the fraction, the limit is the size the driver enforces.
    pod = podinfo(
        tmp_path,
        **{
            "gpu-fraction": "0.5",
            PORTION_LIMIT.format("t"): "0.8",
            NV.format("t", "request"): "40960Mi",
            NV.format("t", "limit"): "65536Mi",
        },
    )
    env = {"NVIDIA_GPU_MEMORY_REQUEST": "40960", "NVIDIA_GPU_MEMORY_LIMIT": "65536"}
    got = read_env(env, pod)
    assert (got.portion, got.memory, got.memory_limit, got.portion_limit) == (
        0.5,
        None,
        64 * GiB,
        None,
    )


def test_annotations_for_two_containers_need_container_name(tmp_path):
    pod = podinfo(tmp_path, **{NV.format("a", "request"): "1Gi", NV.format("b", "request"): "2Gi"})
    with pytest.raises(ValueError, match="containers a, b: set CONTAINER_NAME"):
        read_env({}, pod)
    assert read_env({"CONTAINER_NAME": "b"}, pod).memory == 2 * GiB


def test_nvfractions_limit_alone_is_also_the_request(tmp_path):
    # KAI: "If only limit is present, KAI defaults the request to the same value."
    env = read_env({}, podinfo(tmp_path, **{NV.format("main", "limit"): "7680Mi"}))
    assert env.memory == env.memory_limit == 7680 * MiB


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("8Gi", 8 * GiB),
        ("7680Mi", 7680 * MiB),
        ("8G", 8 * 10**9),
        ("1.5Gi", 3 * GiB // 2),
        ("8589934592", 8 * GiB),
        ("1e3Mi", 1000 * MiB),
        ("0.5", 1),  # rounded up, as Kubernetes does
    ],
)
def test_kubernetes_quantities(text, size):
    assert parse_quantity(text, "k") == size


@pytest.mark.parametrize("text", ["8GB", "8gi", "-1Gi", "0", "", "Gi", "2Ei"])
def test_bad_kubernetes_quantities_name_the_annotation_and_the_fix(text):
    with pytest.raises(ValueError, match=r"^the-key=.*(like 8Gi|1024 TiB)"):
        parse_quantity(text, "the-key")


def test_portion_limit_beside_gpu_fraction(tmp_path):
    pod = podinfo(tmp_path, **{"gpu-fraction": "0.5", PORTION_LIMIT.format("main"): "0.8"})
    env = read_env({}, pod)
    assert (env.portion, env.portion_limit, env.memory, env.memory_limit) == (
        0.5,
        0.8,
        None,
        None,
    )


def test_the_binders_sizes_for_a_fraction_leave_the_fractions(tmp_path):
    # NvFractions' binder writes the request and limit in MiB from the fractions.
    pod = podinfo(
        tmp_path,
        **{
            "gpu-fraction": "0.5",
            PORTION_LIMIT.format("main"): "0.8",
            NV.format("main", "request"): "40960Mi",
            NV.format("main", "limit"): "65536Mi",
        },
    )
    env = read_env({}, pod)
    assert (env.portion, env.portion_limit, env.memory, env.memory_limit) == (
        0.5,
        0.8,
        None,
        None,
    )


def test_gpu_fraction_limit_shorthand(tmp_path):
    env = read_env({}, podinfo(tmp_path, **{"gpu-fraction": "0.2", "gpu-fraction.limit": "0.6"}))
    assert (env.portion, env.portion_limit) == (0.2, 0.6)


@pytest.mark.parametrize("value", ["1.5", "0", "most"])
def test_bad_portion_limit_names_the_annotation(tmp_path, value):
    key = PORTION_LIMIT.format("main")
    pod = podinfo(tmp_path, **{"gpu-fraction": "0.5", key: value})
    with pytest.raises(ValueError, match=rf"^annotation {re.escape(key)}=.*\(0, 1\]: write"):
        read_env({}, pod)


def test_a_portion_limit_needs_a_portion_request(tmp_path):
    pod = podinfo(tmp_path, **{"gpu-memory": "2000", PORTION_LIMIT.format("main"): "0.8"})
    with pytest.raises(ValueError, match=r"needs a gpu-fraction request.*add the gpu-fraction"):
        read_env({}, pod)


@pytest.mark.parametrize("key", [NV.format("main", "limit"), "gpu-memory.limit"])
def test_a_size_limit_annotation_beside_a_fraction_is_refused(tmp_path, key):
    pod = podinfo(tmp_path, **{"gpu-fraction": "0.5", key: "8Gi"})
    with pytest.raises(ValueError, match=r"needs a size request.*gpu-memory\.portion\.limit"):
        read_env({}, pod)


def test_gpu_memory_limit_shorthand_needs_its_unit(tmp_path):
    pod = podinfo(tmp_path, **{"gpu-memory": "4096", "gpu-memory.limit": "8Gi"})
    assert read_env({}, pod).memory_limit == 8 * GiB
    pod = podinfo(tmp_path, **{"gpu-memory": "4096", "gpu-memory.limit": "8192"})
    with pytest.raises(ValueError, match=r"gpu-memory\.limit=.8192.*with its unit"):
        read_env({}, pod)


@pytest.mark.parametrize(
    ("environ", "annotations", "says"),
    [
        ({"GPUSHARE_MEMORY": "30GiB", "GPUSHARE_MEMORY_LIMIT": "20GiB"}, {}, "20.0 GiB"),
        ({}, {"gpu-memory": "4096", "gpu-memory.limit": "2Gi"}, "2.0 GiB"),
        ({}, {NV.format("m", "request"): "8Gi", NV.format("m", "limit"): "4Gi"}, "4.0 GiB"),
        ({"GPUSHARE_MEMORY": "30GiB", "CUDA_DEVICE_MEMORY_LIMIT": "20480m"}, {}, "20.0 GiB"),
        ({}, {"gpu-fraction": "0.5", PORTION_LIMIT.format("m"): "0.3"}, "0.3 of the GPU"),
    ],
)
def test_a_limit_below_the_request_is_refused(tmp_path, environ, annotations, says):
    with pytest.raises(ValueError, match=rf"limit {says} .*below the request.*raise the limit"):
        read_env(environ, podinfo(tmp_path, **annotations))


def test_a_limit_equal_to_the_request_is_fine(tmp_path):
    pod = podinfo(tmp_path, **{"gpu-memory": "4096", "gpu-memory.limit": "4Gi"})
    assert read_env({}, pod).memory_limit == read_env({}, pod).memory == 4 * GiB


@pytest.mark.parametrize("mode", ["time-slicing", "sm-sharing"])
def test_compute_sharing_mode(tmp_path, mode):
    pod = podinfo(tmp_path, **{"gpu-fraction": "0.5", SHARING_MODE_ANNOTATION: mode})
    assert read_env({}, pod).sharing_mode == mode
    pod = podinfo(tmp_path, **{"nvidia.com/container.main.gpu-compute.mode": mode})
    assert read_env({}, pod).sharing_mode == mode


def test_unknown_compute_sharing_mode_names_the_annotation_and_the_modes(tmp_path):
    pod = podinfo(tmp_path, **{SHARING_MODE_ANNOTATION: "mps"})
    with pytest.raises(
        ValueError, match=rf"{SHARING_MODE_ANNOTATION}='mps'.*time-slicing or sm-sharing"
    ):
        read_env({}, pod)


def test_two_different_compute_sharing_modes_are_refused(tmp_path):
    pod = podinfo(
        tmp_path,
        **{
            SHARING_MODE_ANNOTATION: "sm-sharing",
            "nvidia.com/container.main.gpu-compute.mode": "time-slicing",
        },
    )
    with pytest.raises(ValueError, match="differ: keep one"):
        read_env({}, pod)


@pytest.mark.parametrize(
    ("memory", "limit", "hello"),
    [
        (None, None, (None, None)),  # none asked: the node fills in both
        ("4GiB", None, (4 * GiB, 4 * GiB)),  # a request alone is both, and said so
        ("4GiB", "4GiB", (4 * GiB, 4 * GiB)),  # equal: sent, not left out as "the limit"
        ("2GiB", "4GiB", (2 * GiB, 4 * GiB)),
        (None, "4GiB", (None, 4 * GiB)),  # a limit alone: no request asked
    ],
)
def test_the_hello_sends_the_request_whenever_one_was_asked(memory, limit, hello):
    """Issue 37: the hello's ``memory_request`` None means "none asked", only; a request
    equal to the limit was left out as None before."""
    assert memory_figures(memory, limit, read_env({}, FIX / "x")) == hello


@pytest.mark.parametrize("mode", ["time-slicing", "sm-sharing"])
def test_compute_sharing_mode_from_the_dra_drivers_env(tmp_path, mode):
    # gpushare-dra writes a claim's sharingMode as GPUSHARE_SHARING_MODE in its CDI spec
    assert read_env({"GPUSHARE_SHARING_MODE": mode}, tmp_path).sharing_mode == mode
    with pytest.raises(ValueError, match=r"^GPUSHARE_SHARING_MODE='mps'.*time-slicing"):
        read_env({"GPUSHARE_SHARING_MODE": "mps"}, tmp_path)
    other = "sm-sharing" if mode == "time-slicing" else "time-slicing"
    pod = podinfo(tmp_path, **{SHARING_MODE_ANNOTATION: other})
    with pytest.raises(ValueError, match=r"GPUSHARE_SHARING_MODE=.* differ: keep one"):
        read_env({"GPUSHARE_SHARING_MODE": mode}, pod)

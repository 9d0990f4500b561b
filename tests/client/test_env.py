"""The workload's environment, as KAI Scheduler and the downward API leave it."""

from __future__ import annotations

import pytest

from gpushare.client.env import program_name, rank_gpu, read_annotations, read_env
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

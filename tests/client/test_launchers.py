"""Which command lines are distributed launchers, and the job identity of a rank."""

from __future__ import annotations

import pytest

from gpushare.client.launchers import gang_fields, launcher


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        (["/venv/bin/python", "/venv/bin/torchrun", "--nproc-per-node", "2", "t.py"], "torchrun"),
        (["python3", "-u", "-m", "torch.distributed.run", "t.py"], "torch.distributed.run"),
        (["python3", "-mtorch.distributed.launch", "t.py"], "torch.distributed.launch"),
        (["python", "/usr/bin/accelerate", "launch", "t.py"], "accelerate"),
        (["python", "/usr/local/bin/deepspeed", "t.py"], "deepspeed"),
        (["python", "-m", "deepspeed.launcher.launch", "--x"], "deepspeed.launcher.launch"),
        (["python", "-X", "dev", "/x/torchrun", "t.py"], "torchrun"),
        (["python", "train.py", "torchrun"], ""),
        (["python", "-m", "mypkg.train"], ""),
        (["python", "-c", "import torchrun"], ""),
        (["python"], ""),
    ],
)
def test_launchers_are_known_by_their_command_line(argv, want):
    assert launcher(argv) == want


def test_a_torchrun_rank_names_its_job():
    env = {
        "TORCHELASTIC_RUN_ID": "5f1c",
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "4",
        "RANK": "6",
        "LOCAL_RANK": "2",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
    }
    assert gang_fields(env) == {
        "gang": "torchelastic:5f1c",
        "gang_size": 4,
        "rank": 2,
        "world_size": 8,  # more than gang_size: the job spans nodes
    }


def test_a_rank_without_a_run_id_is_named_by_its_rendezvous():
    # torchrun without --rdzv-id says "none"; deepspeed and accelerate set MASTER_*.
    env = {
        "TORCHELASTIC_RUN_ID": "none",
        "MASTER_ADDR": "node1",
        "MASTER_PORT": "6000",
        "WORLD_SIZE": "2",
        "RANK": "1",
    }
    assert gang_fields(env) == {
        "gang": "master:node1:6000",
        "gang_size": 2,
        "rank": 1,
        "world_size": 2,
    }
    env["LOCAL_SIZE"], env["LOCAL_RANK"] = "2", "1"  # deepspeed's launcher
    assert gang_fields(env)["gang_size"] == 2


def test_an_explicit_gang_wins_and_no_job_is_no_gang():
    env = {"GPUSHARE_GANG": "eval-7", "GPUSHARE_GANG_SIZE": "3", "GPUSHARE_RANK": "0"}
    assert gang_fields(env) == {"gang": "eval-7", "gang_size": 3, "rank": 0, "world_size": 0}
    assert gang_fields({}) == {"gang": "", "gang_size": 0, "rank": -1, "world_size": 0}
    assert gang_fields({"MASTER_ADDR": "a", "MASTER_PORT": "1"})["gang"] == ""  # no world
    with pytest.raises(ValueError, match="GPUSHARE_GANG_SIZE='x' is not a whole number"):
        gang_fields({"GPUSHARE_GANG": "g", "GPUSHARE_GANG_SIZE": "x"})

"""Distributed jobs time-sharing one GPU (issue 14): two 2-rank DDP jobs (torchrun, gloo,
the CPU build of PyTorch), unmodified, under ``gpushare run`` on a node in mode
exclusive. Each rank is a session; its hello names its job, so the node grants a job's
ranks together and revokes them together. Without that, the rank holding the GPU waits
in its backward all-reduce for a rank that waits for the GPU, and both jobs stall until
gloo's timeout (30 minutes by default)."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.client.test_run import gs_run
from tests.support import REPO, sim, wait_until

pytest.importorskip(
    "torch",
    reason="PyTorch is not installed (make test installs the CPU build where its wheel is on disk)",
)

STEPS = 150
DDP = REPO / "benchmarks" / "ddp_job.py"  # the job (bare, under gpushare run, attached)


def torchrun(script: Path, out: Path, node=None, env=None) -> subprocess.Popen[str]:
    """The job under ``gpushare run`` on ``node``, or bare (``env``: more environment)."""
    out.mkdir()
    args = ["--standalone", "--nproc-per-node", "2", str(script), str(out), str(STEPS)]
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.environ.get("PYTHONPATH", ""), **(env or {})}
    runner = str(Path(sys.executable).parent / "torchrun")
    if node is not None:
        return gs_run(node, "--memory", "4GiB", "--", runner, *args, extra_env=env)
    return subprocess.Popen(
        [runner, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
    )


def results(folder: Path) -> list[dict]:
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_two_ddp_jobs_time_share_an_exclusive_gpu_with_their_bare_results(node_factory, short_tmp):
    if not (Path(sys.executable).parent / "torchrun").exists():
        pytest.skip("torchrun is not installed beside this Python")
    script = DDP
    node = node_factory(*sim("16GiB", mode="exclusive", tq="0.3", idle_release="0.3"))
    env = {"DDP_START_FILE": str(short_tmp / "start")}
    jobs = [torchrun(script, short_tmp / f"job{j}", node, env=env) for j in (0, 1)]
    bare = torchrun(script, short_tmp / "bare")  # the same job, no gpushare
    start_together(node, short_tmp / "start", jobs)
    check_results(node, short_tmp, [*jobs, bare], gpus={0})


def start_together(node, start: Path, jobs: list[subprocess.Popen[str]]) -> None:
    """Once all four ranks are sessions, the jobs train: on a loaded machine one job's
    start could otherwise lag until the other had all but finished (no turns to see)."""
    try:
        wait_until(
            lambda: (
                sum(len(g["sessions"]) for g in node.status()["gpus"]) >= 4
                or any(j.poll() is not None for j in jobs)
            ),
            timeout=120,
        )
    finally:
        start.touch()


def check_results(node, tmp: Path, procs: list[subprocess.Popen[str]], gpus: set[int]) -> None:
    """Both jobs and the bare one finished; each job's ranks end with the bare run's
    parameters; the node granted them as gangs, took turns, escalated none. What is
    asserted holds however the machine times the jobs (when each asks, how many quanta
    each needs): nothing here counts turns or switches that a late start could leave out."""
    try:
        # Loose: about 15 s here; deadlocked ranks would wait for gloo's 30 minutes.
        errs = [pr.communicate(timeout=150)[1] for pr in procs]
    finally:
        for pr in procs:
            pr.kill()
    assert [pr.returncode for pr in procs] == [0, 0, 0], errs
    expected = results(tmp / "bare")
    assert expected[0]["params"] == expected[1]["params"]  # DDP: the ranks agree
    events = node.event_list()
    for j in (0, 1):
        ranks = results(tmp / f"job{j}")
        assert [r["params"] for r in ranks] == [expected[0]["params"]] * 2, f"job {j}"
        gangs = {
            e["gang"]
            for e in events
            if e["event"] == "attach" and e["session"] in {r["session"] for r in ranks}
        }
        assert len(gangs) == 1 and next(iter(gangs)).startswith("torchelastic:"), gangs
    for gpu in gpus:
        took_turns(events, gpu, round_robin=len(gpus) == 1)
    revokes = [e for e in events if e["event"] == "revoke"]
    assert all(e.get("gang") for e in revokes), revokes
    assert not [e for e in events if e["event"] == "escalate"]
    assert {e["gpu"] for e in events if e["event"] == "grant"} == gpus


def test_two_ddp_jobs_on_two_exclusive_gpus_each_are_granted_both_at_once(node_factory, short_tmp):
    """Rank r of each job on GPU r: granted one GPU at a time, rank 0 of one job would
    hold GPU 0 while its rank 1 waits for GPU 1, held by the other job's rank 1."""
    if not (Path(sys.executable).parent / "torchrun").exists():
        pytest.skip("torchrun is not installed beside this Python")
    script = DDP
    node = node_factory(*sim("16GiB", gpus=2, mode="exclusive", tq="0.3"))
    env = {
        "GPUSHARE_SOCKET": node.socket,
        "DDP_ATTACH": "1",
        "DDP_START_FILE": str(short_tmp / "start"),
    }
    jobs = [torchrun(script, short_tmp / f"job{j}", env=env) for j in (0, 1)]
    bare = torchrun(script, short_tmp / "bare")
    start_together(node, short_tmp / "start", jobs)
    check_results(node, short_tmp, [*jobs, bare], gpus={0, 1})


def took_turns(events: list[dict], gpu: int, round_robin: bool) -> None:
    """On ``gpu``, from the node's event log, in its order: never two jobs holding at
    once (mode exclusive); each job held it; and, with ``round_robin``, the jobs took
    turns as docs/scheduling.md defines them on one GPU: a TQ at a time, round-robin
    among those that want it, so a job never starts another hold while a rank of the
    other job has waited since before its last one began (whether they ever both
    waited, and how often they switched, is the machine's timing). On several GPUs the
    coordinator takes the jobs waiting to start in the order they began to wait as
    jobs, which one rank's wait on one GPU does not show (seen: a job held one GPU for
    two quanta in a row while the other job's rank there waited), so not there."""
    job_of = {e["session"]: e["gang"] for e in events if e["event"] == "attach"}
    starts, waits = holds_and_waits(events, gpu, job_of)
    assert {job for job, _ in starts} == set(job_of.values()), starts  # each held it
    if round_robin:
        assert_no_job_held_twice_past_a_waiter(starts, waits)


def holds_and_waits(
    events: list[dict[str, Any]], gpu: int, job_of: dict[int, str]
) -> tuple[list[tuple[str, float]], list[tuple[str, float, float]]]:
    """On ``gpu``, in the log's order: when each job's holds began, (job, when), and each
    rank's wait, (job, asked, granted); asserting as it goes that no job is granted while
    another holds (mode exclusive)."""
    holding: dict[int, int] = {}  # session -> its lease, holding this GPU now
    starts: list[tuple[str, float]] = []  # (job, when): a job's hold begins
    waits: list[tuple[str, float, float]] = []  # (job, asked, granted): a rank's wait
    for e in events:
        if e.get("gpu") != gpu:
            continue
        if e["event"] == "grant":
            job = job_of[e["session"]]
            others = {job_of[s] for s in holding} - {job}
            assert not others, f"GPU {gpu}: {job} granted while {others} held it: {e}"
            # a hold begins: not a rank joining its job's hold, not the rest of a
            # quantum (continued), not a parked rank let on to its safe point (regroup)
            joins = any(job_of[s] == job for s in holding)
            if not (joins or e.get("continued") or e.get("regroup")):
                starts.append((job, e["ts"]))
            if not e.get("regroup"):
                waits.append((job, e["ts"] - e["wait_seconds"], e["ts"]))
            holding[e["session"]] = e["lease"]
        elif e["event"] == "release" and holding.get(e["session"]) == e["lease"]:
            del holding[e["session"]]
    return starts, waits


def assert_no_job_held_twice_past_a_waiter(
    starts: list[tuple[str, float]], waits: list[tuple[str, float, float]]
) -> None:
    """Round-robin: a job starts two holds in a row only if no rank of the other job
    waited from before the first of them began until after the second began."""
    for (x, began), (y, again) in itertools.pairwise(starts):
        if x == y:  # x again: no one of the other job waited through its last hold
            starved = [w for w in waits if w[0] != x and w[1] < began and w[2] > again]
            assert not starved, (x, began, again, starved)

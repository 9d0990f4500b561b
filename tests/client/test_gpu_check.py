"""The staged GPU check (``sh benchmarks/gpu_check.sh``): its plan, sized from the
machine (the lent H200's sizes, this machine's own, a smaller one), keeps every stage's
part timeouts within the stage and every part within the host's and the GPU's budget;
and the check run dry: every part starts in its own process and finishes tiny (a fake
libcuda, simulated GPUs, the CPU) or times out, and the results folder holds what it
would hold on the device, so that the first run on a lent GPU cannot fail on the harness
itself."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_check  # noqa: E402
from gpu_check import MACHINES, PARTS, GiB, Machine  # noqa: E402

SMALL = Machine("small", 32 * GiB, 20 * GiB, 80 * GiB, 8)


def _machines() -> list[Machine]:
    return [MACHINES["h200"], gpu_check.this_machine(dry=True), SMALL]


def _assert_each_stage_fits(m: Machine, run: list[gpu_check.Planned]) -> None:
    """Each stage's part timeouts within STAGE_FILL of its time; the run's stages and their
    preparation within the run's budget, which leaves a rerun room in 15 minutes."""
    for stage, seconds in gpu_check.STAGE_SECONDS.items():
        used = sum(r.timeout_s for r in run if r.part.stage == stage)
        assert used <= gpu_check.STAGE_FILL * seconds, (m.name, stage, used)
    budget = gpu_check.PREPARE_S + sum(gpu_check.STAGE_SECONDS[s] for s in gpu_check.RUN_STAGES)
    assert budget <= gpu_check.RUN_BUDGET_S <= 8 * 60  # a rerun fits in 15 minutes


def _capacity(m: Machine, r: gpu_check.Planned) -> int:
    """The node's capacity in a part that starts one: the GPU less the reserve."""
    return m.gpu_bytes - int(r.params["reserve"])


def _assert_the_node_parts_fit(m: Machine, r: gpu_check.Planned, gpu: int) -> None:
    """A part with a node: its capacity within the GPU's budget; two sessions that take
    turns, each able to swap out what it is asked to; three of which one is always in
    host memory."""
    p = r.params
    if "reserve" in p:
        cap = _capacity(m, r)
        assert 0 < cap <= gpu
    if r.part.name.startswith("switch") or r.part.name.startswith("lm_pair"):
        cap = _capacity(m, r)
        assert 2 * p["limit"] > cap  # the two take turns
        # what one may be asked to swap out fits in what it pinned
        assert 2 * p["limit"] - cap <= p["host"]
    if r.part.name == "prefetch_overlap":
        cap = _capacity(m, r)
        assert 2 * p["limit"] <= cap < 3 * p["fill"]  # one always in host memory
        assert p["fill"] < p["limit"] <= p["host"]


@pytest.mark.parametrize("m", _machines(), ids=lambda m: m.name)
def test_the_plan_keeps_each_stage_and_part_within_the_machines_budget(m: Machine) -> None:
    rows = gpu_check.plan(m)
    assert [r.part.name for r in rows] == [p.name for p in PARTS]
    run = [r for r in rows if not r.skip]
    _assert_each_stage_fits(m, run)
    host, gpu = gpu_check.host_budget(m), gpu_check.gpu_budget(m)
    assert host <= m.host_bytes / 2 and gpu <= m.gpu_bytes
    for r in run:
        assert 0 < r.host_bytes <= host and 0 <= r.gpu_bytes <= gpu, (m.name, r)
        assert r.timeout_s >= r.estimate_s * gpu_check.MARGIN - 1, r
        _assert_the_node_parts_fit(m, r, gpu)
    if m.name == "h200":  # everything runs on the lent machine
        assert not [r.part.name for r in rows if r.skip]


def test_a_smaller_host_gets_smaller_parts_not_more_pinned_memory() -> None:
    big = {r.part.name: r for r in gpu_check.plan(MACHINES["h200"])}
    tiny = Machine("tiny", 16 * GiB, 14 * GiB, 80 * GiB, 8)  # a budget of 6 GiB
    for r in gpu_check.plan(tiny):
        assert r.skip or r.host_bytes <= gpu_check.host_budget(tiny)
        assert r.host_bytes <= big[r.part.name].host_bytes
    skipped = [r for r in gpu_check.plan(tiny) if r.skip]
    assert skipped and all("too small" in r.skip for r in skipped)


@pytest.mark.parametrize("rate", [0.25, 0.5, 2.0])
def test_a_slower_pinning_rate_plans_smaller_parts_in_the_same_time(rate: float) -> None:
    """What the check does once ``copy`` has measured the rate: the parts after it pin
    what they can in the same time, so that the stages still keep to their time."""
    h200 = MACHINES["h200"]
    base = {r.part.name: r for r in gpu_check.plan(h200)}
    rows = gpu_check.plan(h200, pin_gibs=rate)
    for stage, seconds in gpu_check.STAGE_SECONDS.items():
        used = sum(r.timeout_s for r in rows if r.part.stage == stage and not r.skip)
        assert used <= gpu_check.STAGE_FILL * seconds, (rate, stage, used)
    for r in rows:
        if rate < 1 and not r.skip:
            assert r.host_bytes <= base[r.part.name].host_bytes
        assert not r.skip or "pinning" in r.skip


def test_plan_h200_prints_a_row_per_part_and_the_totals() -> None:
    pr = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--plan", "h200"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert pr.returncode == 0, pr.stderr
    lines = pr.stdout.strip().splitlines()
    rows = [x for x in lines if re.match(r"\| [12] \| \w+ \| \d+ \| [\d,]+ \| [\d,]+ \|", x)]
    assert len(rows) == len([p for p in PARTS if p.stage in gpu_check.RUN_STAGES])
    total = re.fullmatch(
        r"total: (\d+) s, peak host ([\d.]+) GiB, peak GPU ([\d.]+) GiB", lines[-1]
    )
    assert total, lines[-1]
    assert int(total[1]) == sum(int(x.split("|")[3]) for x in rows)
    assert int(total[1]) <= gpu_check.RUN_BUDGET_S - gpu_check.PREPARE_S
    assert float(total[2]) <= 64 and float(total[3]) <= 143771 / 1024
    bad = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--plan", "a100"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "choose one of h200" in bad.stderr


def _run_the_check_dry(tmp_path: Path) -> Path:
    """``sh benchmarks/gpu_check.sh`` dry, all three stages, as on the lent machine, with
    ``swap`` made to hang and ``copy`` made to measure slow pinning; its results folder."""
    out = tmp_path / "results"
    env = {
        **os.environ,
        "OUT": str(out),  # as on the lent machine: the folder whose files come back
        "DRY": "1",
        "CARRY": str(tmp_path / "no-carry"),  # this Python has what gpushare needs
        "PYTHON": sys.executable,
        "GPUSHARE_CHECK_HANG": "swap",  # this part never ends: its timeout must end it
        "GPUSHARE_CHECK_PIN_GIBS": "0.5",  # copy "measures" slow pinning: planned again
    }
    pr = subprocess.run(
        [
            *("sh", str(REPO / "benchmarks" / "gpu_check.sh"), "--stages", "1,2,3"),
            *("--timeout", "swap=5", "--work", str(tmp_path / "work")),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert pr.returncode == 1, pr.stdout + pr.stderr  # one part timed out
    return out


def _assert_what_comes_back(out: Path) -> dict[str, Any]:
    """What comes back from the device: at most 8 files, 16 MiB each, no folder; the
    facts among them, in the results too. The results document."""
    files = sorted(p.name for p in out.iterdir())
    assert files == sorted(gpu_check.OUT_FILES), files
    assert all((out / f).stat().st_size < 16 * 2**20 for f in files)
    facts = json.loads((out / "facts.json").read_text())
    for key in ("python", "glibc", "c_compiler", "memlock", "cgroup_memory", "host_memory"):
        assert key in facts, key
    assert facts["torch"] and facts["host_memory"]["available"] > 0
    doc: dict[str, Any] = json.loads((out / "results.json").read_text())
    assert doc["facts"] == facts and doc["machine"]["name"] == "dry"
    return doc


def _assert_every_part_ran(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every part ran, in order: the hung one timed out, those that need a GPU skipped
    saying so, every other one ok. The others, by name."""
    parts = {p["name"]: p for p in doc["parts"]}
    assert [p["name"] for p in doc["parts"]] == [p.name for p in PARTS]  # every one ran
    hung = parts.pop("swap")
    assert hung["status"] == "timeout" and 5 <= hung["seconds"] < 60, hung
    assert parts.pop("tms")["status"] == "skipped"  # needs CUDA: said, not failed
    assert parts.pop("bounds")["status"] == "skipped"  # needs a GPU: said in one line
    bad = {n: p for n, p in parts.items() if p["status"] != "ok"}
    assert not bad, json.dumps(bad, indent=1)
    assert all(p["seconds"] > 0 for p in parts.values())
    assert parts["selftest"]["result"]["intact"]
    return parts


def _assert_planned_again_after_copy(doc: dict[str, Any], parts: dict[str, Any]) -> None:
    """The parts after copy ran as planned again for the rate it measured: smaller."""
    assert doc["replanned"] == {"pin_gibs": 0.5, "after": "copy"}
    before = {r.part.name: r for r in gpu_check.plan(MACHINES["dry"], dry=True)}
    after = {r.part.name: r for r in gpu_check.plan(MACHINES["dry"], dry=True, pin_gibs=0.5)}
    for name in ("switch_overlap", "lm_pair_tq10", "prefetch_overlap"):
        assert parts[name]["planned"]["host_bytes"] == after[name].host_bytes
        assert after[name].host_bytes < before[name].host_bytes


def _assert_the_parts_figures(parts: dict[str, Any]) -> None:
    assert "skipped" in parts["cuda_tests"]["result"]["summary"]  # pytest -m gpu ran
    assert parts["switch_overlap"]["result"]["switches"] > 0
    assert parts["lm_pair_tq10"]["result"]["switches"] > 0
    assert parts["lm_pair_tq30"]["result"]["switches"] > 0
    pre = parts["prefetch_overlap"]["result"]  # the next holder swapped in during a quantum
    assert pre["prefetches"] > 0 and pre["steps_while_prefetching"] > 0, pre


def _assert_the_tables_and_logs(out: Path) -> None:
    md = (out / "results.md").read_text()
    rows = [x for x in md.splitlines() if re.match(r"\| [123] \|", x)]
    assert len(rows) == len(PARTS) and "| swap | timeout |" in md
    logs = (out / "logs.txt").read_text()
    assert "===== swap (timeout" in logs and "===== lm_pair_tq30 (ok" in logs
    plan_md = (out / "plan.md").read_text()
    assert plan_md.splitlines()[-1].startswith("total: ")


@pytest.mark.skipif(not shutil.which("cc"), reason="the dry run builds a fake libcuda with cc")
def test_the_staged_gpu_check_runs_dry_end_to_end(tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="the dry run trains its tiny LM with PyTorch's CPU build")
    out = _run_the_check_dry(tmp_path)
    doc = _assert_what_comes_back(out)
    parts = _assert_every_part_ran(doc)
    _assert_planned_again_after_copy(doc, parts)
    _assert_the_parts_figures(parts)
    _assert_the_tables_and_logs(out)


@pytest.fixture(scope="module")
def carried_shim() -> Iterator[str]:
    # Module-scoped: set before the client tests' autouse fixture runs for each test.
    old = os.environ.get("GPUSHARE_SHIM")
    os.environ["GPUSHARE_SHIM"] = path = "/carried/libgpushare_alloc.so"
    yield path
    if old is None:
        del os.environ["GPUSHARE_SHIM"]
    else:
        os.environ["GPUSHARE_SHIM"] = old


@pytest.mark.gpu
def test_a_gpu_test_keeps_the_carried_allocator_library(carried_shim: str) -> None:
    # The GPU machine may have no C compiler: the check carries the library there.
    assert os.environ.get("GPUSHARE_SHIM") == carried_shim


def test_other_tests_build_their_own_allocator_library(carried_shim: str) -> None:
    assert "GPUSHARE_SHIM" not in os.environ

"""The staged GPU check (``sh benchmarks/gpu_check.sh``) run dry: every part starts in
its own process and finishes tiny (a fake libcuda, simulated GPUs, the CPU) or times
out, and its JSON and table row are written as they would be on the device, so that
the first run on a lent GPU cannot fail on the harness itself."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
from gpu_check import PARTS  # noqa: E402

pytest.importorskip("torch", reason="the dry run trains its tiny LM with PyTorch's CPU build")


@pytest.mark.skipif(not shutil.which("cc"), reason="the dry run builds a fake libcuda with cc")
def test_the_staged_gpu_check_runs_dry_end_to_end(tmp_path):
    out = tmp_path / "results"
    env = {
        **os.environ,
        "OUT": str(out),
        "DRY": "1",
        "PYTHON": sys.executable,
        "GPUSHARE_CHECK_HANG": "copy",  # this part never ends: its timeout must end it
    }
    pr = subprocess.run(
        ["sh", str(REPO / "benchmarks" / "gpu_check.sh"), "--timeout", "copy=5"],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert pr.returncode == 1, pr.stdout + pr.stderr  # one part timed out
    doc = json.loads((out / "results.json").read_text())
    parts = {p["name"]: p for p in doc["parts"]}
    assert [p["name"] for p in doc["parts"]] == [p.name for p in PARTS]  # every one ran
    hung = parts.pop("copy")
    assert hung["status"] == "timeout" and 5 <= hung["seconds"] < 60, hung
    assert parts.pop("tms")["status"] == "skipped"  # needs CUDA: said, not failed
    bad = {n: p for n, p in parts.items() if p["status"] != "ok"}
    assert not bad, json.dumps(bad, indent=1)
    assert all(p["seconds"] > 0 for p in parts.values())
    assert parts["selftest"]["result"]["intact"] and parts["swap"]["result"]["intact"]
    assert "skipped" in parts["cuda_tests"]["result"]["summary"]  # pytest -m gpu ran
    assert parts["switch_overlap"]["result"]["switches"] > 0
    assert parts["lm_pair_tq10"]["result"]["switches"] > 0
    pre = parts["prefetch_overlap"]["result"]  # the next holder swapped in during a quantum
    assert pre["prefetches"] > 0 and pre["steps_while_prefetching"] > 0, pre
    md = (out / "results.md").read_text()
    rows = [x for x in md.splitlines() if x.startswith("| 1 |") or x.startswith("| 2 |")]
    assert len(rows) == len(PARTS) and "| copy | timeout |" in md
    assert (out / "copy.log").exists() and (out / "lm_pair_tq30.json").exists()

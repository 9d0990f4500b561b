"""The GPU check's ``bounds`` part (benchmarks/gpu_bounds.py) where there is no GPU:
a clean skip, one line saying why, recorded as skipped by gpu_check.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_check  # noqa: E402

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU here: runs instead")


def test_without_a_gpu_the_bounds_part_skips_in_one_line(tmp_path: Path) -> None:
    out = tmp_path / "bounds.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSHARE_")}
    r = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_bounds.py"), "--json", str(out)],
        capture_output=True, text=True, timeout=120, env=env, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines() == [
        "bounds: skipped: no GPU here (torch.cuda.is_available() is False): the bounds check"
        " needs one"
    ]
    assert json.loads(out.read_text())["skipped"].startswith("no GPU here")


def test_gpu_check_records_the_bounds_part_as_skipped(tmp_path: Path) -> None:
    m = gpu_check.this_machine(dry=True)
    (planned,) = [r for r in gpu_check.plan(m, dry=True) if r.part.name == "bounds"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSHARE_")}
    rec = gpu_check.run_part(planned, tmp_path, True, 120, env)
    assert rec["status"] == "skipped" and rec["stage"] == 3, rec
    assert rec["result"]["skipped"].startswith("no GPU here")

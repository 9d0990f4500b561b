"""Distributed jobs sharing simulated GPUs (docs/scheduling.md "Gangs"): two 2-rank DDP
jobs (``benchmarks/ddp_job.py``: torchrun, gloo, the CPU build of PyTorch), side by side
in one run. A benchmark, not a test.

* bare: one job alone, then the two at once (no gpushare: the CPU they share is the
  baseline);
* one GPU: the two jobs under ``gpushare run`` on one simulated GPU in mode exclusive;
* two GPUs: the two jobs attached themselves, rank r on simulated GPU r, exclusive.

For each: the training span (from the first rank's first step to the last rank's last,
start-up left out), its ratio to the bare pair's in the same run and to twice one job's
alone (the two taking turns on the GPU, no switch cost), whether every rank's
final parameters equal the bare run's bit for bit, and the node's revokes, regroups and
escalations. The machine's CPUs are shared by both jobs in every run: the ratio is what
gpushare adds (switches, regroups) to two jobs taking turns.

    python benchmarks/gangs.py [--steps 1000] [--tq 0.3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from gpushare.tools.demo import wait_for_socket

HERE = Path(__file__).resolve().parent
JOB = HERE / "ddp_job.py"
TORCHRUN = str(Path(sys.executable).parent / "torchrun")


def job(out: Path, steps: int, pre: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    out.mkdir()
    cmd = [*pre, TORCHRUN, "--standalone", "--nproc-per-node", "2", str(JOB), str(out)]
    return subprocess.Popen(
        [*cmd, str(steps)],
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def finish(procs: list[subprocess.Popen[bytes]], outs: list[Path]) -> tuple[float, list[Any]]:
    """The training span of all the jobs, and each job's ranks' results."""
    for p in procs:
        if p.wait(timeout=900) != 0:
            raise SystemExit(f"a job failed ({p.args})")
    res = [[json.loads((o / f"rank{r}.json").read_text()) for r in (0, 1)] for o in outs]
    ranks = [r for j in res for r in j]
    return max(r["end"] for r in ranks) - min(r["start"] for r in ranks), res


def node(d: Path, gpus: int, tq: float) -> tuple[subprocess.Popen[bytes], str, Path]:
    sock, events = str(d / "w.sock"), d / "events.jsonl"
    cmd = [sys.executable, "-m", "gpushare", "node", "--socket", sock]
    cmd += ["--admin-socket", str(d / "a.sock"), "--sim-gpus", str(gpus)]
    cmd += ["--sim-memory", "16GiB", "--mode", "exclusive", "--tq", str(tq)]
    cmd += ["--metrics-port", "0", "--event-log", str(events)]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_socket(str(d / "a.sock"), p, 30)
    return p, sock, events


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--tq", type=float, default=0.3)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="gs-gangs-") as tmp:
        d = Path(tmp)
        _, [alone] = finish([job(d / "alone", args.steps, [], {})], [d / "alone"])
        outs = [d / "bare0", d / "bare1"]
        wall, bare = finish([job(o, args.steps, [], {}) for o in outs], outs)
        ref = alone[0]["params"]
        rows.append(("bare, one job alone", max(r["end"] - r["start"] for r in alone), None, {}))
        rows.append(("bare, two jobs at once", wall, bare, {}))
        for name, gpus in (("one GPU, gpushare run", 1), ("two GPUs, rank r on GPU r", 2)):
            # (the bare pair's results are compared with the job alone's too)
            sub = d / f"gpus{gpus}"
            sub.mkdir()
            p, sock, events = node(sub, gpus, args.tq)
            try:
                if gpus == 1:
                    pre = [sys.executable, "-m", "gpushare", "run", "--socket", sock]
                    pre += ["--memory", "4GiB", "--"]
                    env = {}
                else:
                    pre, env = [], {"GPUSHARE_SOCKET": sock, "DDP_ATTACH": "1"}
                outs = [sub / "job0", sub / "job1"]
                wall, res = finish([job(o, args.steps, pre, env) for o in outs], outs)
            finally:
                p.terminate()
                p.wait()
            ev = [json.loads(x) for x in events.read_text().splitlines()]
            count = {
                "revokes": sum(e["event"] == "revoke" for e in ev),
                "regroups": sum(bool(e.get("regroup")) for e in ev),
                "escalations": sum(e["event"] == "escalate" for e in ev),
            }
            rows.append((name, wall, res, count))
    base, turns = rows[1][1], 2 * rows[0][1]
    print(f"two 2-rank DDP jobs, {args.steps} steps each, TQ {args.tq:g} s, exclusive")
    head = f"{'run':<28} {'span s':>7} {'/ bare pair':>11} {'/ 2x alone':>10}"
    print(f"{head}  equal to bare  node")
    for name, span, res, count in rows:
        same = "" if res is None else str(all(r["params"] == ref for j in res for r in j))
        figures = "  ".join(f"{k} {v}" for k, v in count.items())
        row = f"{name:<28} {span:>7.1f} {span / base:>11.2f} {span / turns:>10.2f}"
        print(f"{row}  {same:<13}  {figures}")


if __name__ == "__main__":
    main()

"""The GPU check in one command, staged to fit a lent machine's time.

Stage 1, the smoke (at most 2 minutes): versions, gpushare's allocator library built,
the driver layer on the GPU (self-test, one swap of a few GiB with content and addresses
checked), the CUDA tests (``pytest -m gpu``). Stage 2, the benchmark (at most 6 minutes):
the parts of ``benchmarks/gpu_swap.py``, most important first.

Every part runs in its own process (its own session: a timeout kills it and whatever it
started), with its own timeout, cut to what is left of its stage's time; a part that
fails or times out is recorded and the next one runs. After every part the results are
written: ``OUT/results.json`` (every part so far, its status, seconds and figures, and
the ratios against their targets) and ``OUT/results.md`` (a table row per part), with
each part's output in ``OUT/PART.log``.

    python benchmarks/gpu_check.py --out gpu-results [--stages 1,2] [--dry]

``--dry`` runs every part tiny where there is no GPU (a fake libcuda built from the
tests' C source, simulated GPUs, the CPU), to check the harness itself.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SWAP = HERE / "gpu_swap.py"
STAGE_SECONDS = {1: 120.0, 2: 360.0}  # the device budget: ~9 of 15 minutes with start-up
MIN_PART_SECONDS = 10.0  # less left in the stage than this: the part is skipped


@dataclass(frozen=True)
class Part:
    name: str
    stage: int
    timeout_s: float  # on the GPU; a dry run allows DRY_TIMEOUT_S
    what: str


PARTS = [
    Part("env", 1, 30, "versions: Python, PyTorch, CUDA, driver, GPU"),
    Part("build", 1, 30, "gpushare's allocator library, built with cc"),
    Part("selftest", 1, 45, "driver self-test, one 4 GiB swap: content and addresses"),
    Part("cuda_tests", 1, 100, "pytest -m gpu tests/client/swap/test_torch.py"),
    Part("copy", 2, 25, "reference pinned copies, GB/s each way and both; pinning rate"),
    Part("swap", 2, 35, "torch backend swap-out/in GB/s, first and steady"),
    Part("switch_overlap", 2, 45, "two sessions of 54%: revoke to next swapped in"),
    Part("switch_sequential", 2, 45, "the same with --sequential-switches"),
    Part("prefetch_overlap", 2, 60, "holder's step time while the next prefetches, vs not"),
    Part("lm_bare", 2, 40, "a small LM at 60% of the GPU, alone, bare"),
    Part("lm_gpushare", 2, 45, "the same under gpushare run, uncontended"),
    Part("lm_pair_tq10", 2, 80, "two LMs at 60% each under gpushare, TQ 10 s"),
    Part("lm_pair_tq30", 2, 110, "two LMs at 60% each under gpushare, TQ 30 s"),
    Part("tms", 2, 30, "torch-memory-saver pause/resume on the same bytes (anchor)"),
]
DRY_TIMEOUT_S = 240.0  # a shared 2-core CI machine, torch imported per part

TARGETS = {
    "swap_out_first": (">=", 0.9),
    "swap_in_first": (">=", 0.9),
    "swap_out_steady": (">=", 0.9),
    "swap_in_steady": (">=", 0.9),
    "switch_overlap_vs_sequential": ("<=", 0.7),
    "lm_aggregate_tq10": (">=", 0.9),
    "lm_aggregate_tq30": (">=", 0.95),
    "lm_uncontended": (">=", 0.99),
}


def _cmd(part: Part, dry: bool, json_path: Path) -> list[str]:
    if part.name == "cuda_tests":
        return [
            sys.executable,
            "-m",
            "pytest",
            "-m",
            "gpu",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            str(REPO / "tests" / "client" / "swap" / "test_torch.py"),
        ]
    return [sys.executable, str(SWAP), "--check", part.name, "--json", str(json_path)] + (
        ["--dry"] if dry else []
    )


def run_part(part: Part, out: Path, dry: bool, timeout: float, env: dict[str, str]) -> dict:
    """Run one part in its own process session; its record."""
    json_path, log_path = out / f"{part.name}.json", out / f"{part.name}.log"
    json_path.unlink(missing_ok=True)
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            _cmd(part, dry, json_path),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
            cwd=REPO,
        )
        try:
            rc = proc.wait(timeout=timeout)
            status = "ok" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            rc = None
            status = "timeout"
        finally:
            with contextlib.suppress(ProcessLookupError):  # the part and all it started
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    seconds = time.monotonic() - t0
    text = log_path.read_text(errors="replace")
    result: dict[str, Any] = {}
    if json_path.exists():
        try:
            result = json.loads(json_path.read_text())
        except ValueError:
            status = "failed"
    if part.name == "cuda_tests":
        result = {"summary": _pytest_summary(text)}
    if status == "ok" and result.get("skipped"):
        status = "skipped"
    if status == "ok" and result.get("error"):
        status = "failed"
    rec: dict[str, Any] = {
        "name": part.name,
        "stage": part.stage,
        "status": status,
        "seconds": round(seconds, 2),
        "timeout_s": round(timeout, 1),
        "returncode": rc,
        "result": result,
    }
    if status in ("failed", "timeout"):
        rec["error"] = text.strip().splitlines()[-8:]
    return rec


def _pytest_summary(text: str) -> str:
    words = ("passed", "skipped", "failed", "error", "deselected")
    lines = [x.strip("= ") for x in text.splitlines() if " in " in x and any(w in x for w in words)]
    return lines[-1] if lines else ""


def _get(parts: dict[str, dict], name: str, key: str) -> float | None:
    v = parts.get(name, {}).get("result", {}).get(key)
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratios(parts: dict[str, dict]) -> dict[str, float | None]:
    d2h, h2d = _get(parts, "copy", "d2h_gbs"), _get(parts, "copy", "h2d_gbs")
    r: dict[str, float | None] = {}
    for which in ("first", "steady"):
        r[f"swap_out_{which}"] = _ratio(_get(parts, "swap", f"out_{which}_gbs"), d2h)
        r[f"swap_in_{which}"] = _ratio(_get(parts, "swap", f"in_{which}_gbs"), h2d)
        r[f"tms_pause_{which}"] = _ratio(_get(parts, "tms", f"pause_{which}_gbs"), d2h)
        r[f"tms_resume_{which}"] = _ratio(_get(parts, "tms", f"resume_{which}_gbs"), h2d)
    r["switch_overlap_vs_sequential"] = _ratio(
        _get(parts, "switch_overlap", "switch_median_s"),
        _get(parts, "switch_sequential", "switch_median_s"),
    )
    bare = _get(parts, "lm_bare", "tokens_per_s")
    for tq in (10, 30):
        r[f"lm_aggregate_tq{tq}"] = _ratio(_get(parts, f"lm_pair_tq{tq}", "tokens_per_s"), bare)
    r["holder_throughput_while_prefetching"] = _get(
        parts, "prefetch_overlap", "holder_throughput_while_prefetching"
    )
    r["lm_uncontended"] = _ratio(_get(parts, "lm_gpushare", "tokens_per_s"), bare)
    return r


def _figures(rec: dict) -> str:
    res = rec.get("result", {})
    keep = [
        f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
        for k, v in res.items()
        if isinstance(v, int | float | str) and k not in ("path",) and len(str(v)) < 40
    ]
    return ", ".join(keep)[:300].replace("|", "/")


def row(rec: dict) -> str:
    return (
        f"| {rec['stage']} | {rec['name']} | {rec['status']} | {rec['seconds']:.1f} |"
        f" {rec['timeout_s']:.0f} | {_figures(rec)} |"
    )


HEADER = (
    "| stage | part | status | seconds | timeout | figures |\n"
    "| ---: | --- | --- | ---: | ---: | --- |"
)


def write(out: Path, doc: dict) -> None:
    parts = {p["name"]: p for p in doc["parts"]}
    doc["ratios"] = ratios(parts)
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    os.replace(tmp, out / "results.json")
    lines = [
        f"# gpushare GPU check{' (dry run: no figure means anything)' if doc['dry'] else ''}",
        "",
        HEADER,
        *(row(p) for p in doc["parts"]),
        "",
        "| ratio | value | target |",
        "| --- | ---: | --- |",
    ]
    for k, v in doc["ratios"].items():
        op, t = TARGETS.get(k, ("", None))
        value = "n/a" if v is None else f"{v:.3f}"
        lines.append(f"| {k} | {value} | {'' if t is None else f'{op} {t}'} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")


def _dry_env(out: Path, env: dict[str, str]) -> None:
    """A fake libcuda for the driver parts, the language model tiny on the CPU."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("gpu_check --dry: needs a C compiler to build the fake libcuda")
    fake = out / "fake" / "libcuda.so.1"
    fake.parent.mkdir(parents=True, exist_ok=True)
    src = REPO / "tests" / "client" / "swap" / "fake_libcuda.c"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(fake), str(src)], check=True)
    env.update(
        GPUSHARE_FAKE_LIBCUDA=str(fake),
        GPUSHARE_BENCH_DEVICE="cpu",
        GPUSHARE_BENCH_TINY="1",
        OMP_NUM_THREADS="1",
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="gpu-results", help="results folder")
    ap.add_argument("--stages", default="1,2", help="which stages: 1, 2 or 1,2")
    ap.add_argument("--dry", action="store_true", help="tiny, without a GPU")
    ap.add_argument("--only", default="", help="comma-separated part names")
    ap.add_argument(
        "--timeout",
        action="append",
        default=[],
        metavar="PART=SECONDS",
        help="a part's own timeout (tests of the harness)",
    )
    args = ap.parse_args(argv)
    own = {k: float(v) for k, _, v in (t.partition("=") for t in args.timeout)}
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    stages = {int(s) for s in args.stages.split(",") if s.strip()}
    only = {s for s in args.only.split(",") if s}
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    src = str(REPO / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    if args.dry:
        _dry_env(out, env)
    doc: dict[str, Any] = {"started": time.time(), "dry": args.dry, "parts": []}
    write(out, doc)
    t_all = time.monotonic()
    for stage in sorted(stages):
        deadline = time.monotonic() + STAGE_SECONDS[stage]
        for part in (p for p in PARTS if p.stage == stage and (not only or p.name in only)):
            left = math.inf if args.dry else deadline - time.monotonic()
            timeout = min(own.get(part.name, DRY_TIMEOUT_S if args.dry else part.timeout_s), left)
            if left < MIN_PART_SECONDS:
                rec = {
                    "name": part.name,
                    "stage": stage,
                    "status": "skipped",
                    "seconds": 0.0,
                    "timeout_s": 0.0,
                    "result": {"skipped": f"stage {stage}'s {STAGE_SECONDS[stage]:.0f} s spent"},
                }
            else:
                what = f"stage {stage} {part.name} ({part.what}), up to {timeout:.0f} s"
                print(f"gpu_check: {what}", flush=True)
                rec = run_part(part, out, args.dry, timeout, env)
            doc["parts"].append(rec)
            doc["seconds"] = round(time.monotonic() - t_all, 1)
            write(out, doc)  # after every part: a hang later loses nothing
            print(row(rec), flush=True)
    print((out / "results.md").read_text())
    bad = [p["name"] for p in doc["parts"] if p["status"] in ("failed", "timeout")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

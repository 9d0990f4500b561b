"""The GPU check in one command, sized from the machine it runs on and staged to fit a
lent machine's time.

First the device's facts (Python, PyTorch and CUDA versions, the C compiler, glibc,
memlock, the cgroup's memory limit, MIG mode, free host memory), written before
anything else so that a failed run still says why. Then the plan: host memory and GPU
memory read first, every part's pinned host memory, GPU memory and timeout worked out
from them (``--plan h200`` prints the plan of the lent H200 without running anything).
Stage 1, the smoke: versions, gpushare's allocator library, the driver layer on the GPU
(self-test, one swap with content and addresses checked), the CUDA tests (``pytest -m
gpu``). Stage 2, the benchmark: the parts of ``benchmarks/gpu_swap.py``, most important
first. The part timeouts of a stage add up to at most ``STAGE_FILL`` of its time.

Every part runs in its own process (its own session: a timeout kills it and whatever it
started), with its planned timeout, cut to what is left of its stage's time; a part that
fails or times out is recorded and the next one runs. After every part the results are
written to the results folder (``--out``, default ``$OUT``: on the lent machine the
folder whose files come back, at most 8 of them): ``facts.json``, ``plan.md``,
``results.json`` (every part so far, its status, seconds and figures, the ratios against
their targets), ``results.md`` (a table row per part) and ``logs.txt`` (each part's
output, its end where long). Scratch files go to ``--work`` (a temporary folder).

    python benchmarks/gpu_check.py [--out DIR] [--stages 1,2] [--dry] [--only a,b]
    python benchmarks/gpu_check.py --plan h200      # the plan alone, nothing run

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
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpu_check_io import OUT_FILES as OUT_FILES  # the files that come back
from gpu_check_io import facts, figure, gpu_memory, host_memory, put, row, write

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SWAP = HERE / "gpu_swap.py"
GiB = 2**30
MiB = 2**20
UNIT = 256 * MiB  # sizes are whole units of this

# --- the budget ---------------------------------------------------------------------------
# The lent machine gives 15 minutes of device time, its start (a minute or more) and the
# transfers included: the whole run keeps to 8 minutes so that a rerun fits too.
RUN_BUDGET_S = 480.0
PREPARE_S = 25.0  # the wheels installed and the facts read, before stage 1
# Stages 1 and 2 are the run (with PREPARE_S, RUN_BUDGET_S at most); stage 3, the long
# TQ-30 pair, is a second call's, where the first left 5 minutes of device time.
STAGE_SECONDS = {1: 100.0, 2: 355.0, 3: 185.0}  # 3: the TQ-30 pair and bounds
RUN_STAGES = (1, 2)
STAGE_FILL = 0.9  # a stage's part timeouts add up to at most this share of it: margin
MIN_PART_SECONDS = 10.0  # less left in the stage than this: the part is skipped
DRY_TIMEOUT_S = 240.0  # a dry run on a shared 2-core CI machine, torch imported per part

# --- the cost model (the plan's estimates; the timeouts are MARGIN times them) ----------
PIN_GIBS = 1.0  # pinning rate, GiB/s, all processes together (docs: "about 1 GiB/s")
PIN_PART_S = 16.0  # one part pins at most this long: it bounds every part's host memory
SWAP_GBS = 10.0  # a swap's rate for its estimate (the reference copies run at ~50)
PROC_S = 6.0  # a Python process with PyTorch and a CUDA context up
NODE_S = 3.0  # a node started and listening
PROC_HOST = 3 * GiB  # a PyTorch process's own host memory (not pinned)
PROC_GPU = GiB  # a CUDA context and PyTorch's own bits on the GPU
HOST_SHARE = 0.5  # the check takes at most this share of the host's memory
HOST_KEEP = 8 * GiB  # and leaves at least this much of what is free
GPU_SHARE = 0.92  # and at most this share of the GPU's memory
MARGIN = 1.3
NODE_RESERVE = 4 * GiB  # the node's default --reserve in these parts (gpu_swap.RESERVE)


@dataclass(frozen=True)
class Part:
    name: str
    stage: int
    what: str


PARTS = [
    Part("env", 1, "versions: Python, PyTorch, CUDA, driver, GPU"),
    Part("build", 1, "gpushare's allocator library: built with cc, or the carried one"),
    Part("selftest", 1, "driver self-test, one swap through the allocator: content and addresses"),
    Part("cuda_tests", 1, "pytest -m gpu tests/client/swap/test_torch.py"),
    Part("copy", 2, "reference pinned copies, GB/s each way and both; pinning rate"),
    Part("swap", 2, "torch backend swap-out/in GB/s, first and steady"),
    Part("switch_overlap", 2, "two sessions over half the node each: revoke to next swapped in"),
    Part("switch_sequential", 2, "the same with --sequential-switches"),
    Part("lm_bare", 2, "a small LM over half of the GPU, alone, bare"),
    Part("lm_gpushare", 2, "the same under gpushare run, uncontended"),
    Part("lm_pair_tq10", 2, "two of those LMs under gpushare, TQ 10 s"),
    Part("prefetch_overlap", 2, "holder's step time while the next prefetches, vs not"),
    Part("tms", 2, "torch-memory-saver pause/resume on the same bytes (anchor)"),
    Part("lm_pair_tq30", 3, "two of those LMs under gpushare, TQ 30 s (a second call)"),
    Part("bounds", 3, "request < limit on the GPU: bound lent, limit held, bytes intact"),
]


@dataclass(frozen=True)
class Machine:
    """What the plan is sized from."""

    name: str
    host_bytes: int  # the host's memory, within the cgroup's limit
    host_free: int  # what is still free of it
    gpu_bytes: int  # GPU 0's memory (a MIG instance's, under MIG)
    cores: int


# The lent machine, as KINDS.md and nvidia-smi there read it: one H200 of 143,771 MiB
# (the 141 GB of its data sheet), 128 GiB of host memory, 16 cores; a few GiB of the host
# taken before the check starts.
MACHINES = {
    "h200": Machine("h200", 128 * GiB, 122 * GiB, 143771 * MiB, 16),
}
DRY_GPU = 16 * GiB  # the simulated GPU of a dry run (gpu_swap.DRY_GPU)
# A dry run's sizes: its simulated GPU, a host that pins nothing for real (the sim
# backend keeps a scaled-down copy), so that every part runs on any CI machine.
MACHINES["dry"] = Machine("dry", 32 * GiB, 30 * GiB, DRY_GPU, 2)


@dataclass
class Planned:
    """One part as planned: its timeout (the estimate times MARGIN), the host and GPU
    memory it may take at most, and the sizes and windows handed to it."""

    part: Part
    estimate_s: float
    timeout_s: float
    host_bytes: int
    gpu_bytes: int
    params: dict[str, Any] = field(default_factory=dict)
    skip: str = ""  # planned out, saying why (the machine is too small for it)


def _units(n: float) -> int:
    return max(0, int(n) // UNIT * UNIT)


def host_budget(m: Machine) -> int:
    return _units(min(m.host_bytes * HOST_SHARE, m.host_free - HOST_KEEP))


def gpu_budget(m: Machine) -> int:
    return _units(m.gpu_bytes * GPU_SHARE)


def plan(m: Machine, dry: bool = False, pin_gibs: float = PIN_GIBS) -> list[Planned]:
    """Every part of the check sized for ``m``: nothing pinned past ``host_budget``, no
    GPU memory past ``gpu_budget``, nothing pinned longer than ``PIN_PART_S``."""
    host, gpu = host_budget(m), gpu_budget(m)
    rate = pin_gibs * GiB
    # Pinning slower than assumed (measured by ``copy``): sizes shrink with the rate so
    # that each part pins for about as long as planned at PIN_GIBS.
    k = min(1.0, pin_gibs / PIN_GIBS)

    def pins(procs: int) -> int:  # what one part with ``procs`` processes may pin
        return _units(min(PIN_PART_S * rate, host - procs * PROC_HOST))

    # What the sessions of a node may hold together: the GPU's budget less their contexts.
    def node_cap(procs: int) -> int:
        return _units(gpu - procs * PROC_GPU)

    def row(name: str, est: float, host_b: int, gpu_b: int, **params: Any) -> Planned:
        part = next(p for p in PARTS if p.name == name)
        t = DRY_TIMEOUT_S if dry else float(math.ceil(est * MARGIN))
        return Planned(part, round(est, 1), t, host_b, gpu_b, params)

    out: list[Planned] = []
    out.append(row("env", PROC_S + 4, PROC_HOST, PROC_GPU))
    out.append(row("build", 5, GiB // 2, 0))
    s = MiB * 8 if dry else _units(min(4 * GiB * k, pins(1) / 1.25))
    pinned = s + s // 4  # the backend's buffers, and a staging buffer of a quarter
    est = PROC_S + pinned / rate + 4 * s / (SWAP_GBS * 1e9) + 2
    out.append(row("selftest", est, pinned + PROC_HOST, s + PROC_GPU + 64 * MiB, bytes=s))
    t = _units(min(8 * GiB * k, pins(1)))
    est = PROC_S + 3 + t / rate + 20  # five tests: a model trained, a graph replayed
    out.append(row("cuda_tests", est, t + PROC_HOST, t + 2 * GiB, bytes=t))
    unit = 256 * MiB  # benchmarks/gpu_bounds.py: 8 units a session at most, 12 the other
    est = NODE_S + 2 * PROC_S + 20 * unit / rate + 4
    out.append(row("bounds", est, 20 * unit + 2 * PROC_HOST, 24 * unit + 2 * PROC_GPU, unit=unit))
    c = MiB if dry else _units(min(2 * GiB * k, pins(1) / 2))
    out.append(row("copy", PROC_S + 2 * c / rate + 3, 2 * c + PROC_HOST, 2 * c + PROC_GPU, bytes=c))
    w = MiB * 8 if dry else _units(min(4 * GiB * k, pins(1) - GiB))
    est = PROC_S + (w + GiB) / rate + 4 * 2 * w / (SWAP_GBS * 1e9) + 2
    out.append(
        row("swap", est, w + GiB + PROC_HOST, w + GiB + PROC_GPU, bytes=w, cycles=3 if dry else 4)
    )
    # Two sessions over half of the node each: a switch moves ``moved`` bytes each way.
    cap = node_cap(2)
    moved = _units(min(4 * GiB * k, pins(2) / 2 - 3 * GiB // 2))
    limit = _units((cap + moved + GiB) / 2)
    each = moved + 3 * GiB // 2  # a session may hold 2 x limit - cap <= moved + 1 GiB
    seconds, tq = (2.0, 0.5) if dry else (5.0, 1.0)
    est = NODE_S + PROC_S + 2 * each / rate + seconds + 2
    for name in ("switch_overlap", "switch_sequential"):
        out.append(
            row(
                name,
                est,
                2 * (each + PROC_HOST),
                cap + 2 * PROC_GPU,
                reserve=m.gpu_bytes - cap,
                limit=limit,
                fill=limit - GiB,
                moved=moved,
                host=each,
                seconds=seconds,
                tq=tq,
            )
        )
    # The LMs: each a little over half of the node, so that two take turns and each
    # switch moves ``over`` bytes; one alone gets the same model and the same memory.
    cap = node_cap(2)
    over = _units(min(4 * GiB * k, pins(2) / 2 - 2 * GiB))
    lm_limit = _units((cap + over) / 2)
    each = over + 2 * GiB  # 2 x limit - cap <= over, and PyTorch's small segments
    start = PROC_S + 4  # PyTorch up, the model built
    alone = max(UNIT, _units(GiB * k))  # uncontended: nothing swapped, little pinned
    secs, warm = (1.5, 0.5) if dry else (10.0, 4.0)
    out.append(
        row(
            "lm_bare",
            start + warm + secs + 1,
            PROC_HOST,
            lm_limit + PROC_GPU,
            target=lm_limit,
            seconds=secs,
            warmup=warm,
        )
    )
    out.append(
        row(
            "lm_gpushare",
            NODE_S + 2 + start + alone / rate + warm + secs + 1,
            alone + PROC_HOST,
            lm_limit + PROC_GPU,
            reserve=m.gpu_bytes - cap,
            target=lm_limit,
            host=alone,
            seconds=secs,
            warmup=warm,
        )
    )
    for tq, window in ((10, 20.0), (30, 60.0)):  # two quanta each
        secs = 1.5 if dry else window
        pin_s = max(0.0, 2 * each / rate - 4)  # pinning runs while the model is built
        pair = row(
            f"lm_pair_tq{tq}",
            NODE_S + 2 + start + pin_s + warm + secs + 3,
            2 * (each + PROC_HOST),
            cap + 2 * PROC_GPU,
            reserve=m.gpu_bytes - cap,
            limit=lm_limit,
            over=over,
            host=each,
            seconds=secs,
            warmup=warm,
            tq=0.5 if dry else float(tq),
        )
        out.append(pair)
    # Three sessions on a node that holds two of them but not three's memory: one is
    # always in host memory, the next holder swaps in (prefetches) while the holder
    # computes. The holders fill whole GiB (the stepper's tensors) of their limits.
    whole = UNIT if dry else GiB
    fill = int(min(3 * GiB * k, pins(3) / 3 - GiB // 2) // whole * whole)
    limit = fill + GiB // 2
    cap3 = _units((2 * limit + 3 * fill) / 2)  # 2 x limit <= it < 3 x fill
    seconds, tq = (3.0, 0.5) if dry else (10.0, 2.0)
    out.append(
        row(
            "prefetch_overlap",
            NODE_S + PROC_S + 3 * limit / rate + seconds + 2,
            3 * (limit + PROC_HOST),
            cap3 + 3 * PROC_GPU,
            reserve=m.gpu_bytes - cap3,
            limit=limit,
            fill=fill,
            host=limit,
            seconds=seconds,
            tq=tq,
        )
    )
    b = _units(min(2 * GiB * k, pins(1)))
    est = PROC_S + b / rate + 3 * 2 * b / (SWAP_GBS * 1e9) + 3
    out.append(row("tms", est, b + PROC_HOST, b + PROC_GPU, bytes=b))
    order = {p.name: i for i, p in enumerate(PARTS)}
    out.sort(key=lambda r: order[r.part.name])
    _plan_out_what_does_not_fit(out, m, pin_gibs)
    return out


def _plan_out_what_does_not_fit(rows: list[Planned], m: Machine, pin_gibs: float) -> None:
    """A machine too small for a part plans it out, saying so: a size of nothing, or more
    host or GPU memory than the budget."""
    host, gpu = host_budget(m), gpu_budget(m)
    for r in rows:
        sizes = [
            v for k, v in r.params.items() if k in ("bytes", "fill", "moved", "over") and v <= 0
        ]
        if sizes or r.host_bytes > host or r.gpu_bytes > gpu:
            r.skip = (
                f"{m.name} is too small for it (host budget {host / GiB:.1f} GiB, pinning"
                f" {pin_gibs:g} GiB/s for {PIN_PART_S:.0f} s at most)"
            )


def plan_table(m: Machine, rows: list[Planned], stages: set[int] | None = None) -> str:
    """The plan as a table, a row per part, and one closing line:
    ``total: N s, peak host X GiB, peak GPU Y GiB``."""
    stages = stages or set(RUN_STAGES)
    lines = [
        f"plan for {m.name}: host {m.host_bytes / GiB:.1f} GiB ({m.host_free / GiB:.1f} free,"
        f" budget {host_budget(m) / GiB:.1f}), GPU {m.gpu_bytes / GiB:.1f} GiB (budget"
        f" {gpu_budget(m) / GiB:.1f}), {m.cores} cores",
        "",
        "| stage | part | seconds | host bytes | GPU bytes | estimate s |",
        "| ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        if r.part.stage in stages:
            t = f"{r.timeout_s:.0f}" if not r.skip else f"skipped: {r.skip}"
            lines.append(
                f"| {r.part.stage} | {r.part.name} | {t} | {r.host_bytes:,} | {r.gpu_bytes:,}"
                f" | {r.estimate_s:.1f} |"
            )
    run = [r for r in rows if r.part.stage in stages and not r.skip]
    for st in sorted(stages):
        used = sum(r.timeout_s for r in run if r.part.stage == st)
        lines.append(
            f"stage {st}: {used:.0f} s of {STAGE_SECONDS[st]:.0f} s"
            f" (at most {STAGE_FILL * STAGE_SECONDS[st]:.0f})"
        )
    total = sum(r.timeout_s for r in run)
    peak_host = max((r.host_bytes for r in run), default=0)
    peak_gpu = max((r.gpu_bytes for r in run), default=0)
    peaks = f"peak host {peak_host / GiB:.1f} GiB, peak GPU {peak_gpu / GiB:.1f} GiB"
    lines.append(f"total: {total:.0f} s, {peaks}")
    return "\n".join(lines)


# --- this machine (read by gpu_check_io.py) ------------------------------------------------


def this_machine(dry: bool) -> Machine:
    """This machine as the plan sees it; a dry run's GPU is the simulated one."""
    total, free = host_memory()
    gpu = DRY_GPU if dry else gpu_memory()
    if gpu is None:
        raise SystemExit(
            "gpu_check: no GPU found (NVML and nvidia-smi see none): run it on the GPU"
            " machine, or --dry to check the harness here"
        )
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return Machine("this machine" + (" (dry)" if dry else ""), total, free, gpu, cores or 1)


# --- running the parts --------------------------------------------------------------------


def _cmd(planned: Planned, dry: bool, json_path: Path) -> list[str]:
    if planned.part.name == "cuda_tests":
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
    script = HERE / "gpu_bounds.py" if planned.part.name == "bounds" else SWAP
    cmd = [sys.executable, str(script), "--check", planned.part.name, "--json", str(json_path)]
    cmd += ["--params", json.dumps(planned.params)]
    return cmd + (["--dry"] if dry else [])


LOG_TAIL = 256 * 1024  # of each part's output in logs.txt: 14 parts stay under 16 MiB


def run_part(
    planned: Planned, work: Path, dry: bool, timeout: float, env: dict[str, str]
) -> dict[str, Any]:
    """Run one part in its own process session; its record."""
    part = planned.part
    json_path, log_path = work / f"{part.name}.json", work / f"{part.name}.log"
    json_path.unlink(missing_ok=True)
    env = dict(env)
    if part.name == "cuda_tests":  # the tests' pinned buffers, as planned
        env["GPUSHARE_GPU_TEST_BYTES"] = str(planned.params["bytes"])
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            _cmd(planned, dry, json_path),
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
        "planned": {"host_bytes": planned.host_bytes, "gpu_bytes": planned.gpu_bytes},
        "result": result,
        "log": text[-LOG_TAIL:],
    }
    if status in ("failed", "timeout"):
        rec["error"] = text.strip().splitlines()[-8:]
    return rec


def _pytest_summary(text: str) -> str:
    words = ("passed", "skipped", "failed", "error", "deselected")
    lines = [x.strip("= ") for x in text.splitlines() if " in " in x and any(w in x for w in words)]
    return lines[-1] if lines else ""


def _dry_env(work: Path, env: dict[str, str]) -> None:
    """A fake libcuda for the driver parts, the language model tiny on the CPU."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("gpu_check --dry: needs a C compiler to build the fake libcuda")
    fake = work / "fake" / "libcuda.so.1"
    fake.parent.mkdir(parents=True, exist_ok=True)
    src = REPO / "tests" / "client" / "swap" / "fake_libcuda.c"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(fake), str(src)], check=True)
    env.update(
        GPUSHARE_FAKE_LIBCUDA=str(fake),
        GPUSHARE_BENCH_DEVICE="cpu",
        GPUSHARE_BENCH_TINY="1",
        OMP_NUM_THREADS="1",
    )


def _skipped(part: Part, why: str) -> dict[str, Any]:
    return {
        "name": part.name,
        "stage": part.stage,
        "status": "skipped",
        "seconds": 0.0,
        "timeout_s": 0.0,
        "result": {"skipped": why},
        "log": "",
    }


# --- the command ---------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument(
        "--out",
        default=os.environ.get("OUT") or "gpu-results",
        help="results folder (default $OUT, else gpu-results): at most 8 files in it",
    )
    ap.add_argument("--work", default="", help="scratch folder (default: a temporary one)")
    ap.add_argument("--stages", default="1,2", help="which stages: 1, 2 or 1,2")
    ap.add_argument("--dry", action="store_true", help="tiny, without a GPU")
    ap.add_argument("--only", default="", help="comma-separated part names")
    ap.add_argument(
        "--plan",
        metavar="MACHINE",
        help=f"print the plan for a machine ({', '.join(MACHINES)}, or 'here') and stop",
    )
    ap.add_argument(
        "--pin-gibs", type=float, default=PIN_GIBS, help="pinning rate the plan assumes, GiB/s"
    )
    ap.add_argument(
        "--timeout",
        action="append",
        default=[],
        metavar="PART=SECONDS",
        help="a part's own timeout (tests of the harness)",
    )
    return ap


def _print_plan(ap: argparse.ArgumentParser, args: argparse.Namespace, stages: set[int]) -> int:
    """``--plan MACHINE``: the plan alone, nothing run."""
    if args.plan != "here" and args.plan not in MACHINES:
        ap.error(f"--plan {args.plan}: choose one of {', '.join(MACHINES)} or 'here'")
    m = MACHINES[args.plan] if args.plan != "here" else this_machine(args.dry)
    print(plan_table(m, plan(m, args.dry, args.pin_gibs), stages))
    return 0


def _parts_env() -> dict[str, str]:
    """The parts' environment: this one, unbuffered, with this tree's ``src`` first."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    src = str(REPO / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    return env


def _facts_first(out: Path, dry: bool) -> dict[str, Any]:
    """The results document, the facts in it and written on their own: whatever fails
    after, the run says on what."""
    doc: dict[str, Any] = {"started": time.time(), "dry": dry, "parts": []}
    doc["facts"] = facts()
    put(out / "facts.json", json.dumps(doc["facts"], indent=1, default=str))
    write(out, doc)
    return doc


def _machine(out: Path, doc: dict[str, Any], dry: bool) -> Machine:
    """What the plan is sized from; no GPU found is said in the files that come back too."""
    try:
        return MACHINES["dry"] if dry else this_machine(False)
    except SystemExit as e:
        doc["error"] = str(e)
        write(out, doc)
        raise


@dataclass
class Run:
    """The stages as they run: the plan as it stands (planned again once ``copy`` has
    measured slower pinning), each part's record, the results written after every part."""

    args: argparse.Namespace
    out: Path
    work: Path
    env: dict[str, str]
    m: Machine
    planned: list[Planned]
    doc: dict[str, Any]
    own: dict[str, float]  # --timeout: a part's own timeout
    only: set[str]
    stages: set[int]
    t_all: float = field(default_factory=time.monotonic)

    def stage(self, stage: int) -> None:
        deadline = time.monotonic() + STAGE_SECONDS[stage]
        for name in [p.part.name for p in self.planned]:
            p = next(r for r in self.planned if r.part.name == name)  # as planned now
            if p.part.stage != stage or (self.only and p.part.name not in self.only):
                continue
            left = math.inf if self.args.dry else deadline - time.monotonic()
            rec = self.part(p, stage, left)
            self.doc["parts"].append(rec)
            self.replan_if_pinning_is_slow(name, rec)
            self.doc["seconds"] = round(time.monotonic() - self.t_all, 1)
            write(self.out, self.doc)  # after every part: a hang later loses nothing
            print(row(rec), flush=True)

    def part(self, p: Planned, stage: int, left: float) -> dict[str, Any]:
        """The part's record: planned out, its stage's time spent, or run."""
        timeout = min(self.own.get(p.part.name, p.timeout_s), left)
        if p.skip:
            return _skipped(p.part, p.skip)
        if left < MIN_PART_SECONDS:
            return _skipped(p.part, f"stage {stage}'s {STAGE_SECONDS[stage]:.0f} s spent")
        what = f"stage {stage} {p.part.name} ({p.part.what}), up to {timeout:.0f} s"
        print(f"gpu_check: {what}", flush=True)
        return run_part(p, self.work, self.args.dry, timeout, self.env)

    def replan_if_pinning_is_slow(self, name: str, rec: dict[str, Any]) -> None:
        """Pinning slower than the plan assumed: the parts after this one pin what they
        can in the same time (smaller), so that they keep to it."""
        rate = figure({name: rec}, "copy", "pin_gibs") if name == "copy" else None
        if rate and rate < 0.9 * self.args.pin_gibs:
            self.planned = plan(self.m, self.args.dry, rate)
            self.doc["replanned"] = {"pin_gibs": rate, "after": name}
            put(self.out / "plan.md", plan_table(self.m, self.planned, self.stages) + "\n")
            print(f"gpu_check: pinning runs at {rate:.2f} GiB/s: planned again", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    stages = {int(s) for s in args.stages.split(",") if s.strip()}
    if args.plan:
        return _print_plan(ap, args, stages)
    own = {k: float(v) for k, _, v in (t.partition("=") for t in args.timeout)}
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work or tempfile.mkdtemp(prefix="gpu-check-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    only = {s for s in args.only.split(",") if s}
    env = _parts_env()
    doc = _facts_first(out, args.dry)
    m = _machine(out, doc, args.dry)
    planned = plan(m, args.dry, args.pin_gibs)
    doc["machine"] = m.__dict__
    put(out / "plan.md", plan_table(m, planned, stages) + "\n")
    print(plan_table(m, planned, stages), flush=True)
    if args.dry:
        _dry_env(work, env)
    run = Run(args, out, work, env, m, planned, doc, own, only, stages)
    for stage in sorted(stages):
        run.stage(stage)
    print((out / "results.md").read_text())
    bad = [p["name"] for p in doc["parts"] if p["status"] in ("failed", "timeout")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

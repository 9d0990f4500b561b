"""What the GPU check (``benchmarks/gpu_check.py``) reads and writes: the machine it
runs on (the device's facts, written before anything runs so that a failed run still
says on what; the host's memory within the cgroup's limit; GPU 0's memory, read without
a CUDA context), and the results folder rewritten after every part (``results.json``
with the ratios against their targets, ``results.md``, ``logs.txt``)."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

MiB = 2**20


# --- this machine ---------------------------------------------------------------------------


def _meminfo(proc: str = "/proc") -> dict[str, int]:
    out: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in Path(proc, "meminfo").read_text().splitlines():
            k, _, v = line.partition(":")
            parts = v.split()
            if parts and parts[0].isdigit():
                out[k] = int(parts[0]) * 1024
    return out


def cgroup_memory(proc: str = "/proc", cgroup: str = "/sys/fs/cgroup") -> tuple[int, int] | None:
    """This process's cgroup (v2) memory limit and use, or None where it has no limit."""
    with contextlib.suppress(OSError, ValueError):
        rel = ""
        for line in Path(proc, "self", "cgroup").read_text().splitlines():
            if line.startswith("0::"):
                rel = line[3:].strip().lstrip("/")
        d = Path(cgroup, rel)
        limit = (d / "memory.max").read_text().strip()
        if limit != "max":
            return int(limit), int((d / "memory.current").read_text().strip())
    return None


def gpu_memory() -> int | None:
    """GPU 0's memory from NVML (no CUDA context made), else nvidia-smi; None: no GPU."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML, no driver, no GPU: try the tool
        pass
    with contextlib.suppress(OSError, subprocess.SubprocessError, ValueError):
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        return int(smi.stdout.split()[0]) * MiB
    return None


def host_memory() -> tuple[int, int]:
    """The host's memory and what is free of it, both within the cgroup's limit."""
    mem = _meminfo()
    total, free = mem.get("MemTotal", 0), mem.get("MemAvailable", 0)
    cg = cgroup_memory()
    if cg is not None:
        total, free = min(total, cg[0]), min(free, cg[0] - cg[1])
    return total, free


def _run(cmd: list[str], timeout: float = 30) -> str:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return (r.stdout.strip() or r.stderr.strip())[:2000]
    except (OSError, subprocess.SubprocessError) as e:
        return f"unavailable ({e})"


def facts() -> dict[str, Any]:
    """The device's facts, read before anything runs: what a failed run needs to say why."""
    f: dict[str, Any] = {"python": platform.python_version(), "executable": sys.executable}
    f["platform"] = platform.platform()
    f["glibc"] = " ".join(platform.libc_ver())
    cc = shutil.which("cc") or shutil.which("gcc")
    f["c_compiler"] = _run([cc, "--version"]).splitlines()[0] if cc else None
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    f["memlock"] = {"soft": soft, "hard": hard, "unlimited": soft == resource.RLIM_INFINITY}
    cg = cgroup_memory()
    f["cgroup_memory"] = {"limit": cg[0], "current": cg[1]} if cg else None
    mem = _meminfo()
    f["host_memory"] = {"total": mem.get("MemTotal"), "available": mem.get("MemAvailable")}
    f["cores"] = os.cpu_count()
    probe = (
        "import json, torch; c = torch.cuda.is_available();"
        "print(json.dumps({'torch': torch.__version__, 'torch_cuda': torch.version.cuda,"
        "'cuda_available': c, 'devices': torch.cuda.device_count() if c else 0}))"
    )
    text = _run([sys.executable, "-c", probe], timeout=90)
    try:
        f.update(json.loads(text.splitlines()[-1]))
    except (ValueError, IndexError):
        f["torch"] = f"unavailable: {text[-500:]}"
    f["nvidia_smi"] = _run(
        [
            "nvidia-smi",
            "--query-gpu=name,memory.total,memory.used,driver_version,mig.mode.current",
            "--format=csv,noheader",
        ]
    )
    f["gpu_bytes"] = gpu_memory()
    with contextlib.suppress(ImportError):
        import msgspec

        f["msgspec"] = msgspec.__version__
    f["gpushare_shim"] = os.environ.get("GPUSHARE_SHIM")
    return f


# --- the results folder -------------------------------------------------------------------

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


def figure(parts: dict[str, dict[str, Any]], name: str, key: str) -> float | None:
    v = parts.get(name, {}).get("result", {}).get(key)
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratios(parts: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    d2h, h2d = figure(parts, "copy", "d2h_gbs"), figure(parts, "copy", "h2d_gbs")
    r: dict[str, float | None] = {}
    for which in ("first", "steady"):
        r[f"swap_out_{which}"] = _ratio(figure(parts, "swap", f"out_{which}_gbs"), d2h)
        r[f"swap_in_{which}"] = _ratio(figure(parts, "swap", f"in_{which}_gbs"), h2d)
        r[f"tms_pause_{which}"] = _ratio(figure(parts, "tms", f"pause_{which}_gbs"), d2h)
        r[f"tms_resume_{which}"] = _ratio(figure(parts, "tms", f"resume_{which}_gbs"), h2d)
    r["switch_overlap_vs_sequential"] = _ratio(
        figure(parts, "switch_overlap", "switch_median_s"),
        figure(parts, "switch_sequential", "switch_median_s"),
    )
    bare = figure(parts, "lm_bare", "tokens_per_s")
    for tq in (10, 30):
        r[f"lm_aggregate_tq{tq}"] = _ratio(figure(parts, f"lm_pair_tq{tq}", "tokens_per_s"), bare)
    r["holder_throughput_while_prefetching"] = figure(
        parts, "prefetch_overlap", "holder_throughput_while_prefetching"
    )
    r["lm_uncontended"] = _ratio(figure(parts, "lm_gpushare", "tokens_per_s"), bare)
    return r


def _figures(rec: dict[str, Any]) -> str:
    res = rec.get("result", {})
    keep = [
        f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
        for k, v in res.items()
        if isinstance(v, int | float | str) and k not in ("path",) and len(str(v)) < 40
    ]
    return ", ".join(keep)[:300].replace("|", "/")


def row(rec: dict[str, Any]) -> str:
    return (
        f"| {rec['stage']} | {rec['name']} | {rec['status']} | {rec['seconds']:.1f} |"
        f" {rec['timeout_s']:.0f} | {_figures(rec)} |"
    )


HEADER = (
    "| stage | part | status | seconds | timeout | figures |\n"
    "| ---: | --- | --- | ---: | ---: | --- |"
)
OUT_FILES = ("facts.json", "plan.md", "results.json", "results.md", "logs.txt")


def write(out: Path, doc: dict[str, Any]) -> None:
    """The results folder's files, each written whole and renamed into place."""
    parts = {p["name"]: p for p in doc["parts"]}
    doc["ratios"] = ratios(parts)
    slim = {**doc, "parts": [{k: v for k, v in p.items() if k != "log"} for p in doc["parts"]]}
    put(out / "results.json", json.dumps(slim, indent=1, default=str))
    lines = [
        f"# gpushare GPU check{' (dry run: no figure means anything)' if doc['dry'] else ''}",
        "",
        f"facts: {_facts_line(doc.get('facts', {}))}",
        "",
        *([f"error: {doc['error']}", ""] if doc.get("error") else []),
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
    put(out / "results.md", "\n".join(lines) + "\n")
    logs = [
        f"===== {p['name']} ({p['status']}, {p['seconds']} s)\n{p['log']}" for p in doc["parts"]
    ]
    put(out / "logs.txt", "\n".join(logs))


def _facts_line(f: dict[str, Any]) -> str:
    keys = ("python", "torch", "torch_cuda", "c_compiler", "glibc", "nvidia_smi")
    return "; ".join(f"{k} {' '.join(str(f.get(k)).split())[-200:]}" for k in keys if k in f)


def put(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)

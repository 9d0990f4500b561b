"""GPU swap benchmark: one run on one GPU (an H200: under 5 minutes), every figure
measured side by side in that run. A benchmark, not a test.

Parts, each in a fresh process (its own CUDA context and allocator state):

* ``copy``   reference pinned ``cudaMemcpyAsync`` GB/s: device to host, host to device,
             and both at once on two streams;
* ``swap``   gpushare's torch backend: swap-out and swap-in GB/s on the first switch
             after attach and in steady state, content checked; its pinning time too;
* ``tms``    torch-memory-saver's own pause/resume on the same bytes (the anchor; it is
             skipped, and says so, where torch_memory_saver is not installed);
* ``switch`` a real node on the GPU, two sessions each holding 55% of it: the time
             from a revoke to the next session swapped in, overlapped (default) and with
             ``--sequential-switches``;
* ``lm``     a small transformer language model training on synthetic tokens (plus a
             buffer bringing it to ~60% of the GPU): alone and bare; alone under
             ``gpushare run``; two at once under gpushare at TQ 10 s and 30 s.

    python benchmarks/gpu_swap.py [--json gpu_swap.json] [--quick]

Needs PyTorch with CUDA, gpushare with its ``node`` and ``nvml`` extras, and (for the
anchor) ``torch-memory-saver``. Prints a table; ``--json`` writes every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

GiB = 2**30
HERE = Path(__file__).resolve()
SRC = HERE.parent.parent / "src"
if SRC.is_dir():  # a checkout: use it without installing
    sys.path.insert(0, str(SRC))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(SRC), os.environ.get("PYTHONPATH", "")) if p
    )


def _sync_time(torch: Any, fn: Any) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


# --- parts (each runs in its own process and prints one JSON line) ---------------------


def part_copy(size: int) -> dict[str, Any]:
    import torch

    d1 = torch.empty(size, dtype=torch.uint8, device="cuda")
    d2 = torch.empty(size, dtype=torch.uint8, device="cuda")
    t0 = time.perf_counter()
    h1 = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    h2 = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    pin_s = time.perf_counter() - t0
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def both() -> None:
        with torch.cuda.stream(s1):
            h1.copy_(d1, non_blocking=True)
        with torch.cuda.stream(s2):
            d2.copy_(h2, non_blocking=True)

    for _ in range(2):  # warm up
        h1.copy_(d1, non_blocking=True)
        d2.copy_(h2, non_blocking=True)
    d2h = min(_sync_time(torch, lambda: h1.copy_(d1, non_blocking=True)) for _ in range(5))
    h2d = min(_sync_time(torch, lambda: d2.copy_(h2, non_blocking=True)) for _ in range(5))
    bi = min(_sync_time(torch, both) for _ in range(5))
    return {
        "bytes": size,
        "d2h_gbs": size / d2h / 1e9,
        "h2d_gbs": size / h2d / 1e9,
        "both_gbs": 2 * size / bi / 1e9,
        "pin_gibs": 2 * size / pin_s / GiB,
    }


def part_swap(size: int, cycles: int) -> dict[str, Any]:
    import torch

    from gpushare.client.swap.torch import TorchBackend

    t0 = time.perf_counter()
    b = TorchBackend(size + GiB, host_bytes=size + GiB)  # room for small-pool segments too
    attach_s = time.perf_counter() - t0
    b.wait_for_host_buffers()
    n = size // GiB
    xs = [torch.randint(0, 256, (GiB,), dtype=torch.uint8, device=b.device) for _ in range(n)]
    sums = [int(x.sum(dtype=torch.int64)) for x in xs]
    ptrs = [x.data_ptr() for x in xs]
    outs, ins = [], []
    for _ in range(cycles):
        r = b.swap_out(b.resident_bytes)
        outs.append(r.bytes / r.seconds / 1e9)
        r = b.swap_in()
        ins.append(r.bytes / r.seconds / 1e9)
    intact = [int(x.sum(dtype=torch.int64)) for x in xs] == sums
    stable = [x.data_ptr() for x in xs] == ptrs
    return {
        "bytes": b.resident_bytes,
        "attach_s": attach_s,
        "pin_s": b.host.pin_seconds,
        "pinned_bytes": b.host.pinned_bytes,
        "late_pins": b.host.late_pins,
        "out_first_gbs": outs[0],
        "in_first_gbs": ins[0],
        "out_steady_gbs": statistics.median(outs[1:]),
        "in_steady_gbs": statistics.median(ins[1:]),
        "intact": intact,
        "addresses_stable": stable,
    }


def part_tms(size: int, cycles: int) -> dict[str, Any]:
    import torch

    try:
        from torch_memory_saver import torch_memory_saver as tms
    except ImportError as e:
        return {"skipped": f"torch_memory_saver is not installed ({e})"}
    tms.hook_mode = "torch"
    retain = hasattr(type(tms), "retain_cpu_backup")
    if retain:  # keep the host copy between pauses: its fastest steady state
        tms.retain_cpu_backup = True
    with tms.region(enable_cpu_backup=True):
        x = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda")
    total = int(x.sum(dtype=torch.int64))
    pauses, resumes = [], []
    for _ in range(cycles):
        pauses.append(size / _sync_time(torch, tms.pause) / 1e9)
        resumes.append(size / _sync_time(torch, tms.resume) / 1e9)
    return {
        "bytes": size,
        "retain_cpu_backup": retain,
        "pause_first_gbs": pauses[0],
        "resume_first_gbs": resumes[0],
        "pause_steady_gbs": statistics.median(pauses[1:]),
        "resume_steady_gbs": statistics.median(resumes[1:]),
        "intact": int(x.sum(dtype=torch.int64)) == total,
    }


def part_holder(sock: str, memory: int, fill: int, seconds: float) -> dict[str, Any]:
    """A session that fills its memory and then works in one long burst."""
    import torch

    import gpushare

    s = gpushare.attach(memory, socket=sock, backend="torch")
    backend: Any = s.backend
    backend.wait_for_host_buffers()  # as a session some time after attach has them
    with s.gpu():
        xs = [torch.ones(GiB, dtype=torch.uint8, device="cuda") for _ in range(fill // GiB)]
        y = torch.randn(1024, 1024, device="cuda")
    end = time.monotonic() + seconds
    with s.gpu():
        while time.monotonic() < end:
            y = (y @ y).tanh()
            torch.cuda.synchronize()
            s.checkpoint()
        ok = all(bool((x == 1).all()) for x in xs)  # inside the lease: memory is back
    s.close()
    return {"intact": ok, "grants": s.grants}


def part_lm(seconds: float, warmup: float, target: int) -> dict[str, Any]:
    """Train a small GPT on synthetic tokens; tokens/s over [warmup, warmup+seconds].

    ``GPUSHARE_BENCH_DEVICE=cpu GPUSHARE_BENCH_TINY=1`` runs a tiny one on the CPU, to
    check this code where there is no GPU (no figure of it means anything)."""
    import torch
    from torch import nn

    from gpushare.client import runner

    session = runner.SESSION
    dev = os.environ.get("GPUSHARE_BENCH_DEVICE", "cuda")
    cuda = dev == "cuda"
    if os.environ.get("GPUSHARE_BENCH_TINY"):
        vocab, d, layers, heads, seq, batch = 256, 64, 2, 4, 64, 4
    else:
        vocab, d, layers, heads, seq, batch = 8192, 768, 8, 12, 512, 16
    t_start = time.monotonic()

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.pos = nn.Parameter(torch.zeros(seq, d))
            layer = nn.TransformerEncoderLayer(d, heads, 4 * d, batch_first=True, norm_first=True)
            self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = nn.Linear(d, vocab)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            mask = nn.Transformer.generate_square_subsequent_mask(seq, device=x.device)
            h = self.blocks(self.emb(x) + self.pos, mask=mask, is_causal=True)
            return self.head(h)

    # Set-up does GPU work outside any forward: inside a burst, as docs/run.md says.
    with session.gpu() if session else contextlib.nullcontext():
        model = GPT().to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        sync()
        reserved = torch.cuda.memory_reserved() if cuda else 0
        ballast_n = max(0, target - reserved - 6 * GiB) if cuda else 0  # 6 GiB: the work
        ballast = torch.empty(ballast_n, dtype=torch.uint8, device=dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    t_from, t_until = t_start + warmup, t_start + warmup + seconds
    tokens = steps = 0
    while True:
        x = torch.randint(0, vocab, (batch, seq + 1), device=dev, generator=gen)
        with torch.autocast(dev, dtype=torch.bfloat16):
            logits = model(x[:, :-1])
            loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sync()
        now = time.monotonic()
        if t_from <= now <= t_until:
            tokens += batch * seq
            steps += 1
        if now > t_until:
            break
    del ballast
    return {
        "tokens": tokens,
        "steps": steps,
        "tokens_per_s": tokens / seconds,
        "loss": float(loss.item()),
        "peak_reserved_bytes": torch.cuda.max_memory_reserved() if cuda else 0,
        "target_bytes": target,
        "under_gpushare": session is not None,
    }


# --- the driver ------------------------------------------------------------------------


def _run_part(args: list[str], env: dict[str, str] | None = None, timeout: float = 300) -> Any:
    out = subprocess.run(
        [sys.executable, str(HERE), "--part", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    if out.returncode != 0:
        return {"error": (out.stderr or out.stdout).strip().splitlines()[-3:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def _gpu_bytes() -> int:
    import pynvml

    pynvml.nvmlInit()
    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total)
    finally:
        pynvml.nvmlShutdown()


RESERVE = 4 * GiB  # CUDA contexts and PyTorch's own bits live outside the sessions


class Node:
    """``gpushare node`` on the real GPU, in a temporary folder, and programs run on it."""

    def __init__(self, tmp: Path, tq: float, *flags: str) -> None:
        self.sock, self.admin = str(tmp / "w.sock"), str(tmp / "a.sock")
        self.events = tmp / f"events-{time.monotonic_ns()}.jsonl"
        cmd = [sys.executable, "-m", "gpushare", "node", "--socket", self.sock]
        cmd += ["--admin-socket", self.admin, "--metrics-port", "0", "--log-level", "warning"]
        cmd += ["--event-log", str(self.events), "--mode", "exclusive"]
        cmd += ["--reserve", str(RESERVE), "--tq", str(tq), *flags]
        self.proc = subprocess.Popen(cmd)
        from gpushare.tools.demo import wait_for_socket

        wait_for_socket(self.admin, self.proc)

    def run(
        self, cmds: list[list[str]], host_memory: int | None, timeout: float
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Run the commands at once, then stop the node: each one's last JSON line (or
        its error), and the node's events. Their stderr goes to ours."""
        env = dict(os.environ)
        if host_memory is not None:
            env["GPUSHARE_HOST_MEMORY"] = str(host_memory)
        try:
            procs = [subprocess.Popen(c, stdout=subprocess.PIPE, text=True, env=env) for c in cmds]
            outs = [_last_json(p.communicate(timeout=timeout)[0]) for p in procs]
        finally:
            self.proc.terminate()
            self.proc.wait(timeout=20)
        events = [json.loads(x) for x in self.events.read_text().splitlines() if x.strip()]
        return outs, events

    def gpushare_run(self, limit: int, *part: str) -> list[str]:
        """This script's ``part`` as an unmodified program under ``gpushare run``."""
        cmd = [sys.executable, "-m", "gpushare", "run", "--memory", str(limit)]
        return [*cmd, "--socket", self.sock, "--", sys.executable, str(HERE), "--part", *part]


def switch(tmp: Path, total: int, seconds: float, sequential: bool) -> dict[str, Any]:
    cap = total - RESERVE
    # Each switch moves fill + limit - cap (about 7% of the GPU) each way.
    limit, fill = int(cap * 0.54) // GiB * GiB, int(cap * 0.52) // GiB * GiB
    node = Node(tmp, 1.5, *(["--sequential-switches"] if sequential else []))
    holder = [sys.executable, str(HERE), "--part", "holder", node.sock]
    holder += [str(limit), str(fill), str(seconds)]
    outs, ev = node.run([holder, holder], fill + limit - cap + 2 * GiB, seconds + 120)
    from gpushare.tools.report import switches

    sw = switches(ev).seconds
    moved = [e["bytes"] for e in ev if e["event"] == "swap_out" and e["bytes"]]
    return {
        "switches": len(sw),
        "switch_median_s": statistics.median(sw) if sw else None,
        "bytes_per_switch": statistics.median(moved) if moved else 0,
        "intact": all(o.get("intact") for o in outs),
        "errors": [o["error"] for o in outs if "error" in o],
    }


def _last_json(text: str) -> dict[str, Any]:
    lines = text.strip().splitlines()
    try:
        out: dict[str, Any] = json.loads(lines[-1])
        return out
    except (IndexError, ValueError):
        return {"error": lines[-3:]}


def lm_pair(tmp: Path, tq: float, seconds: float, warmup: float, total: int) -> dict[str, Any]:
    node = Node(tmp, tq)
    limit = int(total * 0.6)
    # What one session may be asked to swap out: the other's limit past the free part.
    host = 2 * limit - (total - RESERVE) + 4 * GiB
    lm = node.gpushare_run(limit, "lm", str(seconds), str(warmup), str(limit))
    outs, ev = node.run([lm, lm], host, seconds + warmup + 180)
    if any("error" in o for o in outs):
        return {"tq_s": tq, "error": [o.get("error") for o in outs]}
    return {
        "tq_s": tq,
        "tokens_per_s": sum(o["tokens_per_s"] for o in outs),
        "each": [o["tokens_per_s"] for o in outs],
        "switches": len([e for e in ev if e["event"] == "revoke"]),
    }


def lm_alone(tmp: Path, seconds: float, warmup: float, target: int, gs: bool) -> dict[str, Any]:
    args = ["lm", str(seconds), str(warmup), str(target)]
    if not gs:
        return _run_part(args, timeout=seconds + warmup + 180)
    node = Node(tmp, 30)
    outs, _ = node.run([node.gpushare_run(target, *args)], None, seconds + warmup + 180)
    return outs[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="PATH", help="write every figure here")
    ap.add_argument("--quick", action="store_true", help="a smoke run: small and short")
    args = ap.parse_args()
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    if not cuda:
        raise SystemExit(
            "gpu_swap: needs PyTorch with CUDA and a GPU, and this machine has none:"
            " run it on a GPU machine (docs/benchmarks.md)"
        )
    q = args.quick
    started = time.monotonic()
    res: dict[str, Any] = {"quick": q}
    size = (2 if q else 8) * GiB
    res["copy"] = _run_part(["copy", str(size // 2)])
    res["swap"] = _run_part(["swap", str(size), "3" if q else "5"])
    res["tms"] = _run_part(["tms", str(size), "3" if q else "5"])
    total = _gpu_bytes()
    res["gpu_bytes"] = total
    with tempfile.TemporaryDirectory(prefix="gsb-") as d:
        tmp = Path(d)
        sw_s = 6 if q else 12
        res["switch_overlap"] = switch(tmp, total, sw_s, sequential=False)
        res["switch_sequential"] = switch(tmp, total, sw_s, sequential=True)
        target = int(total * 0.6)
        secs, warm = (8, 6) if q else (15, 8)
        res["lm_bare"] = lm_alone(tmp, secs, warm, target, gs=False)
        res["lm_gpushare"] = lm_alone(tmp, secs, warm, target, gs=True)
        for tq, pair_s in ((10, 25 if q else 40), (30, 65 if q else 70)):
            res[f"lm_pair_tq{tq}"] = lm_pair(tmp, tq, pair_s, warm, total)
    res["seconds"] = time.monotonic() - started
    _ratios(res)
    _print(res)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


def _get(res: dict[str, Any], *path: str) -> float | None:
    v: Any = res
    for k in path:
        if not isinstance(v, dict) or k not in v:
            return None
        v = v[k]
    return float(v) if isinstance(v, int | float) else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _ratios(res: dict[str, Any]) -> None:
    d2h, h2d = _get(res, "copy", "d2h_gbs"), _get(res, "copy", "h2d_gbs")
    r: dict[str, float | None] = {}
    for which in ("first", "steady"):
        r[f"swap_out_{which}"] = _ratio(_get(res, "swap", f"out_{which}_gbs"), d2h)
        r[f"swap_in_{which}"] = _ratio(_get(res, "swap", f"in_{which}_gbs"), h2d)
        r[f"tms_pause_{which}"] = _ratio(_get(res, "tms", f"pause_{which}_gbs"), d2h)
        r[f"tms_resume_{which}"] = _ratio(_get(res, "tms", f"resume_{which}_gbs"), h2d)
    r["switch_overlap_vs_sequential"] = _ratio(
        _get(res, "switch_overlap", "switch_median_s"),
        _get(res, "switch_sequential", "switch_median_s"),
    )
    bare = _get(res, "lm_bare", "tokens_per_s")
    for tq in (10, 30):
        r[f"lm_aggregate_tq{tq}"] = _ratio(_get(res, f"lm_pair_tq{tq}", "tokens_per_s"), bare)
    r["lm_uncontended"] = _ratio(_get(res, "lm_gpushare", "tokens_per_s"), bare)
    res["ratios"] = r


TARGETS = {
    "swap_out_first": 0.9,
    "swap_in_first": 0.9,
    "swap_out_steady": 0.9,
    "swap_in_steady": 0.9,
    "switch_overlap_vs_sequential": 0.7,
    "lm_aggregate_tq10": 0.9,
    "lm_aggregate_tq30": 0.95,
    "lm_uncontended": 0.99,
}


def _print(res: dict[str, Any]) -> None:
    def f(v: float | None, unit: str = "") -> str:
        return "n/a" if v is None else f"{v:.3g}{unit}"

    print(f"\ngpushare GPU benchmark ({res['seconds']:.0f} s{', quick' if res['quick'] else ''})")
    print(
        f"reference pinned copies: D2H {f(_get(res, 'copy', 'd2h_gbs'), ' GB/s')}, "
        f"H2D {f(_get(res, 'copy', 'h2d_gbs'), ' GB/s')}, "
        f"both at once {f(_get(res, 'copy', 'both_gbs'), ' GB/s')}"
    )
    print(
        f"gpushare pinning at attach: {f(_get(res, 'swap', 'pin_s'), ' s')} for "
        f"{f((_get(res, 'swap', 'pinned_bytes') or 0) / GiB, ' GiB')} (background)"
    )
    print(f"{'figure':38} {'value':>10} {'target':>8}")
    for k, v in res["ratios"].items():
        t = TARGETS.get(k)
        bound = "" if t is None else (f"<= {t}" if k.startswith("switch") else f">= {t}")
        print(f"{k:38} {f(v):>10} {bound:>8}")
    for k in ("swap", "tms", "switch_overlap", "switch_sequential"):
        if isinstance(res.get(k), dict) and ("error" in res[k] or "skipped" in res[k]):
            print(f"{k}: {res[k].get('error') or res[k].get('skipped')}")


def _part(argv: list[str]) -> None:
    name, rest = argv[0], argv[1:]
    if name == "copy":
        out = part_copy(int(rest[0]))
    elif name == "swap":
        out = part_swap(int(rest[0]), int(rest[1]))
    elif name == "tms":
        out = part_tms(int(rest[0]), int(rest[1]))
    elif name == "holder":
        out = part_holder(rest[0], int(rest[1]), int(rest[2]), float(rest[3]))
    elif name == "lm":
        out = part_lm(float(rest[0]), float(rest[1]), int(rest[2]))
    else:
        raise SystemExit(f"unknown part {name}")
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--part":
        _part(sys.argv[2:])
    else:
        main()

"""GPU swap benchmark parts: each runs in a fresh process (its own CUDA context and
allocator state) and writes one JSON object. A benchmark, not a test. The staged check
(``benchmarks/gpu_check.py``, ``sh benchmarks/gpu_check.sh``) runs them, each with a
timeout, and writes every figure as it comes; ``python benchmarks/gpu_swap.py`` runs its
stage 2 (these parts) alone.

Parts (``--check NAME --json PATH [--dry]``):

* ``env``      versions: Python, PyTorch, CUDA, the driver, the GPU;
* ``build``    gpushare's allocator library, built with the system C compiler;
* ``selftest`` the driver layer on the GPU: the self-test at attach, then one swap of a
               few GiB through gpushare's allocator, content and addresses checked;
* ``copy``     reference pinned ``cudaMemcpyAsync`` GB/s: device to host, host to device,
               both at once on two streams; and the pinning rate;
* ``swap``     the torch backend: swap-out and swap-in GB/s on the first switch after
               attach and in steady state, content and addresses checked;
* ``tms``      torch-memory-saver's own pause/resume on the same bytes (the anchor);
* ``switch_overlap``, ``switch_sequential``  a real node on the GPU, two sessions each
               holding 54% of it: revoke to the next session swapped in, overlapped and
               with ``--sequential-switches``;
* ``lm_bare``, ``lm_gpushare``, ``lm_pair_tq10``, ``lm_pair_tq30``  a small transformer
               language model (plus a buffer bringing it to 60% of the GPU) alone and bare,
               alone under ``gpushare run``, two at once under gpushare at TQ 10 s, 30 s.

``--dry`` runs each part tiny where there is no GPU, so that the harness itself is
checked (``make test``): the driver parts against a fake libcuda built from
``tests/client/swap/fake_libcuda.c`` (``GPUSHARE_FAKE_LIBCUDA``), the node parts on a
simulated GPU, the language model on the CPU. No dry figure means anything.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

GiB = 2**30
MiB = 2**20
HERE = Path(__file__).resolve()
SRC = HERE.parent.parent / "src"
if SRC.is_dir():  # a checkout: use it without installing
    sys.path.insert(0, str(SRC))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(SRC), os.environ.get("PYTHONPATH", "")) if p
    )
DRY_GPU = 16 * GiB  # the simulated GPU of a dry run
RESERVE = 4 * GiB  # CUDA contexts and PyTorch's own bits live outside the sessions


def _sync_time(torch: Any, fn: Any) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


# --- parts without a node --------------------------------------------------------------


def check_env(dry: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"python": platform.python_version(), "dry": dry}
    try:
        import torch

        out["torch"] = torch.__version__
        out["torch_cuda"] = torch.version.cuda
        out["cuda_available"] = torch.cuda.is_available()
        if out["cuda_available"]:
            p = torch.cuda.get_device_properties(0)
            out["gpu"] = p.name
            out["gpu_bytes"] = p.total_memory
    except ImportError as e:
        out["torch"] = f"not installed ({e})"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        out["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    import gpushare

    out["gpushare"] = gpushare.__version__
    return out


def check_build(dry: bool) -> dict[str, Any]:
    from gpushare.client.swap.shim import shim_path

    t0 = time.perf_counter()
    path = shim_path()
    return {"path": path, "seconds": time.perf_counter() - t0, "dry": dry}


def _libcuda(dry: bool) -> str:
    return os.environ["GPUSHARE_FAKE_LIBCUDA"] if dry else "libcuda.so.1"


def vmm_cycles(dry: bool, size: int, cycles: int) -> dict[str, Any]:
    """gpushare's allocator and swap loop on the driver, no PyTorch: ``size`` bytes in
    four allocations, written from the host, swapped out and in ``cycles`` times, read
    back and compared; addresses kept by construction, checked owned."""
    from gpushare.client.swap import shim
    from gpushare.client.swap.cuda import CudaDriver
    from gpushare.client.swap.vmm import PIECE_BYTES, VmmBackend

    lib = _libcuda(dry)
    driver = CudaDriver(0, lib=lib)
    piece = 2 * MiB if dry else PIECE_BYTES
    store = shim.load()
    store.configure(lib, 0, size + 2 * piece, piece)
    b = VmmBackend(driver, store, size + 2 * piece, host_bytes=size)
    b.wait_for_host_buffers()
    n = size // 4
    pattern = os.urandom(min(n, 16 * MiB))
    with driver.context():
        stream, ev = driver.new_stream(), driver.new_event()
        host = driver.host_alloc(n)
        for off in range(0, n, len(pattern)):
            ctypes.memmove(host + off, pattern, min(len(pattern), n - off))
        vas = [b.allocate(n) for _ in range(4)]
        for va in vas:
            driver.copy_htod(va, host, n, stream)
        driver.record(ev, stream)
        driver.wait(ev)
    outs, ins = [], []
    for _ in range(cycles):
        r = b.swap_out(b.resident_bytes)
        outs.append(r.bytes / r.seconds / 1e9)
        gone = b.resident_bytes == 0
        r = b.swap_in()
        ins.append(r.bytes / r.seconds / 1e9)
    ok = gone
    with driver.context():
        for va in vas:
            ctypes.memset(host, 0, n)
            driver.copy_dtoh(host, va, n, stream)
            driver.record(ev, stream)
            driver.wait(ev)
            ok = ok and all(
                ctypes.string_at(host + off, min(len(pattern), n - off))
                == pattern[: min(len(pattern), n - off)]
                for off in range(0, n, len(pattern))
            )
        driver.host_free(host)
    stable = all(store.owns(va) for va in vas)
    for va in vas:
        b.free(va)
    b.close()
    return {
        "bytes": 4 * n,
        "pin_s": b.host.pin_seconds,
        "out_first_gbs": outs[0],
        "in_first_gbs": ins[0],
        "out_steady_gbs": statistics.median(outs[1:]) if len(outs) > 1 else outs[0],
        "in_steady_gbs": statistics.median(ins[1:]) if len(ins) > 1 else ins[0],
        "intact": ok,
        "addresses_stable": stable,
        "dry": dry,
    }


def check_selftest(dry: bool, p: dict[str, Any]) -> dict[str, Any]:
    from gpushare.client.swap.cuda import CudaDriver, self_test

    t0 = time.perf_counter()
    self_test(CudaDriver(0, lib=_libcuda(dry)))
    out = {"self_test_s": time.perf_counter() - t0}
    out.update(vmm_cycles(dry, int(p["bytes"]), 2))
    if not (out["intact"] and out["addresses_stable"]):
        out["error"] = "swapped memory came back different"
    return out


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


# A check reads a tensor this many elements at a time: a session's memory is full, and a
# whole-tensor check makes temporaries past its limit (on the first H200 run, a 1 GiB
# uint8 sum made an 8 GiB int64 copy and `x == 1` a 1 GiB one: out of memory, so the
# parts failed and said nothing of the bytes).
CHECK_CHUNK = 16 * MiB


def checksum(x: Any) -> int:
    """The sum of ``x``'s elements, a chunk at a time (each chunk's int64 copy 128 MiB)."""
    import torch

    return sum(int(c.sum(dtype=torch.int64)) for c in x.reshape(-1).split(CHECK_CHUNK))


def all_equal(x: Any, value: int) -> bool:
    """Whether every element of ``x`` is ``value``, a chunk at a time."""
    return all(bool((c == value).all()) for c in x.reshape(-1).split(CHECK_CHUNK))


def part_swap(size: int, cycles: int) -> dict[str, Any]:
    import torch

    from gpushare.client.swap.torch import TorchBackend

    t0 = time.perf_counter()
    b = TorchBackend(size + GiB, host_bytes=size + GiB)  # room for small-pool segments too
    attach_s = time.perf_counter() - t0
    b.wait_for_host_buffers()
    n = size // GiB
    xs = [torch.randint(0, 256, (GiB,), dtype=torch.uint8, device=b.device) for _ in range(n)]
    sums = [checksum(x) for x in xs]
    ptrs = [x.data_ptr() for x in xs]
    outs, ins = [], []
    for _ in range(cycles):
        r = b.swap_out(b.resident_bytes)
        outs.append(r.bytes / r.seconds / 1e9)
        r = b.swap_in()
        ins.append(r.bytes / r.seconds / 1e9)
    intact = [checksum(x) for x in xs] == sums
    stable = [x.data_ptr() for x in xs] == ptrs
    return {
        "bytes": b.resident_bytes,
        "route": b.route,
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
    total = checksum(x)
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
        "intact": checksum(x) == total,
    }


def part_stepper(sock: str, memory: int, fill: int, seconds: float, dry: bool) -> dict[str, Any]:
    """A session that fills its memory, then computes in short steps for ``seconds``
    (revoked and granted again by the node as its quanta come; dry: on a simulated GPU,
    its memory the sim backend's): the wall time at which each step ended, to be laid
    beside the node's prefetch windows, and whether its memory came back intact."""
    import gpushare

    s = gpushare.attach(memory, socket=sock, backend="sim" if dry else "torch")
    backend: Any = s.backend
    ends: list[float] = []
    if dry:
        with s.gpu():
            mem = backend.allocate(fill)
            mem.fill(1)
        end = time.monotonic() + seconds
        with s.gpu():
            while time.monotonic() < end:
                time.sleep(0.005)
                ends.append(time.time())
                s.checkpoint()
            ok = bool(mem.verify(1))
        s.close()
        return {"session": s.id, "ends": ends, "intact": ok, "grants": s.grants, "dry": True}
    import torch

    backend.wait_for_host_buffers()
    with s.gpu():
        xs = [torch.ones(GiB, dtype=torch.uint8, device="cuda") for _ in range(fill // GiB)]
        y = torch.randn(2048, 2048, device="cuda")
    end = time.monotonic() + seconds
    with s.gpu():
        while time.monotonic() < end:
            for _ in range(4):
                y = (y @ y).tanh()
            torch.cuda.synchronize()
            ends.append(time.time())
            s.checkpoint()
        ok = all(all_equal(x, 1) for x in xs)
    s.close()
    return {"session": s.id, "ends": ends, "intact": ok, "grants": s.grants}


def step_rates(
    ends: list[float], windows: list[tuple[float, float]], gap: float = 0.1
) -> tuple[list[float], list[float]]:
    """A holder's step times (seconds per step) split by whether the step ended inside
    one of ``windows`` (another session's prefetch); a pause longer than ``gap`` is not
    a step (the session was waiting for its turn)."""
    inside: list[float] = []
    outside: list[float] = []
    for a, b in itertools.pairwise(ends):
        if b - a > gap:
            continue
        (inside if any(lo <= b <= hi for lo, hi in windows) else outside).append(b - a)
    return inside, outside


def prefetch_overlap(tmp: Path, dry: bool, p: dict[str, Any]) -> dict[str, Any]:
    """Three sessions in turns on a node that holds two and a half of them (its
    ``--reserve`` sized from the host's memory by the plan): one is always in host
    memory, and the next holder swaps in during the quantum (prefetch), on the copy
    engines, while the holder computes. The holder's step time while another session
    prefetches against its step time otherwise, in the same run: what hiding a switch
    costs the holder. Each session pins what it may have to hold: its limit."""
    limit, fill, seconds = int(p["limit"]), int(p["fill"]), float(p["seconds"])
    node = Node(tmp, float(p["tq"]), reserve=int(p["reserve"]), dry=dry)
    steppers = [node.stepper(limit, fill, seconds)] * 3
    outs, ev = node.run(steppers, int(p["host"]), seconds + 120)
    errors = [o["error"] for o in outs if "error" in o]
    if errors:
        return {"error": errors, "dry": dry}
    # a prefetch's window: from its swap-in's start to its end, as the node saw them
    pre = [e for e in ev if e["event"] == "swap_in" and e.get("prefetch") and e["bytes"]]
    inside: list[float] = []
    outside: list[float] = []
    for o in outs:
        others = [(e["ts"] - e["seconds"], e["ts"]) for e in pre if e["session"] != o["session"]]
        i, x = step_rates(o["ends"], others)
        inside += i
        outside += x
    step_in = statistics.median(inside) if inside else None
    step_out = statistics.median(outside) if outside else None
    out: dict[str, Any] = {
        "prefetches": len(pre),
        "prefetched_bytes": sum(e["bytes"] for e in pre),
        "steps_while_prefetching": len(inside),
        "steps_otherwise": len(outside),
        "step_s_while_prefetching": step_in,
        "step_s_otherwise": step_out,
        "holder_throughput_while_prefetching": step_out / step_in if step_in and step_out else None,
        "intact": all(o.get("intact") for o in outs),
        "dry": dry,
    }
    if not out["intact"]:
        out["error"] = "a session's memory came back different"
    return out


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
    # Pinned host buffers are made in the background from attach (about 1 GiB/s): the
    # timed window starts once they are there, or it would measure pinning.
    wait_pins = getattr(session.backend if session else None, "wait_for_host_buffers", None)
    pin_wait_s = 0.0
    if wait_pins is not None:
        t0 = time.monotonic()
        wait_pins()
        pin_wait_s = time.monotonic() - t0
    t_start = time.monotonic()
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
        "pin_wait_s": pin_wait_s,
    }


# --- parts with a node ------------------------------------------------------------------


class Node:
    """``gpushare node`` on the GPU (dry: a simulated one), in a temporary folder, and
    programs run on it."""

    def __init__(
        self, tmp: Path, tq: float, *flags: str, reserve: int = RESERVE, dry: bool = False
    ) -> None:
        self.dry = dry
        self.sock, self.admin = str(tmp / "w.sock"), str(tmp / "a.sock")
        self.events = tmp / f"events-{time.monotonic_ns()}.jsonl"
        cmd = [sys.executable, "-m", "gpushare", "node", "--socket", self.sock]
        cmd += ["--admin-socket", self.admin, "--metrics-port", "0", "--log-level", "warning"]
        cmd += ["--event-log", str(self.events), "--mode", "exclusive"]
        cmd += ["--reserve", str(reserve), "--tq", str(tq), *flags]
        if dry:
            cmd += ["--sim-gpus", "1", "--sim-memory", str(DRY_GPU)]
        self.proc = subprocess.Popen(cmd)
        from gpushare.tools.demo import wait_for_socket

        wait_for_socket(self.admin, self.proc, timeout=60)

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

    def stepper(self, limit: int, fill: int, seconds: float) -> list[str]:
        """This script's ``stepper`` part as a session of this node."""
        cmd = [sys.executable, str(HERE), "--part", "stepper", self.sock]
        return [*cmd, str(limit), str(fill), str(seconds), "1" if self.dry else "0"]

    def gpushare_run(self, limit: int, *part: str) -> list[str]:
        """This script's ``part`` as an unmodified program under ``gpushare run``."""
        cmd = [sys.executable, "-m", "gpushare", "run", "--memory", str(limit)]
        return [*cmd, "--socket", self.sock, "--", sys.executable, str(HERE), "--part", *part]


def _last_json(text: str) -> dict[str, Any]:
    lines = text.strip().splitlines()
    try:
        out: dict[str, Any] = json.loads(lines[-1])
        return out
    except (IndexError, ValueError):
        return {"error": lines[-3:]}


def switch(tmp: Path, dry: bool, p: dict[str, Any], sequential: bool) -> dict[str, Any]:
    """Two sessions, each over half of the node (its capacity the plan's): each switch
    moves fill + limit - capacity each way, a few GiB, sized from the host's memory."""
    seconds, limit, fill = float(p["seconds"]), int(p["limit"]), int(p["fill"])
    flags = ["--sequential-switches"] * sequential
    node = Node(tmp, float(p["tq"]), *flags, reserve=int(p["reserve"]), dry=dry)
    holder = node.stepper(limit, fill, seconds)
    outs, ev = node.run([holder, holder], int(p["host"]), seconds + 120)
    from gpushare.tools.report import switches

    sw = switches(ev).seconds
    moved = [e["bytes"] for e in ev if e["event"] == "swap_out" and e["bytes"]]
    out = {
        "switches": len(sw),
        "switch_median_s": statistics.median(sw) if sw else None,
        "bytes_per_switch": statistics.median(moved) if moved else 0,
        "intact": all(o.get("intact") for o in outs),
        "dry": dry,
    }
    errors = [o["error"] for o in outs if "error" in o]
    if errors or not out["intact"]:
        out["error"] = errors or "a holder's memory came back different"
    return out


def lm_pair(tmp: Path, dry: bool, p: dict[str, Any]) -> dict[str, Any]:
    """Two LMs, each a little over half of the node (its capacity the plan's): what one
    may be asked to swap out (the other's limit past the free part, a few GiB) is what
    each pins (``host``)."""
    secs, warm, tq, limit = float(p["seconds"]), float(p["warmup"]), float(p["tq"]), p["limit"]
    node = Node(tmp, tq, reserve=int(p["reserve"]), dry=dry)
    lm = node.gpushare_run(int(limit), "lm", str(secs), str(warm), str(limit))
    outs, ev = node.run([lm, lm], int(p["host"]), secs + warm + 180)
    if any("error" in o for o in outs):
        return {"tq_s": tq, "error": [o.get("error") for o in outs]}
    return {
        "tq_s": tq,
        "tokens_per_s": sum(o["tokens_per_s"] for o in outs),
        "each": [o["tokens_per_s"] for o in outs],
        "pin_wait_s": [o.get("pin_wait_s") for o in outs],
        "switches": len([e for e in ev if e["event"] == "revoke"]),
        "dry": dry,
    }


def lm_alone(tmp: Path, dry: bool, p: dict[str, Any], gs: bool) -> dict[str, Any]:
    """One of the pair's LMs alone: bare, or under ``gpushare run`` uncontended."""
    target, secs, warm = int(p["target"]), float(p["seconds"]), float(p["warmup"])
    args = ["lm", str(secs), str(warm), str(target)]
    if not gs:
        out = subprocess.run(
            [sys.executable, str(HERE), "--part", *args], capture_output=True, text=True
        )
        return _last_json(out.stdout) if out.returncode == 0 else {"error": out.stderr[-2000:]}
    node = Node(tmp, 30, reserve=int(p["reserve"]), dry=dry)
    # Uncontended: nothing is swapped, so little is pinned (pinning runs at ~1 GiB/s).
    outs, _ = node.run([node.gpushare_run(target, *args)], int(p["host"]), secs + warm + 180)
    return outs[0]


def check_copy(dry: bool, p: dict[str, Any]) -> dict[str, Any]:
    if not dry:
        return part_copy(int(p["bytes"]))
    import torch  # the code path on the CPU: no pinning, no streams, no figure

    a, b = torch.ones(MiB, dtype=torch.uint8), torch.empty(MiB, dtype=torch.uint8)
    t0 = time.perf_counter()
    b.copy_(a)
    gbs = MiB / (time.perf_counter() - t0) / 1e9
    out = {"bytes": MiB, "d2h_gbs": gbs, "h2d_gbs": gbs, "both_gbs": gbs, "dry": True}
    # tests of the harness: a pinning rate as measured, to make the check plan again
    rate = os.environ.get("GPUSHARE_CHECK_PIN_GIBS")
    if rate:
        out["pin_gibs"] = float(rate)
    return out


def check_swap(dry: bool, p: dict[str, Any]) -> dict[str, Any]:
    if dry:
        return vmm_cycles(True, int(p["bytes"]), int(p["cycles"]))
    return part_swap(int(p["bytes"]), int(p["cycles"]))


def check_tms(dry: bool, p: dict[str, Any]) -> dict[str, Any]:
    if dry:
        return {"skipped": "dry run: torch-memory-saver needs CUDA"}
    return part_tms(int(p["bytes"]), 3)


# Each part with the plan's parameters for it (gpu_check.plan: sizes and windows).
CHECKS: dict[str, Any] = {
    "env": lambda dry, p: check_env(dry),
    "build": lambda dry, p: check_build(dry),
    "selftest": check_selftest,
    "copy": check_copy,
    "swap": check_swap,
    "tms": check_tms,
    "switch_overlap": lambda dry, p: _with_tmp(switch, dry, p, False),
    "switch_sequential": lambda dry, p: _with_tmp(switch, dry, p, True),
    "lm_bare": lambda dry, p: _with_tmp(lm_alone, dry, p, False),
    "lm_gpushare": lambda dry, p: _with_tmp(lm_alone, dry, p, True),
    "lm_pair_tq10": lambda dry, p: _with_tmp(lm_pair, dry, p),
    "lm_pair_tq30": lambda dry, p: _with_tmp(lm_pair, dry, p),
    "prefetch_overlap": lambda dry, p: _with_tmp(prefetch_overlap, dry, p),
}


def _with_tmp(fn: Any, dry: bool, *args: Any) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="gsb-") as d:
        out: dict[str, Any] = fn(Path(d), dry, *args)
        return out


def planned_params(name: str, dry: bool) -> dict[str, Any]:
    """A part's parameters where none were passed: this machine's plan."""
    sys.path.insert(0, str(HERE.parent))
    import gpu_check

    m = gpu_check.MACHINES["dry"] if dry else gpu_check.this_machine(False)
    row = next(r for r in gpu_check.plan(m, dry) if r.part.name == name)
    if row.skip:
        raise SystemExit(f"gpu_swap: {name} is planned out here: {row.skip}")
    return row.params


def _part(argv: list[str]) -> None:
    """A part started by another part (a holder, an LM): prints its JSON."""
    name, rest = argv[0], argv[1:]
    if name == "stepper":
        out = part_stepper(rest[0], int(rest[1]), int(rest[2]), float(rest[3]), rest[4] == "1")
    elif name == "lm":
        out = part_lm(float(rest[0]), float(rest[1]), int(rest[2]))
    else:
        raise SystemExit(f"unknown part {name}")
    print(json.dumps(out), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", choices=sorted(CHECKS), help="run one part")
    ap.add_argument("--json", metavar="PATH", help="where the part's JSON goes")
    ap.add_argument("--dry", action="store_true", help="tiny, without a GPU")
    ap.add_argument("--params", default="", help="the part's sizes as JSON (gpu_check's plan)")
    args, rest = ap.parse_known_args()
    if args.check is None:  # the benchmark's parts, through the staged check
        sys.path.insert(0, str(HERE.parent))
        from gpu_check import main as check_main

        check_main(["--stages", "2", *(["--dry"] if args.dry else []), *rest])
        return
    hang = os.environ.get("GPUSHARE_CHECK_HANG", "")
    if hang == args.check:  # tests of the harness: this part never ends
        time.sleep(10**6)
    params = json.loads(args.params) if args.params else planned_params(args.check, args.dry)
    out = CHECKS[args.check](args.dry, params)
    text = json.dumps(out, indent=1, default=str)
    if args.json:
        Path(args.json).write_text(text)
    print(text)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--part":
        _part(sys.argv[2:])
    else:
        main()

"""Handoff latency and checkpoint() cost on one simulated GPU. A benchmark, not a test.

Handoff: from the moment a holder's process leaves its burst (just before it sends its
release) to the moment the next process returns from ``gpu()`` holding the lease, over
real processes and the node's real socket, in exclusive mode so every grant is a
handoff. Both instants are read from CLOCK_MONOTONIC, which all processes share.
Each configuration names how many sessions are attached and how many of them cycle
back to back (the rest stay attached and idle): 64/64 measures the daemon and the
machine's scheduler waking 64 processes in turn, 64/2 the daemon's cost of 64 sessions.

checkpoint(): the per-call cost with nobody waiting, beside an empty method call
measured in the same run (the ratio holds when the machine's speed drifts).

    python benchmarks/handoff.py [--sessions 2 16 64] [--grants 2000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import gpushare
from gpushare.tools.demo import wait_for_socket
from handoffs import handoffs, percentile


def client(sock: str, go: str, out: str, bursts: int) -> None:
    s = gpushare.attach("64MiB", socket=sock, name=f"bench-{os.getpid()}")
    while not os.path.exists(go):
        time.sleep(0.005)
    rows = []
    if bursts == 0:  # an idle, attached session
        while not os.path.exists(go + ".stop"):
            time.sleep(0.05)
    for _ in range(bursts):
        t_ask = time.monotonic()
        with s.gpu():
            t_grant = time.monotonic()
            t_release = time.monotonic()
        rows.append((t_ask, t_grant, t_release))

        # Away between bursts longer than half the node's idle_release (0.01 s here): a
        # session done for now, whose quantum does not wait for it (docs/scheduling.md);
        # back to back, a burst's end would keep the quantum and hand nothing over.
        time.sleep(0.006)
    s.close()
    Path(out).write_text(json.dumps(rows))


def start_node(
    sock: str, admin: str, *extra: str, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpushare",
            "node",
            "--socket",
            sock,
            "--admin-socket",
            admin,
            "--sim-gpus",
            "1",
            "--sim-memory",
            "80GiB",
            "--log-level",
            "warning",
            "--metrics-port",
            "0",
            *extra,
        ],
        env=env,
    )


def workload_results(
    procs: list[subprocess.Popen[str]], timeout: float, who: str
) -> list[dict[str, Any]]:
    """Each ``gpushare.tools.workloads`` process's figures (its last line, JSON), once it
    ends; one that fails ends the benchmark ``who`` with its error's tail."""
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        if p.returncode != 0:
            raise SystemExit(f"{who}: a workload failed: {err[-800:]}")
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


def run_handoff(n: int, active: int, total: int, tmp: Path) -> dict[str, float]:
    sock, admin, go = str(tmp / "w.sock"), str(tmp / "a.sock"), str(tmp / f"go{n}-{active}")
    node = start_node(sock, admin, "--mode", "exclusive", "--tq", "600", "--idle-release", "0.01")
    try:
        wait_for_socket(admin, node)
        bursts = max(20, total // active)
        outs = [str(tmp / f"c{n}-{active}-{i}.json") for i in range(n)]
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--client",
                    sock,
                    go,
                    o,
                    str(bursts if i < active else 0),
                ]
            )
            for i, o in enumerate(outs)
        ]
        from gpushare.tools.admin import AdminClient

        with AdminClient(admin) as c:
            while len(c.status().gpus[0].sessions) < n:
                time.sleep(0.02)
        Path(go).touch()
        for pr in procs[:active]:
            pr.wait(timeout=600)
        Path(go + ".stop").touch()
        for pr in procs:
            if pr.wait(timeout=600) != 0:
                raise SystemExit(f"a benchmark client failed with {pr.returncode}")
    finally:
        node.terminate()
        node.wait(timeout=10)
    bursts = [tuple(b) for o in outs[:active] for b in json.loads(Path(o).read_text())]
    us = [h * 1e6 for h in handoffs(bursts)]
    return {
        "sessions": n,
        "active": active,
        "handoffs": len(us),
        "p50_us": percentile(us, 0.5),
        "p99_us": percentile(us, 0.99),
        "max_us": max(us),
        "mean_us": statistics.mean(us),
    }


class _Empty:
    def method(self) -> None:
        pass


def run_checkpoint(tmp: Path, calls: int = 1_000_000) -> dict[str, float]:
    sock, admin = str(tmp / "cw.sock"), str(tmp / "ca.sock")
    node = start_node(sock, admin)
    try:
        wait_for_socket(admin, node)
        s = gpushare.attach("1GiB", socket=sock)
        e = _Empty()
        best_cp, best_empty = float("inf"), float("inf")
        with s.gpu():
            for _ in range(5):  # interleaved, best of five: the noise floor
                t0 = time.perf_counter()
                for _ in range(calls):
                    s.checkpoint()
                best_cp = min(best_cp, (time.perf_counter() - t0) / calls)
                t0 = time.perf_counter()
                for _ in range(calls):
                    e.method()
                best_empty = min(best_empty, (time.perf_counter() - t0) / calls)
        s.close()
    finally:
        node.terminate()
        node.wait(timeout=10)
    return {
        "checkpoint_ns": best_cp * 1e9,
        "empty_method_ns": best_empty * 1e9,
        "ratio": best_cp / best_empty,
    }


def run_hooks(tmp: Path, modules: int = 200, reps: int = 200) -> dict[str, float] | None:
    """A module call's cost with ``gpushare run``'s hooks installed, beside the same call
    bare, measured in this process one after the other (CPU PyTorch; None without it)."""
    try:
        import torch
    except ImportError:
        return None
    from gpushare.client import hooks

    m = torch.nn.Sequential(*[torch.nn.Identity() for _ in range(modules)])
    x = torch.ones(1)

    def per_call() -> float:
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(reps):
                m(x)
            best = min(best, (time.perf_counter() - t0) / reps / modules)
        return best

    bare = per_call()
    sock, admin = str(tmp / "hw.sock"), str(tmp / "ha.sock")
    node = start_node(sock, admin, "--idle-release", "60")
    try:
        wait_for_socket(admin, node)
        s = gpushare.attach("1GiB", socket=sock)
        handles = hooks.install(s)
        m(x)  # the first call opens the burst
        hooked = per_call()
        for h in handles:
            h.remove()
        s.close()
    finally:
        node.terminate()
        node.wait(timeout=10)
    return {"module_call_ns": bare * 1e9, "module_call_hooked_ns": hooked * 1e9}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        client(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--runs",
        nargs="+",
        default=["2/2", "16/16", "64/64", "64/2"],
        metavar="SESSIONS/ACTIVE",
        help="attached/cycling sessions per run",
    )
    ap.add_argument("--grants", type=int, default=2000, help="handoffs per run (about)")
    ap.add_argument("--json", metavar="FILE", help="also write the figures here")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="gs-bench-") as d:
        tmp = Path(d)
        runs = [tuple(int(x) for x in r.split("/")) for r in a.runs]
        rows = [run_handoff(n, act, a.grants, tmp) for n, act in runs]
        cp = run_checkpoint(tmp)
        hk = run_hooks(tmp)
    print(f"handoff on one simulated GPU, {os.cpu_count()} CPUs, real processes and sockets")
    print(
        f"{'sessions':>8} {'cycling':>8} {'handoffs':>8} {'p50 us':>8} {'p99 us':>8} {'max us':>9}"
    )
    for r in rows:
        print(
            f"{r['sessions']:>8} {r['active']:>8} {r['handoffs']:>8} {r['p50_us']:>8.0f}"
            f" {r['p99_us']:>8.0f} {r['max_us']:>9.0f}"
        )
    print(
        f"checkpoint() with nobody waiting: {cp['checkpoint_ns']:.0f} ns per call"
        f" (an empty method call: {cp['empty_method_ns']:.0f} ns; ratio {cp['ratio']:.1f})"
    )
    if hk:
        print(
            f"a module call with gpushare run's hooks: {hk['module_call_hooked_ns']:.0f} ns"
            f" (bare: {hk['module_call_ns']:.0f} ns)"
        )
    result = {"handoff": rows, "checkpoint": cp, "hooks": hk, "cpus": os.cpu_count()}
    print(json.dumps(result))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A switch with swap-out and swap-in overlapped, against one after the other, on a
simulated GPU. A benchmark, not a test.

Two 30 GiB batch sessions on a 40 GiB simulated GPU (exclusive, TQ 0.5 s), so every
switch moves 20 GiB each way at the timing model's rates (docs/simulated-gpu.md). Each
round runs the node once as it is and once with ``--sequential-switches``, back to back
(the order alternating), and reads each switch's time from revoke to the next holder
swapped in from the event log. The figure is the ratio of the medians in one run; the
test beside it (tests/node/test_node.py) checks only that the grant overlaps, which no
machine's load can change.

    python benchmarks/switch_overlap.py [--rounds 2] [--seconds 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import gpushare
from gpushare.tools.admin import AdminClient
from gpushare.tools.demo import wait_for_socket
from gpushare.tools.report import read_events, switches
from memory_requests import workload_results


def _node(tmp: Path, sequential: bool) -> tuple[subprocess.Popen[bytes], str, str, Path]:
    sock, admin, events = str(tmp / "w.sock"), str(tmp / "a.sock"), tmp / "events.jsonl"
    cmd = [sys.executable, "-m", "gpushare", "node", "--socket", sock, "--admin-socket"]
    cmd += [admin, "--event-log", str(events), "--sim-gpus", "1", "--sim-memory", "40GiB"]
    cmd += ["--mode", "exclusive", "--tq", "0.5", "--log-level", "warning"]
    cmd += ["--metrics-port", "0", *(["--sequential-switches"] * sequential)]
    proc = subprocess.Popen(cmd)
    wait_for_socket(admin, proc)
    return proc, sock, admin, events


def _waiting(admin: str) -> int:
    with AdminClient(admin) as c:
        return len(c.status().gpus[0].queue)


def one_run(tmp: Path, sequential: bool, seconds: float) -> list[float]:
    """Each switch's seconds from revoke to the next holder swapped in, in one node run."""
    node, sock, admin, events = _node(tmp, sequential)
    try:
        # Held by a gate until both wait: they contend from their first burst.
        with gpushare.attach("1MiB", socket=sock, name="gate") as gate, gate.gpu():
            batch = [sys.executable, "-m", "gpushare.tools.workloads", "batch"]
            batch += ["--socket", sock, "--memory", "30GiB", "--seconds", str(seconds)]
            procs = [
                subprocess.Popen(
                    [*batch, "--name", f"j{i}"],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                for i in (1, 2)
            ]
            deadline = time.monotonic() + 120
            while _waiting(admin) < 2:
                if time.monotonic() > deadline:
                    raise SystemExit("switch_overlap: the two sessions never both waited")
                time.sleep(0.05)
        workload_results(procs, seconds * 20 + 120, "benchmarks/switch_overlap.py")
    finally:
        node.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            node.wait(timeout=10)
        if node.poll() is None:
            node.kill()
    time.sleep(0.2)  # the event log's writer thread has flushed by now (and at exit)
    return switches(read_events(events)).seconds


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python benchmarks/switch_overlap.py")
    ap.add_argument("--rounds", type=int, default=2, help="node runs of each mode")
    ap.add_argument("--seconds", type=float, default=8.0, help="each workload's length")
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.seconds <= 0:
        ap.error("--rounds must be at least 1 and --seconds positive")
    got: dict[str, list[float]] = {"overlapped": [], "sequential": []}
    with tempfile.TemporaryDirectory(prefix="gs-overlap-") as d:
        for r in range(args.rounds):
            order = [False, True] if r % 2 == 0 else [True, False]
            for sequential in order:
                run = Path(d) / f"r{r}-{int(sequential)}"
                run.mkdir()
                seconds = one_run(run, sequential, args.seconds)
                got["sequential" if sequential else "overlapped"] += seconds
    out: dict[str, Any] = {"simulated": True}
    for mode, secs in got.items():
        if not secs:
            raise SystemExit(f"switch_overlap: no switch measured {mode}")
        out[mode] = {"switches": len(secs), "median_s": round(statistics.median(secs), 3)}
    out["ratio"] = round(out["overlapped"]["median_s"] / out["sequential"]["median_s"], 3)
    print("mode        switches  median revoke-to-swapped-in (simulated GPU)")
    for mode in got:
        print(f"{mode:<11} {out[mode]['switches']:>8}  {out[mode]['median_s']:.3f} s")
    print(f"overlapped / sequential: {out['ratio']:.2f} (full duplex: about 0.5-0.6)")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

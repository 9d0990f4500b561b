"""A grower beside a session at its request (issue 38 item 2, docs/scheduling.md 6): H's
work alone and beside G, side by side in one run. A benchmark, not a test.

A real node (one simulated GPU of 80 GiB, mode auto, TQ 3) and real workload processes:
H (``short``, 40 GiB, request = limit, bursts of about 0.1 s) and G (``batch``, request
1 GiB, limit 79 GiB, growing by 77 GiB a second in). Prints H's steps in each arm and
their ratio, and the bytes of H swapped out.

    python benchmarks/growth.py [--seconds S]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from gpushare.tools.demo import wait_for_socket
from handoff import start_node, workload_results


def run_arm(tmp: Path, arm: str, seconds: float) -> dict[str, Any]:
    sock, admin, events = str(tmp / f"{arm}.sock"), str(tmp / f"{arm}.admin"), tmp / f"{arm}.ev"
    node = start_node(sock, admin, "--mode", "auto", "--tq", "3", "--event-log", str(events))
    try:
        wait_for_socket(admin, node)
        wl = [sys.executable, "-m", "gpushare.tools.workloads"]
        cmds = [[*wl, "short", "--socket", sock, "--memory", "40GiB", "--name", "h"]]
        if arm == "with_g":
            cmds.append([*wl, "batch", "--socket", sock, "--memory", "1GiB", "--name", "g",
                         "--memory-limit", "79GiB", "--grow", "77GiB", "--grow-at", "1",
                         "--grow-for", str(seconds)])  # fmt: skip
        procs = [
            subprocess.Popen(
                [*c, "--seconds", str(seconds)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for c in cmds
        ]
        outs = workload_results(procs, seconds * 20 + 120, "benchmarks/growth.py")
    finally:
        node.terminate()
        node.wait(timeout=30)
    ev = [json.loads(x) for x in events.read_text().splitlines() if x.strip()]
    hid = outs[0]["session"]
    swapped = sum(e["bytes"] for e in ev if e["event"] == "swap_out" and e["session"] == hid)
    return {"steps": outs[0]["steps"], "swapped_gib": swapped / 2**30}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=10.0)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        alone = run_arm(Path(d), "alone", a.seconds)
        beside = run_arm(Path(d), "with_g", a.seconds)
    ratio = beside["steps"] / max(1, alone["steps"])
    print(
        f"H's steps alone {alone['steps']}, beside G {beside['steps']} (ratio {ratio:.2f});"
        f" H swapped out beside G {beside['swapped_gib']:.0f} GiB"
    )


if __name__ == "__main__":
    main()

"""Request and limit on a real GPU, end to end (issue 39): the ``bounds`` part of
``gpu_check.py``, after its smoke stage.

A node on GPU 0 in mode ``auto``; a torch-backend session with a request below its
limit allocates past its request (the allocator library asks: a release with reason
``grow``, a grant whose ``bound_bytes`` is below the limit), an allocation past the
limit fails with the contract's ``OutOfMemoryError``, a second session's burst swaps
the first one's memory out, and at its next burst every byte is back.

Where there is no GPU it writes ``{"skipped": "<one line>"}`` and exits 0.

    python benchmarks/gpu_bounds.py --json OUT.json [--params '{"unit": bytes}']
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MiB = 2**20


def no_gpu() -> str:
    """Why this part cannot run here ("": it can)."""
    try:
        import torch
    except ImportError:
        return "no PyTorch here: the bounds check needs the torch backend on a GPU"
    if not torch.cuda.is_available():
        return "no GPU here (torch.cuda.is_available() is False): the bounds check needs one"
    return ""


def _events(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line being written
    return out


def check(unit: int, work: Path) -> dict[str, Any]:
    """The run on GPU 0: the figures, or ``error`` saying what did not hold."""
    import torch

    import gpushare
    from gpushare.errors import OutOfMemoryError

    sock, admin, events = work / "w.sock", work / "a.sock", work / "events.jsonl"
    total = torch.cuda.get_device_properties(0).total_memory
    # the node keeps all but request + 12 units (plus contexts) from its sessions
    reserve = total - 24 * unit - 2 * 1024 * MiB
    node = subprocess.Popen(
        [sys.executable, "-m", "gpushare", "node", "--socket", str(sock),
         "--admin-socket", str(admin), "--event-log", str(events), "--mode", "auto",
         "--reserve", str(reserve), "--metrics-port", "0"],
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        s = gpushare.attach(
            memory=4 * unit, memory_limit=8 * unit, socket=str(sock), name="grower", timeout=30
        )
        kept = []
        refused = False
        with s.gpu():
            for i in range(6):  # 4 within the request, 2 past it
                t = torch.full((unit // 4,), float(i), dtype=torch.float32, device="cuda")
                kept.append(t)
            try:
                kept.append(torch.empty(3 * unit, dtype=torch.uint8, device="cuda"))
            except (OutOfMemoryError, torch.OutOfMemoryError):
                refused = True
            torch.cuda.synchronize()
        ev = _events(events)
        bounds = [e.get("bound_bytes") for e in ev if e["event"] == "grant"]
        grew = [e for e in ev if e["event"] == "release" and e.get("reason") == "grow"]
        other = gpushare.attach(memory=12 * unit, socket=str(sock), name="other", timeout=30)
        with other.gpu():
            big = torch.ones(12 * unit, dtype=torch.uint8, device="cuda")
            torch.cuda.synchronize()
            del big
        other.close()
        with s.gpu():
            intact = all(bool((t == float(i)).all()) for i, t in enumerate(kept[:6]))
        s.close()
        out: dict[str, Any] = {
            "bounds": bounds,
            "grow_releases": len(grew),
            "past_limit_refused": refused,
            "intact": intact,
        }
        lent = [b for b in bounds if b and 4 * unit < b < 8 * unit]
        if not (grew and lent and refused and intact):
            out["error"] = "a bound, a grow, the limit's refusal and intact bytes: not all held"
        return out
    finally:
        os.killpg(node.pid, signal.SIGTERM)
        node.wait(timeout=20)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True, help="where the result goes")
    ap.add_argument("--params", default="{}", help="the plan's sizes: {'unit': bytes}")
    ap.add_argument("--check", default="bounds", help="the part (gpu_check.py names it)")
    ap.add_argument("--dry", action="store_true", help="as the others; skips without a GPU")
    args = ap.parse_args(argv)
    why = no_gpu()
    if why:
        result: dict[str, Any] = {"skipped": why}
        print(f"bounds: skipped: {why}")
    else:
        unit = int(json.loads(args.params).get("unit", 256 * MiB))
        with tempfile.TemporaryDirectory(prefix="gs-bounds-") as d:
            result = check(unit, Path(d))
        print(f"bounds: {json.dumps(result)}")
    Path(args.json).write_text(json.dumps(result))
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())

"""Grant latency with a process filling the disk beside the node, against without: side
by side in one run. A benchmark, not a test.

A real node (simulated GPU, exclusive mode) keeps its session records and its event
log (``--event-log``: a line per grant, release and revoke) on a real disk (its sockets'
folder, in ``--dir``: not a tmpfs, where a flush costs nothing); two raw
protocol sessions take turns as fast as the node grants (each grant asks for a whole
write of the records 0.1 s later, so the node writes about ten a second), and each
handoff's latency is timed (the holder's release written to the next one's grant read).
Quiet and loaded phases alternate (``--rounds`` of each, ``--seconds`` long); loaded,
another process writes 512 MiB files one after the other, each flushed (``fsync``) and
removed, as a checkpoint written beside the node does. Printed: p50, p99 and the worst handoff of
each, and loaded / quiet. ``--before REV`` runs another version of the node the same
way, in turn, for its column.

    python benchmarks/disk_pressure.py [--before REV|DIR] [--seconds S] [--rounds N]
        [--dir DIR] [--size MiB] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from load import load  # noqa: E402
from node_costs import Raw, percentile, take_turns, tree  # noqa: E402

REPO = HERE.parent


@contextlib.contextmanager
def node(src: Path, folder: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    d = Path(tempfile.mkdtemp(prefix="dp-", dir=folder))
    sock, admin = str(d / "w.sock"), str(d / "a.sock")
    cfg = d / "node.toml"
    cfg.write_text("max_messages_per_s = 1e6\n")
    env = {**os.environ, "PYTHONPATH": str(src)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpushare", "node", "--config", str(cfg), "--socket", sock,
         "--admin-socket", admin, "--sim-gpus", "1", "--sim-memory", "80GiB",
         "--mode", "exclusive", "--tq", "600", "--metrics-port", "0", "--log-level", "error",
         "--event-log", str(d / "events.jsonl")],
        env=env,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(admin):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the node did not start")
            time.sleep(0.02)
        yield proc, sock
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for f in d.iterdir():
            with contextlib.suppress(OSError):
                f.unlink()
        with contextlib.suppress(OSError):
            d.rmdir()


def figures(lat: list[float]) -> dict[str, float]:
    return {
        "p50_ms": percentile(lat, 0.5) * 1e3,
        "p99_ms": percentile(lat, 0.99) * 1e3,
        "max_ms": max(lat) * 1e3,
        "handoffs": len(lat),
    }


def turns_for(sessions: list[Raw], seconds: float) -> list[float]:
    out: list[float] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        out += take_turns(sessions, 100)
    return out


def measure(src: Path, folder: Path, seconds: float, mib: int) -> dict[str, Any]:
    """Quiet, then loaded, ``seconds`` each, on one node."""
    with node(src, folder) as (_, sock):
        sessions = [Raw(sock, "a"), Raw(sock, "b")]
        take_turns(sessions, 200, start=True)  # warm
        quiet = turns_for(sessions, seconds)
        with load(0, str(folder / "writer"), mib):
            time.sleep(1.0)  # dirty pages piling up: the flush under way
            loaded = turns_for(sessions, seconds)
        for s in sessions:
            s.close()
    return {"quiet": figures(quiet), "loaded": figures(loaded)}


def report(results: dict[str, dict[str, Any]]) -> str:
    labels = list(results)
    head = f"{'figure':28}" + "".join(f"{label:>16}" for label in labels)
    lines = [head, "-" * len(head)]
    for phase in ("quiet", "loaded"):
        for f in ("p50_ms", "p99_ms", "max_ms"):
            vals = "".join(f"{results[label][phase][f]:16.2f}" for label in labels)
            lines.append(f"{phase + ' ' + f:28}{vals}")
    for f in ("p50_ms", "p99_ms", "max_ms"):
        vals = "".join(
            f"{results[label]['loaded'][f] / max(results[label]['quiet'][f], 1e-9):15.1f}x"
            for label in labels
        )
        lines.append(f"{'loaded / quiet ' + f:28}{vals}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", help="a revision, or a folder with src/, to compare with")
    ap.add_argument("--seconds", type=float, default=5.0, help="per phase and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/var/tmp", help="on the disk to measure (not a tmpfs)")
    ap.add_argument("--size", type=int, default=512, help="MiB per file the writer flushes")
    ap.add_argument("--json", help="write the figures here too")
    a = ap.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="gpushare-disk-", dir=a.dir))
    results: dict[str, dict[str, Any]] = {}
    try:
        with contextlib.ExitStack() as stack:
            trees = {"this tree": REPO / "src"}
            if a.before:
                trees = {f"before ({a.before})": stack.enter_context(tree(a.before, folder)),
                         **trees}  # fmt: skip
            runs = {label: [] for label in trees}  # type: dict[str, list[dict[str, Any]]]
            for _ in range(a.rounds):  # the trees in turn: both see the machine as it is
                for label, src in trees.items():
                    runs[label].append(measure(src, folder, a.seconds, a.size))
            for label, rs in runs.items():
                results[label] = {
                    phase: {
                        "p50_ms": sorted(r[phase]["p50_ms"] for r in rs)[len(rs) // 2],
                        "p99_ms": sorted(r[phase]["p99_ms"] for r in rs)[len(rs) // 2],
                        "max_ms": max(r[phase]["max_ms"] for r in rs),
                    }
                    for phase in ("quiet", "loaded")
                }
    finally:
        subprocess.run(["rm", "-rf", str(folder)], check=False)
    print(f"grant latency, two sessions taking turns; loaded: a {a.size} MiB writer, fsync each")
    print(f"({a.rounds} rounds of {a.seconds:g} s per phase and tree, the trees in turn;")
    print("p50 and p99: the rounds' medians; max: the worst of all)")
    print(report(results))
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

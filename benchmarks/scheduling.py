"""Scheduling on simulated GPUs: goodput, waits, batch loss and weighted shares, side by
side in one run (docs/scheduling.md, docs/benchmarks.md). A benchmark, not a test.

Real node processes, real workload processes over the real socket, one simulated GPU of
80 GiB in mode exclusive. Each workload works in steps of 5 ms with a safe point after
each and records every step (CLOCK_MONOTONIC, shared by all processes); goodput is the
union of all sessions' steps over the measured window (GPU seconds of work per second).

* short bursts: three sessions of 30 GiB looping ``with s.gpu():`` around 100 ms of work,
  at TQ 1/5/30, against the ideal of one switch per quantum (the same sessions working
  in one long burst each, the same settings);
* long bursts: the same three at TQ 1/5/30, with and without prefetch;
* a notebook (cells of 50-200 ms of work, 0.5-1.5 s of thought between) beside two batch
  jobs, 30 GiB each, at TQ 5 and 30: a cell's wait p50/p99 (and beyond its own swap-in),
  and batch loss: 1 - (batch + cell work) / (batch work with the two batch jobs alone);
* weighted shares: two batch jobs of 50 GiB (they swap at every switch), weights 1:1,
  1:3 and 1:9, policy weighted, TQ 0.3 (a round of both quanta and two switches is
  then 1.3-1.6 s, 2.2-2.6% of a window: the least error a window of whole quanta can
  have, docs/scheduling.md, 4): each 60 s window's work ratio against the weights.

So that the default run takes minutes, not an hour, a run whose TQ is above ``--max-tq``
(default 5 s) runs on a scaled clock: TQ 30 runs as TQ 5 with every duration of its
workloads (bursts, cells, thinking, the node's idle release and turn) divided by 6 and a
modelled link 6 times faster, so switch costs keep their ratio to the quantum; the work
steps (5 ms) and the handoffs (a millisecond on this machine) do not scale, which makes
the scaled figures a little pessimistic. The weighted runs are in real time (a scaled
clock would double the handoffs' part of a 33 ms quantum), 90 s each. ``--full`` runs
everything in real time, each run at least two rounds, weighted over three 60 s windows
(about 40 minutes). Figures are ratios measured side by
side in one run. Then ``benchmarks/node_costs.py``'s ``main()`` runs when that file is
there (node CPU per grant and scrape, handoff p99, mass attach).

    python benchmarks/scheduling.py [--full] [--only short,long,interactive,weighted]
                                    [--tqs 1 5 30] [--json out.json] [--no-node-costs]
                                    [--before REV|DIR]

``--before``: the weighted runs also run with the node (the arbiter) of that version (a
revision, checked out in a temporary worktree, or a folder with ``src/``), each weight
before and after in turn; the workloads are this tree's in both.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gpushare
from gpushare.tools.demo import wait_for_socket
from handoff import start_node

HERE = Path(__file__).resolve().parent
GIB = 2**30
BANDWIDTH = 55e9
GPU_GIB = 80  # the simulated GPU handoff.start_node makes
PARTS = ("short", "long", "interactive", "weighted")


# --- a workload process -----------------------------------------------------------------


class Recorder:
    """A session's work as it goes: steps of ``step`` seconds, a safe point after each,
    merged into intervals where one follows another at once; each burst's wait and the
    bytes swapped out when it asked."""

    def __init__(self, s: gpushare.Session, spec: dict[str, Any], end: float) -> None:
        self.s, self.spec, self.end = s, spec, end
        self.backend: Any = s.backend
        self.steps: list[list[float]] = []
        self.waits: list[list[float]] = []  # seconds waited, bytes swapped out when it asked

    def work(self, n: int) -> None:
        step, steps = self.spec["step"], self.steps
        for _ in range(n):
            t0 = time.monotonic()
            time.sleep(step)
            t1 = time.monotonic()
            if steps and t0 - steps[-1][1] < 2e-4:
                steps[-1][1] = t1
            else:
                steps.append([t0, t1])
            self.s.checkpoint()
            if time.monotonic() >= self.end and self.spec["kind"] == "batch":
                return

    def burst(self, n: int) -> None:
        swapped, t_ask = self.backend.swapped_bytes, time.monotonic()
        with self.s.gpu():
            self.waits.append([time.monotonic() - t_ask, swapped])
            self.work(n)


def _batch(r: Recorder, rng: random.Random) -> None:
    r.burst(1 << 62)  # one burst, to the end


def _short(r: Recorder, rng: random.Random) -> None:
    while time.monotonic() < r.end:
        r.burst(round(0.1 / r.spec["scale"] / r.spec["step"]))


def _interactive(r: Recorder, rng: random.Random) -> None:
    """Think first (a notebook's user), then a cell."""
    scale, step = r.spec["scale"], r.spec["step"]
    while True:
        time.sleep(rng.uniform(0.5, 1.5) / scale)
        if time.monotonic() >= r.end:
            break
        r.burst(max(1, round(rng.uniform(0.05, 0.2) / scale / step)))


KINDS = {"batch": _batch, "short": _short}  # any other kind: interactive


def worker(spec: dict[str, Any]) -> None:
    """One session: allocate, wait for the go file, work as ``kind`` says, record steps
    (merged into intervals) and each burst's wait, check the memory's pattern; write them
    as JSON."""
    rng = random.Random(spec["seed"])
    s = gpushare.attach(
        spec["memory"], socket=spec["socket"], name=spec["name"], weight=spec["weight"]
    )
    backend: Any = s.backend
    with s.gpu():
        mem = backend.allocate(spec["memory"])
        mem.fill(spec["seed"])
    Path(spec["out"] + ".ready").touch()
    while not os.path.exists(spec["go"]):
        time.sleep(0.002)
    r = Recorder(s, spec, time.monotonic() + spec["seconds"])
    KINDS.get(spec["kind"], _interactive)(r, rng)
    # Every chunk swapped in was checked (CRC-32) as it came back; the whole pattern is
    # checked once at the end (checking it at every grant would be CPU work counted as
    # GPU time, a tenth of a short quantum).
    with s.gpu():
        if not mem.verify(spec["seed"]):
            raise SystemExit("memory pattern lost in a swap")
    s.close()
    Path(spec["out"]).write_text(json.dumps({"steps": r.steps, "waits": r.waits}))


# --- a run: a node and its workloads ------------------------------------------------------


@dataclass
class Session:
    kind: str
    memory: int
    weight: float = 1.0
    steps: list[list[float]] = field(default_factory=list)
    waits: list[list[float]] = field(default_factory=list)

    def work(self, t0: float, t1: float) -> float:
        return sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in self.steps)


@dataclass
class Result:
    t0: float
    t1: float
    sessions: list[Session]
    grants: int
    swapped_bytes: int
    continued: int  # grants that went on with the quantum after a burst's end
    grant_times: list[list[float]] = field(default_factory=list)  # each session's, in the window
    turns: int = 0  # grants in the window that were interactive turns

    def goodput(self) -> float:
        """Seconds some session worked, per second of the window."""
        spans = sorted((a, b) for s in self.sessions for a, b in s.steps)
        busy, end = 0.0, self.t0
        for a, b in spans:
            a, b = max(a, end), min(b, self.t1)
            if b > a:
                busy += b - a
                end = b
        return busy / (self.t1 - self.t0)

    def work(self, kind: str | None = None) -> float:
        return sum(s.work(self.t0, self.t1) for s in self.sessions if kind in (None, s.kind))


def start_workers(
    d: Path,
    sessions: list[Session],
    sock: str,
    seconds: float,
    scale: float,
    step: float,
    procs: list[subprocess.Popen[bytes]],
) -> list[str]:
    """A workload process per session, each working ``seconds`` (scaled) once the go
    file is there, started one at a time: each allocates alone (the others' memory may
    swap meanwhile). Each is added to ``procs`` as it starts (a failed start leaves the
    others there, to be killed); their output files."""
    outs = []
    for i, sess in enumerate(sessions):
        out = str(d / f"s{i}.json")
        spec = {
            "socket": sock,
            "name": f"{sess.kind}-{i}",
            "kind": sess.kind,
            "memory": sess.memory,
            "weight": sess.weight,
            "seconds": seconds,
            "step": step,  # safe points as often at any scale
            "scale": scale,
            "seed": i + 1,
            "out": out,
            "go": str(d / "go"),
        }
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(spec)]))
        outs.append(out)
        deadline = time.monotonic() + 60
        while not os.path.exists(out + ".ready"):
            if procs[-1].poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"a benchmark worker failed to start: {spec['name']}")
            time.sleep(0.01)
    return outs


def window(d: Path, sessions: list[Session], t0: float, t1: float) -> Result:
    """What the node's events say of the measured window ``t0``..``t1`` (monotonic)."""
    events = [json.loads(x) for x in (d / "events.jsonl").read_text().splitlines()]
    wall = time.time() - time.monotonic()  # events carry Unix time
    within = [e for e in events if t0 <= e["ts"] - wall <= t1]
    grants = [e for e in within if e["event"] == "grant"]
    attached = [e for e in events if e["event"] == "attach"]
    index = {e["session"]: int(e["name"].rsplit("-", 1)[1]) for e in attached}
    grant_times: list[list[float]] = [[] for _ in sessions]
    for e in grants:
        grant_times[index[e["session"]]].append(e["ts"])
    return Result(
        t0,
        t1,
        sessions,
        len(grants),
        sum(e.get("bytes", 0) for e in within if e["event"] == "swap_out"),
        sum(1 for e in grants if e.get("continued")),
        grant_times,
        sum(1 for e in grants if e.get("turn")),
    )


def run(
    tmp: Path,
    sessions: list[Session],
    seconds: float,
    scale: float,
    tq: float,
    *node_flags: str,
    policy: str = "equal",
    node_src: Path | None = None,
    step: float = 0.005,
    warm_s: float | None = None,
) -> Result:
    """A node at TQ ``tq`` and ``sessions`` (allocated one by one, then started
    together), ``seconds`` measured after a first round (every session has had its
    first quantum and swaps); durations divided by ``scale``. ``node_src``: the node (the
    arbiter) from that src folder; the workloads are this tree's either way. ``step``:
    the workloads' work between safe points (seconds, not scaled). ``warm_s``: unscaled
    seconds before the measured window (default: a quantum per session)."""
    d = Path(tempfile.mkdtemp(dir=tmp))
    sock, admin = str(d / "w.sock"), str(d / "a.sock")
    node = start_node(
        sock,
        admin,
        "--sim-bandwidth",
        str(BANDWIDTH * scale),
        "--mode",
        "exclusive",
        "--policy",
        policy,
        "--tq",
        str(tq / scale),
        "--idle-release",
        str(0.5 / scale),
        "--turn",
        str(1.0 / scale),
        "--event-log",
        str(d / "events.jsonl"),
        *node_flags,
        env=None if node_src is None else {**os.environ, "PYTHONPATH": str(node_src)},
    )
    procs: list[subprocess.Popen[bytes]] = []
    try:
        wait_for_socket(admin, node)
        warm = (tq * len(sessions) if warm_s is None else warm_s) / scale
        outs = start_workers(d, sessions, sock, warm + seconds / scale, scale, step, procs)
        t_go = time.monotonic()
        Path(d / "go").touch()
        for pr in procs:
            if pr.wait(timeout=warm + seconds / scale + 120) != 0:
                raise SystemExit(f"a benchmark worker failed with {pr.returncode}")
    finally:
        for pr in procs:
            if pr.poll() is None:
                pr.kill()
        node.terminate()
        node.wait(timeout=10)
    for sess, out in zip(sessions, outs, strict=True):
        data = json.loads(Path(out).read_text())
        sess.steps, sess.waits = data["steps"], data["waits"]
    return window(d, sessions, t_go + warm, t_go + warm + seconds / scale)


def three(kind: str, memory: int = 30 * GIB) -> list[Session]:
    """Three sessions of 30 GiB on 80 GiB: every switch moves 10 GiB each way."""
    return [Session(kind, memory) for _ in range(3)]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


# --- the parts ------------------------------------------------------------------------------


def plan(a: argparse.Namespace, tq: float, sessions: int) -> tuple[float, float]:
    """Seconds to measure (unscaled: ``--rounds`` rounds, at least ``--seconds``) and the
    time scale of a run at ``tq``."""
    scale = max(1.0, tq / a.max_tq)
    return max(a.seconds * scale, a.rounds * sessions * tq), scale


def part_short(tmp: Path, a: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for tq in a.tqs:
        secs, scale = plan(a, tq, 3)
        short = run(tmp, three("short"), secs, scale, tq)
        ideal = run(tmp, three("batch"), secs, scale, tq)
        rows.append(
            {
                "tq": tq,
                "scale": scale,
                "short_goodput": short.goodput(),
                "ideal_goodput": ideal.goodput(),
                "ratio": short.goodput() / ideal.goodput(),
                "short_grants": short.grants,
                "short_continued": short.continued,
                "short_swapped_gib": short.swapped_bytes / GIB,
            }
        )
    return rows


def part_long(tmp: Path, a: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for tq in a.tqs:
        secs, scale = plan(a, tq, 3)
        on = run(tmp, three("batch"), secs, scale, tq)
        off = run(tmp, three("batch"), secs, scale, tq, "--no-prefetch")
        rows.append(
            {"tq": tq, "scale": scale, "prefetch": on.goodput(), "no_prefetch": off.goodput()}
        )
    return rows


def part_interactive(tmp: Path, a: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for tq in [t for t in a.tqs if t >= 5] or a.tqs[-1:]:
        secs, scale = plan(a, tq, 3)
        mix = run(tmp, [*two_batch(), nb()], secs, scale, tq)
        alone = run(tmp, two_batch(), secs, scale, tq)
        cells = [w for s in mix.sessions if s.kind == "interactive" for w in s.waits]
        own = [w - b / (BANDWIDTH * scale) for w, b in cells]  # beyond its own swap-in
        loss = 1 - mix.work() / alone.work("batch")
        rows.append(
            {
                "tq": tq,
                "scale": scale,
                "cells": len(cells),
                "wait_p50_s": pct([w for w, _ in cells], 0.5) * scale,
                "wait_p99_s": pct([w for w, _ in cells], 0.99) * scale,
                "beyond_swap_in_p99_s": pct(own, 0.99) * scale,
                "batch_loss": loss,
                "cell_share": mix.work("interactive") / alone.work("batch"),
            }
        )
    return rows


def two_batch() -> list[Session]:
    return [Session("batch", 30 * GIB), Session("batch", 30 * GIB)]


def nb() -> Session:
    return Session("interactive", 30 * GIB)


def part_weighted(tmp: Path, a: argparse.Namespace) -> list[dict[str, Any]]:
    """Each weight on this tree's node and (``--before``) the other's, in turn. The round
    (both quanta and two switches) over the window is the least error a window's ends can
    cut when a round's quanta are whole (docs/scheduling.md, 4): printed beside."""
    rows = []
    window = 60.0  # in real time: a scaled clock would not scale the handoffs
    trees: list[tuple[str, Path | None]] = [("after", None)]
    if a.before_src is not None:
        trees.insert(0, ("before", a.before_src))
    for w in a.weights:
        for label, src in trees:
            gib = int(a.weighted_gib * GIB)
            sessions = [Session("batch", gib, 1.0), Session("batch", gib, float(w))]
            secs = a.windows * 60.0
            r = run(
                tmp,
                sessions,
                secs,
                1.0,
                a.weighted_tq,
                policy="weighted",
                node_src=src,
                step=a.weighted_step,
                # Measured from the steady round: each job was idle before the start
                # (allocating one by one), so its first ask is a turn (docs/scheduling.md,
                # 3) of up to 1 s and its swap-in; half a second of turn in a 60 s window
                # is 40% of a 1:9 light session's share.
                warm_s=2 * a.weighted_tq + 1.0 + 2 * 0.5,
            )
            errs = []  # every 60 s window, sliding by a second
            t = r.t0
            while t + window <= r.t1 + 1e-9:
                lo, hi = (s.work(t, t + window) for s in r.sessions)
                errs.append(abs(hi / lo / w - 1) if lo else float("inf"))
                t += 1.0
            total = r.sessions[1].work(r.t0, r.t1) / r.sessions[0].work(r.t0, r.t1)
            g = r.grant_times[0]  # the lighter session's: one a round
            round_s = (g[-1] - g[0]) / max(1, len(g) - 1)
            rows.append(
                {
                    "weights": f"1:{w:g}",
                    "tree": label,
                    "ratio": total,
                    "window_error_max": max(errs),
                    "window_error_mean": sum(errs) / len(errs),
                    "windows": len(errs),
                    "goodput": r.goodput(),
                    "round_s": round_s,
                    "round_over_window": round_s / 60.0,
                    "turns": r.turns,
                }
            )
    return rows


# --- the report -----------------------------------------------------------------------------


def report(res: dict[str, Any], a: argparse.Namespace) -> str:
    out = [
        f"scheduling on one simulated GPU of 80 GiB, mode exclusive, {os.cpu_count()} CPUs;"
        + (" real time" if a.full else f" runs above TQ {a.max_tq:g} s time-scaled")
        + " (figures in unscaled seconds)"
    ]
    if "short" in res:
        out.append("\nshort bursts (3 x 30 GiB, `with s.gpu()` around 100 ms, back to back)")
        out.append(
            f"{'TQ s':>6} {'goodput':>8} {'ideal':>8} {'ratio':>6} {'grants':>7}"
            f" {'continued':>10} {'swapped GiB':>12}"
        )
        for r in res["short"]:
            out.append(
                f"{r['tq']:>6g} {r['short_goodput']:>8.3f} {r['ideal_goodput']:>8.3f}"
                f" {r['ratio']:>6.2f} {r['short_grants']:>7} {r['short_continued']:>10}"
                f" {r['short_swapped_gib']:>12.0f}"
            )
    if "long" in res:
        out.append("\nlong bursts (3 x 30 GiB, one burst each)")
        out.append(f"{'TQ s':>6} {'prefetch':>9} {'without':>8}")
        for r in res["long"]:
            out.append(f"{r['tq']:>6g} {r['prefetch']:>9.3f} {r['no_prefetch']:>8.3f}")
    if "interactive" in res:
        out.append("\na notebook beside two batch jobs (30 GiB each)")
        out.append(
            f"{'TQ s':>6} {'cells':>6} {'wait p50':>9} {'wait p99':>9} {'p99 beyond':>11}"
            f" {'batch loss':>11} {'cells share':>12}"
        )
        for r in res["interactive"]:
            out.append(
                f"{r['tq']:>6g} {r['cells']:>6} {r['wait_p50_s']:>8.3f}s {r['wait_p99_s']:>8.3f}s"
                f" {r['beyond_swap_in_p99_s']:>10.3f}s {r['batch_loss']:>11.1%}"
                f" {r['cell_share']:>12.1%}"
            )
    if "weighted" in res:
        out.append(
            f"\nweighted shares (2 x {a.weighted_gib:g} GiB, "
            + (
                f"swapping {2 * a.weighted_gib - GPU_GIB:g} GiB each way at every switch"
                if 2 * a.weighted_gib > GPU_GIB
                else "no swapping: they fit together"
            )
            + f", TQ {a.weighted_tq:g} s,"
            f" safe points every {a.weighted_step * 1e3:g} ms, 60 s windows sliding by 1 s;"
            " ratio: over the whole run; round: the lighter session's grant to its next)"
        )
        out.append(
            f"{'weights':>8} {'tree':>7} {'ratio':>7} {'window error max':>17} {'mean':>6}"
            f" {'windows':>8} {'goodput':>8} {'round s':>8} {'round/window':>13} {'turns':>6}"
        )
        for r in res["weighted"]:
            out.append(
                f"{r['weights']:>8} {r.get('tree', ''):>7} {r['ratio']:>7.3f}"
                f" {r['window_error_max']:>17.1%} {r['window_error_mean']:>6.1%}"
                f" {r['windows']:>8} {r['goodput']:>8.3f} {r['round_s']:>8.3f}"
                f" {r['round_over_window']:>13.1%} {r.get('turns', 0):>6}"
            )
    return "\n".join(out)


def node_costs() -> int:
    """``benchmarks/node_costs.py``'s ``main()``, when that file is there."""
    path = HERE / "node_costs.py"
    if not path.exists():
        print("\n(benchmarks/node_costs.py is not here: node costs not measured)")
        return 0
    spec = importlib.util.spec_from_file_location("node_costs", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(HERE))
    spec.loader.exec_module(mod)
    print("\nnode costs (benchmarks/node_costs.py)", flush=True)
    takes_args = bool(inspect.signature(mod.main).parameters)
    rc = mod.main([]) if takes_args else mod.main()
    return int(rc or 0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--full", action="store_true", help="real time throughout (long)")
    ap.add_argument("--only", default=",".join(PARTS), help="parts, comma-separated")
    ap.add_argument("--tqs", type=float, nargs="+", default=[1.0, 5.0, 30.0])
    ap.add_argument("--max-tq", type=float, default=5.0, help="runs above: time-scaled")
    ap.add_argument("--rounds", type=float, default=1.0, help="rounds measured per run")
    ap.add_argument("--seconds", type=float, default=15.0, help="measured per run, at least")
    ap.add_argument("--weights", type=float, nargs="+", default=[1.0, 3.0, 9.0])
    ap.add_argument("--weighted-tq", type=float, default=0.3)
    ap.add_argument(
        "--weighted-gib",
        type=float,
        default=50.0,
        help="each weighted job's memory, GiB (of 80: 50 swaps 20 GiB each way a switch)",
    )
    ap.add_argument(
        "--weighted-step",
        type=float,
        default=0.005,
        help="the weighted runs' work between safe points, seconds (not scaled)",
    )
    ap.add_argument(
        "--windows", type=float, default=1.5, help="weighted runs' length, in 60 s windows"
    )
    ap.add_argument(
        "--before",
        metavar="REV|DIR",
        help="the weighted part also runs its nodes from this version, side by side",
    )
    ap.add_argument("--no-node-costs", action="store_true")
    ap.add_argument("--json", metavar="FILE")
    a = ap.parse_args(argv)
    if a.full:
        a.max_tq, a.rounds, a.windows = float("inf"), max(a.rounds, 2.0), max(a.windows, 3.0)
    parts = [p for p in a.only.split(",") if p]
    if bad := set(parts) - set(PARTS):
        ap.error(f"unknown part {sorted(bad)}: choose from {', '.join(PARTS)}")
    if not 0 < a.weighted_gib <= GPU_GIB:
        ap.error(f"--weighted-gib {a.weighted_gib:g}: a job's memory must be in (0, {GPU_GIB}]")
    res: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="gs-sched-") as d, contextlib.ExitStack() as stack:
        tmp = Path(d)
        a.before_src = None
        if a.before:  # a folder with src/, or a revision checked out (as node_costs.py)
            from node_costs import tree

            a.before_src = stack.enter_context(tree(a.before, tmp))
        for name in parts:
            t0 = time.monotonic()
            res[name] = globals()[f"part_{name}"](tmp, a)
            print(f"({name}: {time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)
    print(report(res, a))
    if a.json:
        Path(a.json).write_text(json.dumps({"full": a.full, **res}, indent=2))
    return 0 if a.no_node_costs else node_costs()


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(json.loads(sys.argv[2]))
        sys.exit(0)
    sys.exit(main())

"""``gpushare demo``: a node on a simulated GPU, three workloads that oversubscribe it,
live progress, and a table per workload at the end."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gpushare.errors import DaemonUnavailableError, GpushareError
from gpushare.status import GpuStatus
from gpushare.tools.admin import AdminClient
from gpushare.tools.report import figures, read_events, switches
from gpushare.units import format_size

GPU_MEMORY = "80 GiB"
WORKLOADS = [  # name, kind, memory
    ("train-a", "batch", "30GiB"),
    ("train-b", "batch", "30GiB"),
    ("notebook", "interactive", "30GiB"),
]


def wait_for_socket(path: str, proc: subprocess.Popen[bytes], timeout: float = 15.0) -> None:
    """Until the node answers on its admin socket (or died, or took too long)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise GpushareError(f"the node exited with code {proc.returncode}")
        try:
            with AdminClient(path, timeout=1.0) as c:
                c.status()
            return
        except (DaemonUnavailableError, OSError):
            time.sleep(0.05)
    raise GpushareError(f"the node did not open {path} within {timeout:.0f} s")


def run_demo(seconds: float, tq: float, workdir: str | None, mode: str = "exclusive") -> int:
    started = time.monotonic()
    wd = Path(workdir or tempfile.mkdtemp(prefix="gpushare-demo-"))
    wd.mkdir(parents=True, exist_ok=True)
    wsock, asock, evlog = str(wd / "workloads.sock"), str(wd / "admin.sock"), wd / "events.jsonl"
    evlog.unlink(missing_ok=True)
    py = sys.executable
    print(
        f"gpushare demo: one SIMULATED GPU of {GPU_MEMORY} (no real GPU is used: each session's"
        " memory is real bytes, scaled 1/1024, copied and checksummed at a modelled 55 GB/s),"
    )
    print(
        f"three workloads of 30 GiB each (90 GiB > {GPU_MEMORY}), TQ {tq:g} s, for {seconds:g} s."
        f"  Files: {wd}"
    )
    if mode == "exclusive":
        print(
            f"Mode exclusive: one workload holds the GPU at a time, for a quantum of {tq:g} s,"
            " round-robin; before each turn the planner swaps out of the GPU what the next"
            " one needs (the one served longest ago first).\n"
        )
    else:
        print(
            "Mode auto: workloads whose memory fits on the GPU together hold it together"
            " (two of 30 GiB fit in 80 GiB); once those that want it do not fit, one at a"
            f" time, round-robin, {tq:g} s each, swapping as needed.\n"
        )
    with open(wd / "node.log", "wb") as node_log:
        node = subprocess.Popen(
            [
                py,
                "-m",
                "gpushare",
                "node",
                "--socket",
                wsock,
                "--admin-socket",
                asock,
                "--sim-gpus",
                "1",
                "--sim-memory",
                GPU_MEMORY,
                "--tq",
                str(tq),
                "--mode",
                mode,
                "--event-log",
                str(evlog),
                "--metrics-port",
                "0",
            ],
            stderr=node_log,
        )
    procs: list[tuple[str, subprocess.Popen[bytes]]] = []
    try:
        wait_for_socket(asock, node)
        for i, (name, kind, mem) in enumerate(WORKLOADS):
            procs.append(
                (
                    name,
                    subprocess.Popen(
                        [
                            py,
                            "-m",
                            "gpushare.tools.workloads",
                            kind,
                            "--socket",
                            wsock,
                            "--memory",
                            mem,
                            # ended by the demo at its one deadline (SIGTERM): each
                            # runs until then, whatever it is doing, and no longer
                            "--seconds",
                            repr(seconds + 600),
                            "--name",
                            name,
                            "--seed",
                            str(i + 1),
                        ],
                        stdout=subprocess.PIPE,
                    ),
                )
            )
        peak, ran = _progress(asock, procs, seconds)
        results = {}
        for name, pr in procs:
            out, _ = pr.communicate(timeout=60)
            lines = out.decode().strip().splitlines()
            if pr.returncode != 0 or not lines:
                print(f"workload {name} failed (exit {pr.returncode})", file=sys.stderr)
                return 1
            results[name] = json.loads(lines[-1])
    finally:
        for _, pr in procs:
            if pr.poll() is None:
                pr.kill()
        node.send_signal(signal.SIGTERM)
        try:
            node.wait(timeout=10)
        except subprocess.TimeoutExpired:
            node.kill()
    events = read_events(evlog)
    _table(results, events, peak, mode)
    _why_shares(results, events, tq, ran)
    print(f"\nevents: {evlog}   node log: {wd / 'node.log'}")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("timeline: not drawn (pip install 'gpushare[plot]' for matplotlib)")
    else:
        from gpushare.tools.timeline import plot

        png = wd / "timeline.png"
        title = f"gpushare demo on a SIMULATED GPU, mode {mode}: who held it when"
        plot(events, png, title=title, window_s=0)
        print(f"timeline: {png}")
    print(
        f"workloads ran {ran:.1f} s (asked: {seconds:g} s); the demo took"
        f" {time.monotonic() - started:.1f} s in all (node start, report and timeline included)"
    )
    return 0 if all(r["failures"] == 0 for r in results.values()) else 1


def _progress(
    asock: str, procs: list[tuple[str, subprocess.Popen[bytes]]], seconds: float
) -> tuple[int, float]:
    """Progress once a second from when every workload is attached (Python takes a few
    seconds to start on a loaded machine: that time is not the run's) until ``seconds``
    later; then every workload is ended (SIGTERM) where it is. The peak memory in use,
    and how long the workloads ran."""
    peak = 0
    t0: float | None = None
    last_print = -1.0
    with AdminClient(asock) as c:
        while any(p.poll() is None for _, p in procs):
            g = c.status().gpus[0]
            peak = max(peak, g.used_bytes)
            now = time.monotonic()
            if t0 is None:
                if len(g.sessions) >= len(procs):
                    t0, last_print = now, -1.0  # the clock starts: all are there
                elif now - last_print >= 1.0:
                    last_print = now
                    print(f"[   0/{seconds:.0f} s] the workloads are attaching", flush=True)
                time.sleep(0.1)
                continue
            t = now - t0
            if t >= seconds:
                return peak, _stop(procs, t0, seconds)
            if t - last_print >= 1.0:
                last_print = t
                _progress_line(g, t, seconds)
            time.sleep(0.1)
    return peak, (time.monotonic() - t0) if t0 is not None else 0.0


def _stop(procs: list[tuple[str, subprocess.Popen[bytes]]], t0: float, seconds: float) -> float:
    """Time is up: every workload still running ended (SIGTERM); how long they ran."""
    left = [name for name, p in procs if p.poll() is None]
    print(f"[{seconds:4.0f}/{seconds:.0f} s] time is up: {', '.join(left)} stopped")
    for _, p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    ran = time.monotonic() - t0
    for _, p in procs:
        p.wait(timeout=30)
    late = time.monotonic() - t0 - ran
    if late >= 0.5:
        print(f"(the workloads took {late:.1f} s more to close their sessions and exit)")
    return ran


def _progress_line(g: GpuStatus, t: float, seconds: float) -> None:
    by_id = {s.id: s for s in g.sessions}
    holder = ",".join(by_id[i].name for i in g.holders if i in by_id) or "-"
    parts = []
    for s in g.sessions:
        parts.append(
            f"{s.name} {s.lease_seconds_total:4.1f}s"
            f"{' (' + format_size(s.swapped_bytes) + ' out)' if s.swapped_bytes else ''}"
        )
    print(
        f"[{int(min(t, seconds)):4d}/{seconds:.0f} s] holder {holder:<9} GPU time: "
        + (", ".join(parts) or "- (the workloads are attaching)"),
        flush=True,
    )


def _table(
    results: dict[str, dict[str, Any]], events: list[dict[str, Any]], peak: int, mode: str
) -> None:
    fig = figures(events)
    by_name = {f.name: f for f in fig.sessions.values()}
    print(f"\nSummary over {fig.span_s:.1f} s on one SIMULATED GPU ({GPU_MEMORY}):")
    head = (
        f"{'workload':<10} {'kind':<12} {'GPU share':>9} {'bursts':>6} {'wait mean':>9}"
        f" {'wait max':>8} {'swaps out/in':>12} {'bytes out':>10} {'bytes in':>10} data"
    )
    print(head)
    print("-" * len(head))
    for name, r in results.items():
        f = by_name.get(name)
        if f is None:
            continue
        waits = f.waits[1:] or [0.0]  # the first grant is the initial allocation
        data = "intact" if r["failures"] == 0 else f"CORRUPT x{r['failures']}"
        print(
            f"{name:<10} {r['kind']:<12} {f.lease_s / fig.span_s:>8.1%} {r['bursts']:>6}"
            f" {sum(waits) / len(waits):>8.2f}s {max(waits):>7.2f}s"
            f" {f'{f.swap_outs}/{f.swap_ins}':>12} {format_size(f.swap_out_bytes):>10}"
            f" {format_size(f.swap_in_bytes):>10} {data} ({r['checks']} checks)"
        )
    print(f"peak GPU memory in use (sampled every 0.1 s): {format_size(peak)} of {GPU_MEMORY}")
    sw = switches(events)
    if sw.seconds:
        print(
            f"quanta ended with a swap: {len(sw.seconds)}, from the revoke to the next workload"
            f" swapped in: median {statistics.median(sw.seconds):.2f} s; {sw.overlapped} grants"
            " swapped in while the last holder still swapped out (overlapped switches)"
        )
    if mode == "auto":
        print(
            "GPU share: the part of the run each held a lease. In mode auto, sessions whose"
            " memory fits together hold leases together, so the shares can add up to more"
            " than 100%."
        )
    else:
        print(
            "GPU share: the part of the run each held the GPU, alone (mode exclusive: the"
            " shares add up to at most 100%; the rest is switches and idle time)."
        )


def _why_shares(
    results: dict[str, dict[str, Any]], events: list[dict[str, Any]], tq: float, ran: float
) -> None:
    """Why two identical batch jobs get different shares: whole turns, in a short run."""
    fig = figures(events)
    by_name = {f.name: f for f in fig.sessions.values()}
    same = [n for n, r in results.items() if r["kind"] == "batch" and n in by_name]
    if len(same) < 2 or not fig.span_s:
        return
    shares = [by_name[n].lease_s / fig.span_s for n in same]
    turns = [max(1, results[n]["grants"]) for n in same]
    mean = [by_name[n].lease_s / t for n, t in zip(same, turns, strict=True)]
    print(
        f"Why {' and '.join(same)}, the same job, got {' and '.join(f'{x:.1%}' for x in shares)}:"
        f" {' and '.join(map(str, turns))} turns, of {' and '.join(f'{m:.1f} s' for m in mean)}"
        f" on average. A quantum (TQ {tq:g} s, {tq / max(ran, tq):.0%} of this {ran:.0f} s"
        " run) ends early when the notebook takes its short turn (docs/scheduling.md), and"
        " whoever holds then loses it; in a short run a turn or two more or less shows."
        " Over a longer run they come closer (gpushare demo --seconds 120)."
    )


if __name__ == "__main__":
    sys.exit(run_demo(20.0, 2.0, os.environ.get("GPUSHARE_DEMO_DIR")))

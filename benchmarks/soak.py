"""Soak: 256 sessions on 4 simulated GPUs, 100,000 grants, random client kills and
restarts, and one node kill and restart. A benchmark, not a test.

Sessions run as threads, 16 to a client process (16 processes), each with its own
connection to the node: a killed process takes 16 sessions with it, and a new one
takes their place. Each session's simulated memory holds a pattern that is checked
after every grant that followed someone else's; every swap-in checks each chunk's CRC.
Reports grants per second, handoff latency (holder's release to the next waiting
session holding, from CLOCK_MONOTONIC in the clients), checksums verified, pattern
failures, and the node's open file descriptors and RSS at its start and end.

    python benchmarks/soak.py [--grants 100000] [--sessions 256] [--gpus 4] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gpushare
from gpushare.client.swap.sim import SimBackend
from gpushare.tools.admin import AdminClient
from gpushare.tools.demo import wait_for_socket
from handoffs import handoffs, percentile

PER_PROCESS = 16
SESSION_MEMORY = 3 * 2**30  # on 8 GiB GPUs: 16 sessions a GPU share room for 2
GPU_MEMORY = "8GiB"


# --- a client process: PER_PROCESS sessions, one thread each -------------------------


def client(sock: str, first: int, gpus: int, out: str, stop: str, go: str) -> None:
    lock = threading.Lock()
    rows: list[tuple[int, float, float, float]] = []
    totals = {"bursts": 0, "checks": 0, "failures": 0, "errors": 0, "checksums": 0}
    backends: list[SimBackend] = []

    def run(i: int) -> None:
        gpu = (first + i) % gpus
        try:
            s = gpushare.attach(
                SESSION_MEMORY,
                socket=sock,
                gpu=gpu,
                name=f"soak-{first + i}",
                reconnect_timeout=120,
            )
            assert isinstance(s.backend, SimBackend)
            with lock:
                backends.append(s.backend)
            with s.gpu():
                m = s.backend.allocate(SESSION_MEMORY)
                m.fill(first + i)
            seen = s.grants
            rng = random.Random(first + i)
            while not os.path.exists(go):
                time.sleep(0.01)
            while not os.path.exists(stop):
                t_ask = time.monotonic()
                with s.gpu():
                    t_grant = time.monotonic()
                    if s.grants != seen:
                        seen = s.grants
                        ok = m.verify(first + i)
                        with lock:
                            totals["checks"] += 1
                            totals["failures"] += not ok
                    t_rel = time.monotonic()
                with lock:
                    rows.append((gpu, t_ask, t_grant, t_rel))
                    totals["bursts"] += 1
                time.sleep(rng.uniform(0, 0.004))
            s.close()
        except Exception as e:
            with lock:
                totals["errors"] += 1
            print(f"soak session {first + i}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(PER_PROCESS)]
    for t in threads:
        t.start()
    last = 0

    def flush(final: bool) -> None:
        # Append as it goes, so a killed process keeps what it wrote; its totals so far
        # follow its rows (the last totals line of a file counts).
        nonlocal last
        with lock:
            new, last = rows[last:], len(rows)
            totals["checksums"] = sum(b.checksums_verified for b in backends)
            now = dict(totals)
        with open(out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in new)
            f.write(json.dumps({"totals": now, "final": final}) + "\n")

    while any(t.is_alive() for t in threads):
        time.sleep(1.0)
        flush(final=False)
    flush(final=True)


# --- the run -----------------------------------------------------------------------


def node_figures(pid: int) -> dict[str, int]:
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    rss = next(
        int(x.split()[1]) * 1024
        for x in Path(f"/proc/{pid}/status").read_text().splitlines()
        if x.startswith("VmRSS:")
    )
    return {"fds": fds, "rss_bytes": rss}


class Soak:
    def __init__(self, tmp: Path, sessions: int, gpus: int) -> None:
        self.tmp = tmp
        self.sock, self.admin = str(tmp / "w.sock"), str(tmp / "a.sock")
        self.stop, self.go = str(tmp / "stop"), str(tmp / "go")
        self.config = tmp / "node.toml"
        self.config.write_text("max_sessions_per_uid = 4096\n")  # one uid runs them all
        self.gpus = gpus
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.outs: list[str] = []
        self.nprocs = sessions // PER_PROCESS
        self.node: subprocess.Popen[bytes] | None = None
        self.grants_before_restart = 0

    def start_node(self) -> dict[str, int]:
        self.node = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gpushare",
                "node",
                "--config",
                str(self.config),
                "--socket",
                self.sock,
                "--admin-socket",
                self.admin,
                "--sim-gpus",
                str(self.gpus),
                "--sim-memory",
                GPU_MEMORY,
                "--mode",
                "exclusive",
                "--tq",
                "0.05",
                "--sim-bandwidth",
                "2e12",
                "--metrics-port",
                "0",
                "--log-level",
                "warning",
            ]
        )
        wait_for_socket(self.admin, self.node)
        return node_figures(self.node.pid)

    def start_client(self, slot: int) -> None:
        out = str(self.tmp / f"client-{slot}-{len(self.outs)}.jsonl")
        self.outs.append(out)
        self.procs[slot] = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--client",
                self.sock,
                str(slot * PER_PROCESS),
                str(self.gpus),
                out,
                self.stop,
                self.go,
            ]
        )

    def grants(self) -> int:
        with AdminClient(self.admin) as c:
            return sum(g.grants_total for g in c.status().gpus)

    def sessions(self) -> int:
        with AdminClient(self.admin) as c:
            return sum(len(g.sessions) for g in c.status().gpus)

    @property
    def node_pid(self) -> int:
        assert self.node is not None
        return self.node.pid

    def wait_attached(self, sessions: int) -> None:
        """Every session attached (two minutes at most), then two seconds more: each
        allocates and fills its memory in a first burst."""
        t_wait = time.monotonic()
        while self.sessions() < sessions and time.monotonic() - t_wait < 120:
            time.sleep(0.2)
        time.sleep(2.0)

    def restart_node(self, done: int) -> tuple[dict[str, int], dict[str, int]]:
        """The node killed and started again (the clients reconnect at once): its figures
        before the kill and at the new start."""
        assert self.node is not None
        before = node_figures(self.node.pid)
        self.grants_before_restart = done  # the new node counts from zero
        self.node.send_signal(signal.SIGKILL)
        self.node.wait()
        return before, self.start_node()

    def kill_a_client(self, rng: random.Random) -> None:
        """A client process killed, with its sessions, and a new one in its place."""
        slot = rng.randrange(self.nprocs)
        self.procs[slot].send_signal(signal.SIGKILL)
        self.procs[slot].wait()
        self.start_client(slot)

    def stop_all(self) -> None:
        """The clients told to stop (killed after a minute), then the node."""
        Path(self.stop).touch()
        for pr in self.procs.values():
            try:
                pr.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pr.kill()
        assert self.node is not None
        self.node.terminate()
        self.node.wait(timeout=20)


@dataclass
class Progress:
    """The soak so far: grants counted from the start line, client kills, the restart."""

    done: int = 0
    kills: int = 0
    restarted: bool = False
    restart: dict[str, dict[str, int]] = field(default_factory=dict)

    def line(self, seconds: float) -> str:
        return (
            f"\r{seconds:6.1f} s  {self.done:>7} grants  {self.kills} client kills"
            f"{'  node restarted' if self.restarted else ''}"
        )


def soak_until_done(soak: Soak, a: argparse.Namespace, rng: random.Random, t0: float) -> Progress:
    """Grants from ``t0`` until ``--grants`` (or ``--max-seconds``): a client killed every
    ``--kill-every`` seconds, the node killed and restarted once, halfway."""
    p = Progress()
    next_kill = t0 + a.kill_every
    while time.monotonic() - t0 < a.max_seconds:
        time.sleep(0.5)
        try:
            p.done = soak.grants_before_restart + soak.grants()
        except Exception:
            continue
        print(p.line(time.monotonic() - t0), end="", flush=True)
        if p.done >= a.grants:
            break
        if not p.restarted and p.done >= a.grants // 2:
            p.restart["before_kill"], p.restart["start"] = soak.restart_node(p.done)
            p.restarted = True
        if time.monotonic() >= next_kill:
            soak.kill_a_client(rng)
            p.kills += 1
            next_kill = time.monotonic() + a.kill_every
    return p


def read_clients(outs: list[str]) -> tuple[list[list[float]], dict[str, int]]:
    """Every client file's rows (gpu, asked, granted, released) and the sum of each
    file's last totals; a line torn by a kill is left out."""
    rows: list[list[float]] = []
    totals = {"bursts": 0, "checks": 0, "failures": 0, "errors": 0, "checksums": 0}
    for o in outs:
        if not os.path.exists(o):
            continue
        last_totals: dict[str, int] = {}
        for line in Path(o).read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # torn by a kill
            if isinstance(rec, dict):
                last_totals = rec["totals"]
            else:
                rows.append(rec)
        for k, v in last_totals.items():
            totals[k] += v
    return rows, totals


def print_report(result: dict[str, Any], totals: dict[str, int]) -> None:
    done, elapsed = result["grants"], result["seconds"]
    print()
    print(
        f"{done} grants in {elapsed:.1f} s: {done / elapsed:.0f} grants/s over {result['gpus']}"
        f" simulated GPUs, {result['sessions']} sessions, {result['client_kills']} client"
        f" kills, node restarted: {result['node_restarted']}"
    )
    print(
        f"handoff p50 {result['handoff_p50_ms']:.2f} ms, p99 {result['handoff_p99_ms']:.2f} ms"
        f" ({result['handoffs_measured']} measured)"
    )
    print(
        f"pattern checks {totals['checks']} (failures {totals['failures']}), swap-in chunk"
        f" checksums verified {totals['checksums']}, session"
        f" errors {totals['errors']}"
    )
    print(
        f"node fds and RSS: first {json.dumps(result['node_first'])}; after the restart"
        f" {json.dumps(result['node_after_restart'])}"
    )
    print(json.dumps(result))


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        c = sys.argv[2:]
        client(c[0], int(c[1]), int(c[2]), c[3], c[4], c[5])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--grants", type=int, default=100_000)
    ap.add_argument("--sessions", type=int, default=256)
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--kill-every", type=float, default=3.0, help="seconds between client kills")
    ap.add_argument("--max-seconds", type=float, default=900)
    ap.add_argument("--json", metavar="FILE")
    a = ap.parse_args()
    rng = random.Random(7)
    with tempfile.TemporaryDirectory(prefix="gs-soak-") as d:
        soak = Soak(Path(d), a.sessions, a.gpus)
        first_start = soak.start_node()
        for slot in range(soak.nprocs):
            soak.start_client(slot)
        soak.wait_attached(a.sessions)
        first_attached = node_figures(soak.node_pid)
        soak.grants_before_restart = -soak.grants()  # count from the start line
        Path(soak.go).touch()
        t0 = time.monotonic()
        p = soak_until_done(soak, a, rng, t0)
        elapsed = time.monotonic() - t0
        end_figures = node_figures(soak.node_pid)
        soak.stop_all()
        rows, totals = read_clients(soak.outs)
        hs = [
            h
            for g in range(a.gpus)
            for h in handoffs([(r[1], r[2], r[3]) for r in rows if r[0] == g])
        ]
    result: dict[str, Any] = {
        "grants": p.done,
        "seconds": elapsed,
        "grants_per_s": p.done / elapsed,
        "sessions": a.sessions,
        "gpus": a.gpus,
        "client_kills": p.kills,
        "node_restarted": p.restarted,
        "handoffs_measured": len(hs),
        "handoff_p50_ms": percentile(hs, 0.5) * 1e3,
        "handoff_p99_ms": percentile(hs, 0.99) * 1e3,
        "pattern_checks": totals["checks"],
        "pattern_failures": totals["failures"],
        "swap_checksums_verified": totals["checksums"],
        "session_errors": totals["errors"],
        "node_first": {
            "start": first_start,
            "all_attached": first_attached,
            "before_kill": p.restart.get("before_kill"),
        },
        "node_after_restart": {"start": p.restart.get("start"), "end": end_figures},
    }
    print_report(result, totals)
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2))
    return 0 if totals["failures"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

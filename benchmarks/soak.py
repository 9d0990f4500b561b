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


def main() -> int:  # noqa: C901
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        a = sys.argv[2:]
        client(a[0], int(a[1]), int(a[2]), a[3], a[4], a[5])
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
        t_wait = time.monotonic()
        while soak.sessions() < a.sessions and time.monotonic() - t_wait < 120:
            time.sleep(0.2)
        time.sleep(2.0)  # each session allocates and fills its memory in a first burst
        first_attached = node_figures(soak.node.pid)  # type: ignore[union-attr]
        soak.grants_before_restart = -soak.grants()  # count from the start line
        Path(soak.go).touch()
        t0 = time.monotonic()
        kills = 0
        restarted = False
        restart = {}
        next_kill = t0 + a.kill_every
        done = 0
        while time.monotonic() - t0 < a.max_seconds:
            time.sleep(0.5)
            try:
                done = soak.grants_before_restart + soak.grants()
            except Exception:
                continue
            print(
                f"\r{time.monotonic() - t0:6.1f} s  {done:>7} grants  {kills} client kills"
                f"{'  node restarted' if restarted else ''}",
                end="",
                flush=True,
            )
            if done >= a.grants:
                break
            if not restarted and done >= a.grants // 2:
                restart["before_kill"] = node_figures(soak.node.pid)  # type: ignore[union-attr]
                soak.grants_before_restart = done  # the new node counts from zero
                soak.node.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
                soak.node.wait()  # type: ignore[union-attr]
                restart["start"] = soak.start_node()  # the clients reconnect at once
                restarted = True
            if time.monotonic() >= next_kill:
                slot = rng.randrange(soak.nprocs)
                soak.procs[slot].send_signal(signal.SIGKILL)
                soak.procs[slot].wait()
                soak.start_client(slot)
                kills += 1
                next_kill = time.monotonic() + a.kill_every
        elapsed = time.monotonic() - t0
        end_figures = node_figures(soak.node.pid)  # type: ignore[union-attr]
        Path(soak.stop).touch()
        for pr in soak.procs.values():
            try:
                pr.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pr.kill()
        soak.node.terminate()  # type: ignore[union-attr]
        soak.node.wait(timeout=20)  # type: ignore[union-attr]
        rows: list[list[float]] = []
        totals = {"bursts": 0, "checks": 0, "failures": 0, "errors": 0, "checksums": 0}
        for o in soak.outs:
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
        hs = [
            h
            for g in range(a.gpus)
            for h in handoffs([(r[1], r[2], r[3]) for r in rows if r[0] == g])
        ]
    result: dict[str, Any] = {
        "grants": done,
        "seconds": elapsed,
        "grants_per_s": done / elapsed,
        "sessions": a.sessions,
        "gpus": a.gpus,
        "client_kills": kills,
        "node_restarted": restarted,
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
            "before_kill": restart.get("before_kill"),
        },
        "node_after_restart": {"start": restart.get("start"), "end": end_figures},
    }
    print()
    print(
        f"{done} grants in {elapsed:.1f} s: {done / elapsed:.0f} grants/s over {a.gpus}"
        f" simulated GPUs, {a.sessions} sessions, {kills} client kills, node restarted:"
        f" {restarted}"
    )
    print(
        f"handoff p50 {result['handoff_p50_ms']:.2f} ms, p99 {result['handoff_p99_ms']:.2f} ms"
        f" ({len(hs)} measured)"
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
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2))
    return 0 if totals["failures"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

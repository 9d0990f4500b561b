"""An inference server beside a training job on one simulated GPU (issue 28,
docs/scheduling.md 3). A benchmark, not a test.

Real processes over the real socket: a node on a simulated GPU of 80 GiB in mode
exclusive; an HTTP server (the standard library's ``ThreadingHTTPServer``) whose one
engine thread answers requests, each 0.17 s of GPU work in 5 ms steps with a safe point
after each, holding the lease while requests are queued (``with s.gpu():`` around the
queue, as a batching engine's loop: its bursts explicit; ``--hold S`` keeps the lease S
seconds more after the queue empties, GPU time the trainer pays, as the node cannot take
back a lease between safe points); a training job working in one long burst in steps
of 50 ms. Their memory does not fit together (server 20 GiB, trainer 64 GiB on 80): each
switch moves 4 GiB each way over the modelled link (55 GB/s). The load is Poisson
requests (0.5, 2 and 8 a second) from this process, one thread each, the same arrivals
for every run at a rate.

Each rate runs at each TQ (30 and 5 s), and once bare: the same server and trainer side
by side without a node (a simulated GPU's work is a sleep, so bare they do not slow each
other: the bare figures are each one's own). Printed: a request's latency p50/p99 beside
training and bare, the trainer's steps per second against bare, the turns the server
took, and the bytes moved to host memory (swap-outs, both sessions) per request; beside
the trainer's rate, the *bound* its rate can reach beside the turns the server took: bare
x (1 - (the server's GPU time + the link's time) / the run), the server's GPU time its
leases less their swap-ins, the link's time the bytes both sessions swapped each way at
the modelled rate (both ways at once: ``simlink.DUPLEX`` of it), all from the node's
event log over the measured window; then the
target's case once more with ``--discard`` GiB of the server's memory a discardable cache
(dropped rather than swapped, made again empty: docs/client.md). ``--implicit``: the
server's bursts are implicit, as under ``gpushare run`` (checkpoints outside ``gpu()``),
ended by the client after the grant's idle release (short for a session the node takes
for a server: docs/scheduling.md 3) instead of ``--hold``. The must-show (issue 40) is
``--quick --rates 0.5 2 --tqs 30 5``, with and without ``--implicit``.

    python benchmarks/inference.py [--quick] [--seconds S] [--rates 0.5 2 8]
                                   [--tqs 30 5] [--json out.json] [--events DIR]

``--events DIR``: each node run's event log kept there, with the server's turn figures
as the node's status showed them every 20 ms (its credit, rate, usual burst, measured
use: ``*.status.jsonl``) and the measured window (``*.t0``, Unix seconds).

``--quick``: 10 s per run (20 s at 0.5 requests a second: ten requests at least, on
average) at TQ 30 only: about two minutes with the starts and the drains. The last line
is the target's: 0.5 requests a second at TQ 30.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import random
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import gpushare
from gpushare.simlink import DUPLEX
from gpushare.tools.demo import wait_for_socket
from handoff import start_node

GIB = 2**30
STEP_S = 0.005  # work between two safe points
SERVICE_S = 0.17  # a request's GPU time (issue 28: a small model's greedy generation)
TRAIN_STEP_S = 0.05  # deploy/examples/train.py's default step
LINK = 55e9  # the simulated GPU's modelled link, each way (docs/simulated-gpu.md)
SERVER_MEMORY = 20 * GIB
TRAINER_MEMORY = 64 * GIB
KEEP = ""  # --events DIR: each run's node event log copied there


def work(s: Any, seconds: float) -> None:
    for _ in range(max(1, round(seconds / STEP_S))):
        time.sleep(STEP_S)
        if s is not None:
            s.checkpoint()


def attach(spec: dict[str, Any], memory: int, discard: int = 0) -> tuple[Any, Any]:
    """A session with its memory made (None, None bare); ``discard`` bytes of it a
    discardable cache (a KV cache: dropped rather than swapped, made again empty)."""
    if not spec["socket"]:
        return None, None
    s = gpushare.attach(memory, socket=spec["socket"], name=spec["name"])
    backend: Any = s.backend  # the sim backend's memory
    with s.gpu():
        mem = backend.allocate(memory - discard)
        mem.fill(1)
        if discard:
            backend.allocate(discard, discardable=True)
    return s, mem


# --- the server ---------------------------------------------------------------------------


def server(spec: dict[str, Any]) -> None:
    s, _ = attach(spec, SERVER_MEMORY, spec.get("discard", 0))
    hold = spec["hold"]
    asks: queue.Queue[threading.Event] = queue.Queue()

    def implicit() -> None:
        # gpushare run's way: no gpu() block; the first checkpoint opens a burst, which
        # the client ends after the grant's idle release (a server's is short)
        while True:
            done = asks.get()
            work(s, SERVICE_S)
            done.set()

    def engine() -> None:
        if hold < 0 and s is not None:
            implicit()
        keep = max(hold, 0.0)  # bare, implicit bursts are a queue drained as it comes
        while True:
            done = asks.get()
            with s.gpu() if s is not None else contextlib.nullcontext():
                while True:  # the lease held while requests are queued
                    work(s, SERVICE_S)
                    done.set()
                    try:  # the lease kept `hold` s for another (an implicit burst's end)
                        done = asks.get(timeout=keep) if keep else asks.get_nowait()
                    except queue.Empty:
                        break

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            done = threading.Event()
            asks.put(done)
            done.wait()
            body = b"ok\n"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    threading.Thread(target=engine, daemon=True).start()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    Path(spec["out"] + ".tmp").write_text(str(httpd.server_address[1]))
    os.replace(spec["out"] + ".tmp", spec["out"])
    httpd.serve_forever()


# --- the trainer --------------------------------------------------------------------------


def trainer(spec: dict[str, Any]) -> None:
    s, mem = attach(spec, TRAINER_MEMORY)
    Path(spec["out"] + ".ready").touch()
    while not os.path.exists(spec["go"]):
        time.sleep(0.002)
    end = time.monotonic() + spec["seconds"]
    steps: list[float] = []
    with s.gpu() if s is not None else contextlib.nullcontext():
        while time.monotonic() < end:
            work(s, TRAIN_STEP_S)
            steps.append(time.monotonic())
    if s is not None:
        with s.gpu():
            if not mem.verify(1):
                raise SystemExit("the trainer's memory pattern was lost in a swap")
        s.close()
    Path(spec["out"]).write_text(json.dumps(steps))


# --- a run ----------------------------------------------------------------------------------


def arrivals(rate: float, seconds: float, seed: int) -> list[float]:
    rng, t, out = random.Random(seed), 0.0, list[float]()
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            return out
        out.append(t)


def load(port: int, times: list[float], t0: float) -> list[float]:
    """Requests at ``t0 + times``, each on its own thread; their latencies."""
    lat: list[float] = [float("nan")] * len(times)

    def one(i: int) -> None:
        start = time.monotonic()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=300) as r:
            r.read()
        lat[i] = time.monotonic() - start

    threads = []
    for i, t in enumerate(times):
        time.sleep(max(0.0, t0 + t - time.monotonic()))
        th = threading.Thread(target=one, args=(i,), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join(timeout=300)
    return lat


def start(
    procs: list[subprocess.Popen[bytes]], role: str, spec: dict[str, Any], ready: str
) -> None:
    """Start the ``role`` process and wait until it has made its memory (``ready``)."""
    procs.append(subprocess.Popen([sys.executable, __file__, f"--{role}", json.dumps(spec)]))
    deadline = time.monotonic() + 60
    while not os.path.exists(ready):
        if procs[-1].poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the benchmark's {role} failed to start")
        time.sleep(0.01)


def run(
    tmp: Path, rate: float, tq: float | None, seconds: float, hold: float, discard: int = 0
) -> dict[str, Any]:
    """One server and one trainer, beside each other under a node at ``tq`` (None: bare)."""
    d = Path(tempfile.mkdtemp(dir=tmp))
    sock, admin, go = str(d / "w.sock"), str(d / "a.sock"), str(d / "go")
    node = None
    procs: list[subprocess.Popen[bytes]] = []
    warm = 1.0
    try:
        if tq is not None:
            events = str(d / "events.jsonl")
            node = start_node(
                sock, admin, "--mode", "exclusive", "--tq", str(tq), "--event-log", events
            )
            wait_for_socket(admin, node)
        on = sock if tq is not None else ""
        port_file, train_out = str(d / "port"), str(d / "train.json")
        # the server first: its memory made in its first burst, alone
        srv = {"socket": on, "name": "server", "out": port_file, "hold": hold, "discard": discard}
        start(procs, "server", srv, port_file)
        port = int(Path(port_file).read_text())
        spec = {
            "socket": on,
            "name": "trainer",
            "out": train_out,
            "go": go,
            "seconds": warm + seconds,
        }
        start(procs, "trainer", spec, train_out + ".ready")
        t_go = time.monotonic()
        Path(go).touch()
        stop = threading.Event()
        rows: list[dict[str, Any]] = []
        if KEEP and tq is not None:  # the server's turn figures as the node sees them
            threading.Thread(target=watch, args=(admin, stop, rows), daemon=True).start()
        lat = load(port, arrivals(rate, seconds, seed=int(rate * 1000)), t_go + warm)
        stop.set()
        if procs[1].wait(timeout=warm + seconds + 300) != 0:
            raise SystemExit(f"the benchmark's trainer failed with {procs[1].returncode}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        if node is not None:
            node.terminate()
            node.wait(timeout=10)
    t0, t1 = t_go + warm, t_go + warm + seconds
    steps = json.loads(Path(train_out).read_text())
    out: dict[str, Any] = {
        "rate": rate,
        "tq": tq,
        "requests": len(lat),
        "p50": pct(lat, 0.5),
        "p99": pct(lat, 0.99),
        "train_steps_per_s": sum(1 for x in steps if t0 <= x <= t1) / seconds,
    }
    if tq is not None:
        out.update(from_events(d / "events.jsonl", t0, t1, len(lat)))
        if KEEP:  # the node's event log, and when the measured window began (Unix time)
            tag = f"r{rate:g}-tq{tq:g}-d{discard // GIB}"
            Path(KEEP, tag + ".jsonl").write_text((d / "events.jsonl").read_text())
            wall = time.time() - time.monotonic()
            Path(KEEP, tag + ".t0").write_text(f"{t0 + wall} {t1 + wall}\n")
            lines = "".join(json.dumps(r) + "\n" for r in rows)
            Path(KEEP, tag + ".status.jsonl").write_text(lines)
    return out


def watch(admin: str, stop: threading.Event, rows: list[dict[str, Any]]) -> None:
    """Every 20 ms, the server's status row's turn figures (and the Unix time)."""
    from gpushare.tools.admin import AdminClient

    keys = ("state", "turns_total", "turn_credit_seconds", "turn_credit_rate")
    keys += ("usual_burst_seconds", "measured_use_ratio", "bursts_total")
    with AdminClient(admin) as c:
        last: dict[str, Any] = {}
        while not stop.wait(0.02):
            for s in c.status().gpus[0].sessions:
                if s.name == "server":
                    row = {k: getattr(s, k) for k in keys}
                    if row != last:
                        rows.append({"ts": time.time(), **row})
                        last = row


def from_events(path: Path, t0: float, t1: float, requests: int) -> dict[str, Any]:
    """The server's turns and the bytes swapped out, from ``t0`` (the drain included);
    the server's GPU time and the link's time within [``t0``, ``t1``], the trainer's loss
    they account for (the bound's)."""
    events = [json.loads(x) for x in path.read_text().splitlines()]
    names = {e["session"]: e["name"] for e in events if e["event"] == "attach"}
    wall = time.time() - time.monotonic()  # events carry Unix time
    for e in events:
        e["at"] = e["ts"] - wall
    bound = trainer_loss(events, names, t0, t1)
    within = [e for e in events if t0 <= e["at"]]
    grants = [e for e in within if e["event"] == "grant" and names[e["session"]] == "server"]
    moved = sum(e.get("bytes", 0) for e in within if e["event"] == "swap_out")
    dropped = sum(e.get("discarded_bytes", 0) for e in within if e["event"] == "swap_out")
    return {
        "mib_dropped_per_request": dropped / 2**20 / max(1, requests),
        "turns": sum(1 for e in grants if e.get("turn")),
        "server_grants": len(grants),
        "mib_to_host_per_request": moved / 2**20 / max(1, requests),
        **bound,
    }


def trainer_loss(
    events: list[dict[str, Any]], names: dict[int, str], t0: float, t1: float
) -> dict[str, float]:
    """What the trainer must lose over [t0, t1] beside the turns the server took: the
    server's GPU time and the link's time, and their fraction of the window."""
    server = [e for e in events if names.get(e.get("session", 0)) == "server"]
    swaps = [e for e in events if t0 <= e["at"] <= t1 and e["event"] in ("swap_in", "swap_out")]
    gpu_s, link_s = server_gpu_time(server, t0, t1), link_time(swaps)
    return {"server_gpu_s": gpu_s, "link_s": link_s, "lost_bound": (gpu_s + link_s) / (t1 - t0)}


def server_gpu_time(events: list[dict[str, Any]], t0: float, t1: float) -> float:
    """Seconds the server's leases (its grant to its release) lay within [t0, t1], less
    its swap-ins there (the link's time)."""
    total, since = 0.0, None
    total -= sum(e["seconds"] for e in events if e["event"] == "swap_in" and t0 <= e["at"] <= t1)
    for e in events:
        if e["event"] == "grant":
            since = e["at"]
        elif e["event"] == "release" and since is not None:
            total += max(0.0, min(e["at"], t1) - max(since, t0))
            since = None
    total += max(0.0, t1 - max(since, t0)) if since is not None else 0.0
    return max(0.0, total)


def link_time(swaps: list[dict[str, Any]]) -> float:
    """The least time the modelled link takes for these swaps' bytes: each way on its
    own lane, both at once (at ``DUPLEX`` of the rate) where both ways carry bytes."""
    out_b = sum(e["bytes"] for e in swaps if e["event"] == "swap_out")
    in_b = sum(e["bytes"] for e in swaps if e["event"] == "swap_in")
    return max(out_b, in_b) / (LINK * (DUPLEX if out_b and in_b else 1.0))


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0]
        + " Beside the trainer's rate it prints the bound the server's turns allow: bare x"
        " (1 - (the server's GPU time + the link's time) / the run), from the node's"
        " event log (docs/benchmarks.md)."
    )
    ap.add_argument("--quick", action="store_true", help="10 s runs, TQ 30 only")
    ap.add_argument(
        "--seconds",
        type=float,
        default=None,
        help="measured seconds per run (default 60, 10 with --quick; at least 10 / rate)",
    )
    ap.add_argument(
        "--rates",
        type=float,
        nargs="+",
        default=[0.5, 2.0, 8.0],
        help="the server's requests per second, a run each (default 0.5 2 8)",
    )
    ap.add_argument(
        "--tqs",
        type=float,
        nargs="+",
        default=None,
        help="the node's time quanta in seconds, a run each per rate (default 30 5; 30 with"
        " --quick)",
    )
    ap.add_argument(
        "--hold",
        type=float,
        default=0.0,
        help="seconds the server keeps the lease after its queue empties (default 0:"
        " `with s.gpu()` around the queue only; more is GPU time held idle, which the"
        " trainer pays: no node can take a lease back between safe points)",
    )
    ap.add_argument(
        "--implicit",
        action="store_true",
        help="the server's bursts implicit (checkpoints outside gpu(), as under `gpushare"
        " run`): ended by the client after the grant's idle release (--hold is ignored)",
    )
    ap.add_argument(
        "--discard",
        type=float,
        default=8.0,
        help="GiB of the server's 20 that are a discardable cache (dropped rather than"
        " swapped), in one more run of the first rate and TQ (default 8; 0: no such run)",
    )
    ap.add_argument("--json", default="", help="write the figures here too")
    ap.add_argument("--events", default="", help="copy each run's node event log into this folder")
    a = ap.parse_args()
    global KEEP
    if a.events:
        Path(a.events).mkdir(parents=True, exist_ok=True)
        KEEP = a.events
    seconds = a.seconds or (10.0 if a.quick else 60.0)
    if a.implicit:
        a.hold = -1.0  # (the server's engine: implicit bursts)
    tqs = a.tqs or ([30.0] if a.quick else [30.0, 5.0])
    load0 = os.getloadavg()
    print(
        f"inference beside training: server {SERVER_MEMORY // GIB} GiB, trainer"
        f" {TRAINER_MEMORY // GIB} GiB on a simulated 80 GiB GPU, mode exclusive;"
        f" requests of {SERVICE_S} s, "
        + (
            "implicit bursts (ended by the client after the grant's idle release);"
            if a.implicit
            else f"the lease kept {a.hold:g} s after the last;"
        )
        + f" {seconds:g} s per run (at least 10 / rate);"
        f" load average {load0[0]:.2f}",
        flush=True,
    )
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for rate in a.rates:
            secs = max(seconds, 10 / rate)  # ten requests at least, on average
            bare = run(Path(tmp), rate, None, secs, a.hold)
            rows.append(bare)
            for tq in tqs:
                r = run(Path(tmp), rate, tq, secs, a.hold)
                r["p99_over_bare"] = r["p99"] / bare["p99"]
                r["p99_minus_bare"] = r["p99"] - bare["p99"]
                r["train_vs_bare"] = r["train_steps_per_s"] / bare["train_steps_per_s"]
                r["train_bound"] = max(0.0, 1.0 - r["lost_bound"])
                r["train_vs_bound"] = r["train_vs_bare"] / max(1e-9, r["train_bound"])
                rows.append(r)
                print(
                    f"  {rate:g} req/s, TQ {tq:g}: p50 {r['p50']:.2f} s p99 {r['p99']:.2f} s"
                    f" (bare {bare['p50']:.2f} / {bare['p99']:.2f}); trainer"
                    f" {r['train_steps_per_s']:.1f} steps/s = {r['train_vs_bare']:.2f} of bare"
                    f" {bare['train_steps_per_s']:.1f}, bound {r['train_bound']:.2f}"
                    f" (server {r['server_gpu_s']:.1f} s + link {r['link_s']:.1f} s):"
                    f" {r['train_vs_bound']:.2f} of it; {r['requests']} requests,"
                    f" {r['turns']} turns; {r['mib_to_host_per_request']:.0f} MiB to host"
                    " per request",
                    flush=True,
                )
    target = next((r for r in rows if r["rate"] == a.rates[0] and r["tq"] == tqs[0]), rows[-1])
    with_discard = "n/a"
    if a.discard > 0:  # the target's case again, the server's cache discardable
        with tempfile.TemporaryDirectory() as tmp:
            secs = max(seconds, 10 / a.rates[0])
            d = run(Path(tmp), a.rates[0], tqs[0], secs, a.hold, int(a.discard * GIB))
        bare = next(r for r in rows if r["rate"] == a.rates[0] and r["tq"] is None)
        d["discard_gib"] = a.discard
        d["train_vs_bare"] = d["train_steps_per_s"] / bare["train_steps_per_s"]
        rows.append(d)
        with_discard = f"{d['mib_to_host_per_request']:.0f}"
        print(
            f"  with {a.discard:g} GiB discardable: p50 {d['p50']:.2f} s p99 {d['p99']:.2f} s;"
            f" trainer {d['train_vs_bare']:.2f} of bare; {d['turns']} turns;"
            f" {d['mib_to_host_per_request']:.0f} MiB to host and"
            f" {d['mib_dropped_per_request']:.0f} MiB dropped per request",
            flush=True,
        )
    load1 = os.getloadavg()
    print(f"load average {load0[0]:.2f} before, {load1[0]:.2f} after (1 min)")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    print(
        f"p99 beside training / alone: {target['p99_over_bare']:.2f}; bytes to host per"
        f" request: with discard {with_discard} MiB, without"
        f" {target['mib_to_host_per_request']:.0f} MiB"
    )


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--server":
        server(json.loads(sys.argv[2]))
    elif len(sys.argv) == 3 and sys.argv[1] == "--trainer":
        trainer(json.loads(sys.argv[2]))
    else:
        main()

"""vLLM's OpenAI server gated by ``gpushare run`` beside a rival that holds the GPU, on a
simulated GPU (issue 28: the model ran ungated in vLLM's ``EngineCore``/``Worker``
processes). A check with real vLLM, not a test: vLLM is not among the test
dependencies (a venv of 3.4 GB; docs/run.md "vLLM" says how to make one).

A node on a simulated 16 GiB GPU in mode exclusive, TQ 5 s. The server runs twice, bare
and under ``gpushare run --memory 8GiB``; each time, once it answers, a rival session
holds the GPU for ``--hold`` seconds and, a second into it, one completion request is
sent while ``/health`` is polled. Printed per run: the request's latency, the slowest
``/health`` answer meanwhile, and (gated) the sessions the node shows: the server's own
process and the vLLM process that joined it, in one gang. Gated, the request waits for
the rival's lease (about ``--hold`` - 1 s); bare, it is answered at once, ungated.

With ``--rival trainer`` the rival is a training loop instead (TQ 10 s): one burst of
50 ms steps with a safe point every 5 ms for the whole measurement, while ``--requests``
completion requests are sent one at a time, ``--gap`` seconds apart. Printed per run:
each request's latency, p50 and max, and (gated) the vLLM sessions' interactive turns
and grants. Gated, a request should take a turn at the trainer's next safe point
(docs/scheduling.md "3. Interactive turns"), not wait out its 10 s quantum.

    python benchmarks/vllm_gated.py --python /work/vllm/venv/bin/python --model DIR
    python benchmarks/vllm_gated.py --python ... --model DIR --rival trainer --keep DIR
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import gpushare
from gpushare.status import SessionStatus
from gpushare.tools.admin import AdminClient


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str, body: dict[str, Any] | None = None, timeout: float = 120) -> float:
    """Seconds one request took (raises if it failed)."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as r:
        r.read()
    return time.perf_counter() - t0


def serve(args: argparse.Namespace, d: Path, port: int, gated: bool) -> subprocess.Popen[bytes]:
    cmd = [args.python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model]
    cmd += ["--served-model-name", "tiny", "--dtype", "float32", "--enforce-eager"]
    cmd += ["--max-model-len", "256", "--host", "127.0.0.1", "--port", str(port)]
    if gated:
        cmd = [sys.executable, "-m", "gpushare", "run", "--socket", str(d / "w.sock"),
               "--memory", "8GiB", "--name", "vllm", "--", *cmd]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env |= {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    log = open(d / f"vllm-{'gated' if gated else 'bare'}.log", "wb")  # noqa: SIM115
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def one_run(args: argparse.Namespace, d: Path, gated: bool) -> dict[str, Any]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = serve(args, d, port, gated)
    t0 = time.monotonic()
    try:
        while True:
            if server.poll() is not None:
                raise SystemExit(f"the server exited ({server.returncode}): see {d}")
            try:
                get(base + "/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
        started = time.monotonic() - t0
        print(f"  server up in {started:.0f} s", flush=True)
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 8}
        for _ in range(3):
            get(base + "/v1/completions", body)  # warm (the first joins, gated)
        measure = beside_trainer if args.rival == "trainer" else beside_holder
        return {"gated": gated, "start_s": round(started, 1), **measure(args, d, base, body)}
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


def vllm_rows(d: Path, keys: tuple[str, ...]) -> list[dict[str, Any]]:
    """The node's rows for the sessions that are not the rival's (gated: vLLM's)."""
    with AdminClient(str(d / "a.sock")) as c:
        sessions: list[SessionStatus] = c.status().gpus[0].sessions
    return [{k: getattr(s, k) for k in keys} for s in sessions if s.name != "rival"]


def beside_holder(
    args: argparse.Namespace, d: Path, base: str, body: dict[str, Any]
) -> dict[str, Any]:
    """One request while a rival holds the GPU ``--hold`` s, ``/health`` polled meanwhile."""
    rival = gpushare.attach("4GiB", socket=str(d / "w.sock"), name="rival")
    health: list[float] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            try:
                health.append(get(base + "/health", timeout=5))
            except OSError:
                health.append(5.0)
            time.sleep(0.2)

    with rival.gpu():
        time.sleep(1.0)
        t = threading.Thread(target=poll)
        t.start()
        done: list[float] = []
        req = threading.Thread(target=lambda: done.append(get(base + "/v1/completions", body)))
        req.start()
        time.sleep(args.hold - 1.0)
    req.join()
    stop.set()
    t.join()
    rows = vllm_rows(d, ("id", "name", "family", "gang", "grants_total", "turns_total"))
    rival.close()
    return {
        "request_s": round(done[0], 3),
        "health_max_s": round(max(health), 3),
        "sessions": rows,
    }


def train(rival: gpushare.Session, stop: threading.Event, steps: list[float]) -> None:
    """The rival: one burst of 50 ms steps, a safe point every 5 ms, until stopped."""
    with rival.gpu():
        while not stop.is_set():
            t = time.perf_counter()
            for _ in range(10):
                time.sleep(0.005)
                rival.checkpoint()
            steps.append(time.perf_counter() - t)


def beside_trainer(
    args: argparse.Namespace, d: Path, base: str, body: dict[str, Any]
) -> dict[str, Any]:
    """``--requests`` requests, ``--gap`` s apart, while a rival trains in one burst."""
    rival = gpushare.attach("4GiB", socket=str(d / "w.sock"), name="rival")
    stop = threading.Event()
    steps: list[float] = []
    trainer = threading.Thread(target=train, args=(rival, stop, steps))
    trainer.start()
    latencies: list[float] = []
    try:
        time.sleep(1.0)  # the trainer holds the GPU, its quantum begun, before the first
        for _ in range(args.requests):
            time.sleep(args.gap)
            latencies.append(round(get(base + "/v1/completions", body), 3))
            print(f"    request {len(latencies)}: {latencies[-1]:.3f} s", flush=True)
        # read while it still trains: what its turns cost the trainer shows in its row
        keys = ("id", "name", "family", "turns_total", "grants_total", "revokes_total")
        rows = vllm_rows(d, (*keys, "wait_seconds_max", "turn_credit_seconds"))
        with AdminClient(str(d / "a.sock")) as c:
            trained = [s for s in c.status().gpus[0].sessions if s.name == "rival"]
        rival_row = {k: getattr(trained[0], k) for k in keys[3:]} if trained else {}
    finally:
        stop.set()
        trainer.join()
        rival.close()
    return {
        "requests_s": latencies,
        "p50_s": round(statistics.median(latencies), 3),
        "max_s": max(latencies),
        "sessions": rows,
        "turns_total": sum(r["turns_total"] for r in rows),
        "grants_total": sum(r["grants_total"] for r in rows),
        # a step the trainer paused for a request's turn is longer than 50 ms
        "rival": {
            **rival_row,
            "steps": len(steps),
            "step_max_s": round(max(steps, default=0.0), 3),
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", required=True, help="the Python of a venv with vLLM")
    ap.add_argument("--model", required=True, help="a model folder vLLM loads offline")
    ap.add_argument("--hold", type=float, default=6.0, help="seconds the rival holds the GPU")
    ap.add_argument(
        "--rival",
        choices=("holder", "trainer"),
        default="holder",
        help="holder: holds the GPU --hold s (TQ 5); trainer: a training loop (TQ 10)",
    )
    ap.add_argument("--requests", type=int, default=8, help="requests beside the trainer")
    ap.add_argument("--gap", type=float, default=2.0, help="seconds between those requests")
    ap.add_argument("--keep", help="a folder to copy the node's and servers' logs into")
    args = ap.parse_args()
    tq = "10" if args.rival == "trainer" else "5"
    with tempfile.TemporaryDirectory(prefix="gs-vllm-") as tmp:
        d = Path(tmp)
        node = subprocess.Popen(
            [sys.executable, "-m", "gpushare", "node", "--socket", str(d / "w.sock"),
             "--admin-socket", str(d / "a.sock"), "--sim-gpus", "1", "--sim-memory", "16GiB",
             "--mode", "exclusive", "--tq", tq, "--metrics-port", "0",
             "--event-log", str(d / "events.jsonl")],
            stderr=open(d / "node.log", "wb"),  # noqa: SIM115
        )  # fmt: skip
        try:
            from gpushare.tools.demo import wait_for_socket

            wait_for_socket(str(d / "a.sock"), node)
            results = []
            for gated in (False, True):
                print(f"{'gated' if gated else 'bare'}:", flush=True)
                r = one_run(args, d, gated)
                print("  " + json.dumps(r), flush=True)
                results.append(r)
        finally:
            node.terminate()
            node.wait(10)
            if args.keep:  # the temporary folder goes: its logs are all the node said
                os.makedirs(args.keep, exist_ok=True)
                for f in [*d.glob("*.log"), *d.glob("*.jsonl")]:
                    shutil.copy(f, args.keep)
    bare, gated_r = results
    if args.rival == "trainer":
        print(
            f"{args.requests} requests, {args.gap:g} s apart, while a rival trains (TQ 10 s):"
            f" bare p50 {bare['p50_s']:.3f} s, max {bare['max_s']:.3f} s; gated p50"
            f" {gated_r['p50_s']:.3f} s, max {gated_r['max_s']:.3f} s; vLLM's sessions took"
            f" {gated_r['turns_total']} turns in {gated_r['grants_total']} grants"
        )
        return
    print(
        f"a request while a rival holds the GPU {args.hold:g} s: bare {bare['request_s']:.2f} s"
        f" (ungated), gated {gated_r['request_s']:.2f} s; /health at most"
        f" {bare['health_max_s']:.2f} / {gated_r['health_max_s']:.2f} s"
    )


if __name__ == "__main__":
    main()

"""Issue 11's abuse and crashes, against two source trees side by side (say, the commit
before the fix and the working tree), one after the other on this machine:

* ``restarts``: 4 sessions of 30 GiB on a simulated 80 GiB GPU (exclusive, TQ 0.5 s),
  the node SIGKILLed and restarted 4 times; the status polled as fast as it answers.
  Prints the polls that showed two exclusive holders or more memory in use than usable,
  the workloads that died of a signal and the pattern checks that failed.
* ``abuse``: 1,000 attaches with ~900 KB names (each closed again), then 5,000
  connections of one uid that never say hello, with the node's descriptor limit at 1,024;
  then, as root, whether another uid can attach. Prints the node's RSS and open
  descriptors before and after each, and its log lines.

* ``lies`` (issue 24): a new session saying 75 GiB are resident beside an honest 40 GiB
  one; five honest fast clients (loops of empty ``with s.gpu():`` blocks); 2,000
  half-sent requests to the exporter.

* ``floods`` (issue 24, round 2): another uid's attach, alone and while one uid's 63
  sessions write reports as fast as they can; a half-sent admin request.

    python benchmarks/trust.py restarts|abuse|lies|floods --tree /tmp/before/src --tree src
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from gpushare import protocol as p

G = 2**30


def node_cmd(tmp: Path, *args: str) -> list[str]:
    return [
        sys.executable, "-m", "gpushare", "node", "--socket", str(tmp / "w.sock"),
        "--admin-socket", str(tmp / "a.sock"), "--metrics-port", "0", *args,
    ]  # fmt: skip


def env_for(tree: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.path.abspath(tree), "GPUSHARE_RECONNECT_TIMEOUT": "60"}


def wait_for(path: Path, proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > end:
            raise RuntimeError(f"the node did not start ({proc.returncode})")
        time.sleep(0.02)


def request(admin: Path, msg: p.Message, timeout: float = 2.0) -> p.Message:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(timeout)
    try:
        s.connect(str(admin))
        s.sendall(p.encode(msg))
        buf = p.FrameBuffer()
        while True:
            data = s.recv(1 << 20)
            if not data:
                raise ConnectionError("closed")
            got = buf.feed(data)
            if got:
                return got[0]
    finally:
        s.close()


def node_figures(pid: int) -> dict[str, int]:
    rss = next(
        int(x.split()[1]) * 1024
        for x in Path(f"/proc/{pid}/status").read_text().splitlines()
        if x.startswith("VmRSS:")
    )
    return {"rss_mib": rss // 2**20, "fds": len(os.listdir(f"/proc/{pid}/fd"))}


# --- restarts ------------------------------------------------------------------------------


def restarts(tree: str) -> dict[str, Any]:
    env = env_for(tree)
    with tempfile.TemporaryDirectory(prefix="gs-trust-") as d:
        tmp = Path(d)
        args = ["--sim-gpus", "1", "--sim-memory", "80GiB", "--mode", "exclusive", "--tq", "0.5"]
        log = open(tmp / "node.log", "ab")  # noqa: SIM115
        start = lambda: subprocess.Popen(node_cmd(tmp, *args), env=env, stderr=log)  # noqa: E731
        node = start()
        wait_for(tmp / "a.sock", node)
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "gpushare.tools.workloads", "batch", "--socket",
                 str(tmp / "w.sock"), "--memory", "30GiB", "--seconds", "14", "--seed", str(i)],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )
            for i in range(4)
        ]  # fmt: skip
        polls, two, over, stop = 0, 0, 0, threading.Event()

        def poll() -> None:
            nonlocal polls, two, over
            while not stop.is_set():
                try:
                    r = request(tmp / "a.sock", p.StatusRequest())
                except (OSError, p.ProtocolError):
                    time.sleep(0.01)
                    continue
                if not isinstance(r, p.StatusReply):
                    continue
                polls += 1
                g = r.status.gpus[0]
                two += len(g.holders) > 1
                over += g.used_bytes > g.usable_bytes

        t = threading.Thread(target=poll, daemon=True)
        t.start()
        for away in (0.2, 0.5, 0.1, 0.3):
            time.sleep(1.5)
            node.kill()
            node.wait()
            (tmp / "a.sock").unlink(missing_ok=True)
            time.sleep(away)
            node = start()
            wait_for(tmp / "a.sock", node)
        outs = [pr.communicate(timeout=180) for pr in procs]
        stop.set()
        t.join(10)
        node.send_signal(signal.SIGTERM)
        node.wait(10)
        figures = []
        for out, _ in outs:
            try:
                figures.append(json.loads(out.strip().splitlines()[-1]))
            except (IndexError, json.JSONDecodeError):
                figures.append({})
        return {
            "polls": polls,
            "polls_two_exclusive_holders": two,
            "polls_used_over_usable": over,
            "workloads_killed_by_a_signal": sum(pr.returncode < 0 for pr in procs),
            "workloads_failed": sum(pr.returncode != 0 for pr in procs),
            "pattern_failures": sum(f.get("failures", 0) for f in figures),
            "pattern_checks": sum(f.get("checks", 0) for f in figures),
        }


# --- abuse ---------------------------------------------------------------------------------


def _attach_raw(sock: str, name: str, uid: int | None = None) -> str:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    try:
        s.connect(sock)
        s.sendall(p.encode(p.Hello(version=1, name=name, memory_limit=2**20)))
        buf = p.FrameBuffer()
        while True:
            data = s.recv(1 << 16)
            if not data:
                return "closed"
            got = buf.feed(data)
            if got:
                m = got[0]
                return "welcome" if isinstance(m, p.Welcome) else f"error {m.code}"  # type: ignore[union-attr]
    except OSError as e:
        return f"failed ({e})"
    finally:
        s.close()


def _as_other_uid(sock: str) -> str:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            out = _attach_raw(sock, "other-uid")
        except BaseException as e:
            out = f"failed ({e})"
        os.write(w, out.encode()[:200])
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    out = os.read(r, 400).decode()
    os.close(r)
    return out


def abuse(tree: str) -> dict[str, Any]:
    env = env_for(tree)
    with tempfile.TemporaryDirectory(prefix="gs-trust-") as d:
        tmp = Path(d)
        os.chmod(tmp, 0o755)  # another uid may reach the socket

        def limit_fds() -> None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))

        log = open(tmp / "node.log", "ab")  # noqa: SIM115
        (tmp / "node.toml").write_text("hello_timeout = 30.0\n")  # they stay silent a while
        node = subprocess.Popen(
            node_cmd(tmp, "--config", str(tmp / "node.toml"), "--sim-gpus", "1",
                     "--sim-memory", "16GiB"),
            env=env, stderr=log, preexec_fn=limit_fds,
        )  # fmt: skip
        wait_for(tmp / "a.sock", node)
        sock = str(tmp / "w.sock")
        out: dict[str, Any] = {"start": node_figures(node.pid)}
        answers: dict[str, int] = {}
        name = "n" * 900_000
        for _ in range(1000):
            a = _attach_raw(sock, name)
            answers[a] = answers.get(a, 0) + 1
        time.sleep(0.5)
        out["after_1000_huge_names"] = node_figures(node.pid) | {"answers": answers}
        held, refused = [], 0
        for _ in range(5000):
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(2.0)  # a full listen backlog: counted, not waited for
            try:
                s.connect(sock)
            except OSError:
                s.close()
                refused += 1
                continue
            held.append(s)
        time.sleep(2.0)
        out["after_5000_silent_connections"] = node_figures(node.pid) | {
            "connected": len(held),
            "not_connected": refused,
        }
        if os.geteuid() == 0:
            out["after_5000_silent_connections"]["other_uid_attach"] = _as_other_uid(sock)
        for s in held:
            s.close()
        time.sleep(1.0)
        out["end"] = node_figures(node.pid)
        node.send_signal(signal.SIGTERM)
        node.wait(20)
        log.close()
        text = (tmp / "node.log").read_text(errors="replace")
        out["log_lines"] = len(text.splitlines())
        out["log_tracebacks"] = text.count("Traceback")
        return out


# --- lies (issue 24) ---------------------------------------------------------------------

FAST = """
import sys, gpushare
s = gpushare.attach(memory="1GiB", socket=sys.argv[1], name="fast")
for _ in range(int(sys.argv[2])):
    with s.gpu():
        pass
print("done", flush=True)
"""


def _hello(sock: str, **fields: Any) -> tuple[socket.socket, p.Message]:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    s.connect(sock)
    s.sendall(p.encode(p.Hello(version=1, **fields)))
    buf = p.FrameBuffer()
    while not (got := buf.feed(s.recv(1 << 16))):
        pass
    return s, got[0]


def _first(s: socket.socket, kind: type, seconds: float) -> p.Message | None:
    s.settimeout(seconds)
    buf = p.FrameBuffer()
    try:
        while True:
            data = s.recv(1 << 16)
            if not data:
                return None
            for m in buf.feed(data):
                if isinstance(m, kind):
                    return m
    except OSError:
        return None


def lies(tree: str) -> dict[str, Any]:
    """Issue 24's cases with real processes: a new session saying 75 GiB are resident
    beside an honest 40 GiB one (80 GiB, escalation log); honest fast clients (loops of
    empty ``with s.gpu():`` blocks, five at once); 2,000 half-sent requests to the
    exporter (its threads counted)."""
    env = env_for(tree)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="gs-trust-") as d:
        tmp = Path(d)
        log = open(tmp / "node.log", "ab")  # noqa: SIM115
        port = _free_port()
        node = subprocess.Popen(
            node_cmd(tmp, "--sim-gpus", "1", "--sim-memory", "80GiB", "--mode", "exclusive",
                     "--escalation", "log", "--metrics-port", str(port)),  # the last one wins
            env=env, stderr=log,
        )  # fmt: skip
        wait_for(tmp / "a.sock", node)
        sock = str(tmp / "w.sock")
        liar, _ = _hello(sock, name="liar", memory_limit=80 * G, resident=75 * G)
        honest, _ = _hello(sock, name="honest", memory_limit=40 * G)
        honest.sendall(p.encode(p.Acquire()))
        out["honest_40_gib_granted_beside_a_75_gib_claim"] = (
            _first(honest, p.Grant, 10.0) is not None
        )
        liar.close()
        honest.close()
        runs = [
            subprocess.Popen(
                [sys.executable, "-c", FAST, sock, "3000"],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )
            for _ in range(5)
        ]  # fmt: skip
        done = [r.communicate(timeout=300) for r in runs]
        out["fast_clients_ended"] = sum(r.returncode != 0 for r in runs)
        why = {e.strip().splitlines()[-1][:160] for (_, e), r in zip(done, runs, strict=True) if r.returncode}  # fmt: skip  # noqa: E501
        out["fast_clients_ended_why"] = sorted(why)
        exporter = [int(c) for c in _children(node.pid)]
        held = []
        for _ in range(2000):
            c = socket.socket()
            try:
                c.connect(("127.0.0.1", port))
                c.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            except OSError:
                c.close()
                continue
            held.append(c)
        time.sleep(2.0)
        out["exporter_threads_with_2000_half_sent"] = sum(_threads(pid) for pid in exporter)
        for c in held:
            c.close()
        node.send_signal(signal.SIGTERM)
        node.wait(20)
    return out


# --- floods (issue 24, round 2) ---------------------------------------------------------

FLOOD = """
import socket, sys, time
from gpushare import protocol as p
sock, n, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
conns = []
for i in range(n):
    s = socket.socket(socket.AF_UNIX)
    s.connect(sock)
    s.sendall(p.encode(p.Hello(version=1, name=f"flood{i}", memory_limit=2**20)))
    buf = p.FrameBuffer()
    while not buf.feed(s.recv(65536)):
        pass
    s.setblocking(False)
    conns.append(s)
print("ready", flush=True)
frames = p.encode(p.Report(resident=0, swapped=0)) * 500
end = time.monotonic() + seconds
while time.monotonic() < end:
    for s in conns:
        try:
            s.send(frames)
        except BlockingIOError:
            pass
        try:
            s.recv(1 << 20)  # what the node answers (nothing, or errors)
        except BlockingIOError:
            pass
"""


def _timed_attach_as_other_uid(sock: str) -> str:
    """Seconds for a uid 65534 process to be welcomed (root only), or what it got."""
    t0 = time.monotonic()
    out = _as_other_uid(sock)
    return f"{out} in {time.monotonic() - t0:.2f} s"


def floods(tree: str) -> dict[str, Any]:
    """Issue 24's round-2 cases: another uid's attach while one uid's 63 sessions write
    reports as fast as they can (the node's own rate limits in force); a half-sent admin
    request (how long the node holds it, up to 30 s)."""
    env = env_for(tree)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="gs-trust-") as d:
        tmp = Path(d)
        os.chmod(tmp, 0o755)  # another uid may reach the socket
        log = open(tmp / "node.log", "ab")  # noqa: SIM115
        (tmp / "node.toml").write_text("max_sessions_per_uid = 2000\n")
        node = subprocess.Popen(
            node_cmd(tmp, "--config", str(tmp / "node.toml"), "--sim-gpus", "1",
                     "--sim-memory", "80GiB"),
            env=env, stderr=log,
        )  # fmt: skip
        wait_for(tmp / "a.sock", node)
        sock = str(tmp / "w.sock")
        if os.geteuid() == 0:
            out["other_uid_attach_alone"] = _timed_attach_as_other_uid(sock)
        flood = subprocess.Popen(
            [sys.executable, "-c", FLOOD, sock, "63", "20"],
            env=env, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert flood.stdout is not None
        flood.stdout.readline()
        time.sleep(2.0)
        if os.geteuid() == 0:
            out["other_uid_attach_behind_the_flood"] = [
                _timed_attach_as_other_uid(sock) for _ in range(3)
            ]
        flood.kill()
        flood.wait()
        a = socket.socket(socket.AF_UNIX)
        a.connect(str(tmp / "a.sock"))
        a.sendall(p.encode(p.StatusRequest())[:3])
        a.settimeout(30)
        t0 = time.monotonic()
        try:
            while a.recv(65536):
                pass
            out["half_sent_admin_request_held_s"] = round(time.monotonic() - t0, 1)
        except OSError:
            out["half_sent_admin_request_held_s"] = "more than 30 (not closed)"
        a.close()
        node.send_signal(signal.SIGTERM)
        node.wait(20)
        log.close()
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _children(pid: int) -> list[str]:
    return [d.name for d in Path("/proc").iterdir() if d.name.isdigit() and _ppid(d.name) == pid]


def _ppid(pid: str) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def _threads(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["restarts", "abuse", "lies", "floods"])
    ap.add_argument("--tree", action="append", required=True, help="a source tree (its src/)")
    ap.add_argument("--json", help="also write the figures here")
    a = ap.parse_args()
    run = {"restarts": restarts, "abuse": abuse, "lies": lies, "floods": floods}[a.what]
    results = {tree: run(tree) for tree in a.tree}
    for tree, figures in results.items():
        print(f"== {a.what}: {tree}")
        print(json.dumps(figures, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

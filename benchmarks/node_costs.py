"""What the node costs as sessions grow, on simulated GPUs. A benchmark, not a test.

Side by side in one run, for this tree and (``--before``) another version of gpushare:

* the arbiter's cost per handoff with 2, 16, 256 and 1,024 sessions attached (the pure
  arbiter on a manual clock: two sessions take turns, the rest are attached and idle;
  per handoff, a yield (a release that asks again) and the next-deadline query the node
  makes after it; CPU time, best of three);
* a scrape's work in process: the status snapshot and the exposition text, the first
  scrape (every session's lines written) and the next (nothing changed);
* the node's CPU time (its process CPU-time clock: every thread of the real node
  process; its exporter process's apart) per grant and per scrape with 16, 256 and
  1,024 sessions attached: two raw protocol sessions take turns as fast as the node
  grants, the others are attached and idle; scrapes are HTTP GETs as Prometheus makes
  them (gzip), back to back, then ten a second apart (each a fresh snapshot; less the
  CPU time of as long unscraped);
* handoff latency at 64 sessions cycling (one driver process, raw protocol: from the
  holder's release written to the next session's grant read), and grants per second,
  alone and while another process scrapes the exporter back to back (the median of
  three runs of each, taken in turn);
* ``ctl status`` with 256 and 1,000 sessions attached: the node's CPU per status (back
  to back, a connection each, as ctl makes them), and grants per second and the
  handoff's p99 (two sessions taking turns) alone and while another process polls the
  status back to back;
* mass attach: 256 and 1,000 ``gpushare.attach()`` at once (8 processes of 32 threads, 10
  of 100, the default 10 s timeout) against a fresh node: how many succeed, and the
  node's CPU per attach; ``mass_attach_starved`` the same with the node held to
  ``--node-cpu`` of one CPU (0.15; a cgroup's CPU quota, root only): a CPU-starved node
  whatever else the machine runs.

Clients are this tree's in both columns (mass attach's excepted: each tree's own, since
the client's retries are part of it); only the node (and the arbiter) differ. Figures
depend on the machine and on what else runs on it: compare the columns of one run.

    python benchmarks/node_costs.py [--before REV|DIR] [--quick] [--parts P,...] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import importlib.util
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gpushare.core.attach import AttachRecord

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
G = 2**30
TICK = os.sysconf("SC_CLK_TCK")


# --- in the tree measured (a child process with its src first on the path) ------------


def arbiter_part(sizes: list[int], handoffs: int) -> dict[str, float]:
    from gpushare.core.arbiter import Arbiter
    from gpushare.core.clock import ManualClock
    from gpushare.settings import GpuSettings

    def once(n: int) -> float:
        clock = ManualClock()
        a = Arbiter(0, 80 * G, clock, GpuSettings(mode="exclusive", tq_s=30))
        for sid in range(1, n + 1):
            a.attach(sid, AttachRecord(name=f"s{sid}", memory_limit=2**20))
        a.acquire(1)
        a.acquire(2)
        holder = 1
        t0 = time.process_time()
        for _ in range(handoffs):
            clock.advance(0.001)
            # a yield: the other is granted, and this one waits for its next turn (a
            # release and an ask at once would keep the quantum: docs/scheduling.md)
            a.release(holder, resident=2**20, swapped=0, again=True)
            a.next_deadline()
            holder = 3 - holder
        return (time.process_time() - t0) / handoffs

    return {str(n): min(once(n) for _ in range(3)) * 1e6 for n in sizes}


def render_part(sizes: list[int]) -> dict[str, Any]:
    """status() and the exposition text, in process (both trees' ways)."""
    from gpushare.core.clock import ManualClock
    from gpushare.node.daemon import Node
    from gpushare.node.host.gpus import simulated_gpus
    from gpushare.node.keep.config import NodeConfig

    try:
        from gpushare.node.observe.metrics import Exposition

        def renderer() -> Any:
            return Exposition().render
    except ImportError:  # before: prometheus_client's families and generate_latest
        from prometheus_client import generate_latest

        from gpushare.node.observe.metrics import registry_for

        def renderer() -> Any:
            return lambda st: generate_latest(registry_for(lambda: st))

    import msgspec

    from gpushare.status import NodeStatus

    exporter_process = (
        importlib.util.find_spec("gpushare.node.observe.exporter_process") is not None
    )
    decoder = msgspec.msgpack.Decoder(NodeStatus)

    def best(f: Any, k: int = 5) -> float:
        b = float("inf")
        for _ in range(k):
            t0 = time.process_time()
            f()
            b = min(b, time.process_time() - t0)
        return b * 1e3

    out: dict[str, Any] = {}
    for n in sizes:
        clock = ManualClock()
        node = Node(NodeConfig(metrics_port=0), simulated_gpus(1, 80 * G), clock=clock)
        a = node.arbiters[0]
        for sid in range(1, n + 1):  # each with a burst behind it: every figure set
            a.attach(sid, AttachRecord(name=f"s{sid}", memory_limit=2**20))
            a.acquire(sid)
            clock.advance(0.002)
            a.release(sid, resident=2**19, swapped=0)
        st = node.status()
        render = renderer()
        render(st)
        text = render(st)
        out[str(n)] = {
            "status_ms": best(node.status),
            "text_first_ms": best(lambda st=st: renderer()(st)),  # every session's lines
            "text_next_ms": best(lambda st=st, r=render: r(st)),  # nothing changed since
            "gzip_ms": best(lambda t=text: gzip.compress(t, compresslevel=1)),
            "bytes": len(text),
        }
        if exporter_process:  # the snapshot's way to the exporter's process
            raw = msgspec.msgpack.encode(st)
            out[str(n)] |= {
                "encode_ms": best(lambda st=st: msgspec.msgpack.encode(st)),
                "decode_ms": best(lambda raw=raw: decoder.decode(raw)),
                "snapshot_bytes": len(raw),
            }
    return out


# --- raw protocol sessions (what the node sees of any client) -------------------------


class Raw:
    def __init__(self, path: str, name: str, limit: int = 2**20) -> None:
        from gpushare import protocol as p

        self.p = p
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        deadline = time.monotonic() + 30
        while True:
            try:
                self.sock.connect(path)
                break
            except (BlockingIOError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
        self.buf = p.FrameBuffer()
        self.pending: deque[Any] = deque()
        self.send(p.Hello(version=p.PROTOCOL_VERSION, name=name, memory_limit=limit))
        self.session = self.expect(p.Welcome).session

    def send(self, *msgs: Any) -> None:
        self.sock.sendall(b"".join(self.p.encode(m) for m in msgs))

    def expect(self, kind: type) -> Any:
        while True:
            while not self.pending:
                data = self.sock.recv(65536)
                if not data:
                    raise ConnectionError("the node closed the connection")
                self.pending.extend(self.buf.feed(data))
            msg = self.pending.popleft()
            if isinstance(msg, kind):
                return msg
            if isinstance(msg, self.p.Error):
                raise RuntimeError(f"node error: {msg.message}")

    def close(self) -> None:
        self.sock.close()


def take_turns(sessions: list[Raw], handoffs: int, start: bool = False) -> list[float]:
    """``sessions`` cycle in FIFO order (``start``: the first is granted, the others
    queue), each burst empty: the holder yields (a release that asks again: a release
    and an ask would keep its quantum, docs/scheduling.md), the next one's grant is
    read. Returns each handoff's seconds (release written to grant read); leaves
    ``sessions`` in their order now (the holder first)."""
    p = sessions[0].p
    if start:
        sessions[0].send(p.Acquire())
        sessions[0].expect(p.Grant)
        for s in sessions[1:]:
            s.send(p.Acquire())
    q = deque(sessions)
    out = []
    for _ in range(handoffs):
        holder = q.popleft()
        t0 = time.perf_counter()
        holder.send(p.Release(resident=0, swapped=0, again=True))
        q[0].expect(p.Grant)
        out.append(time.perf_counter() - t0)
        q.append(holder)
    sessions[:] = q
    return out


# --- a node of the tree measured ------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stat_fields(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cpu_of(pid: int) -> float:
    """The process's CPU seconds, every thread (exited ones too): its CPU-time clock,
    in nanoseconds (clock_getcpuclockid's), else /proc's clock ticks."""
    with contextlib.suppress(OSError):
        return time.clock_gettime((~pid << 3) | 2)  # MAKE_PROCESS_CPUCLOCK(pid, SCHED)
    with contextlib.suppress(OSError):
        fields = stat_fields(pid)
        return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime
    return 0.0


def children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                if int(stat_fields(int(d.name))[1]) == pid:
                    out.append(int(d.name))
    return out


class NodeRun:
    def __init__(self, src: Path, tmp: Path) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="n", dir=tmp))
        self.socket = str(self.dir / "w.sock")
        self.admin = str(self.dir / "a.sock")
        self.port = free_port()
        cfg = self.dir / "node.toml"
        # attaches by the thousand, and sessions taking turns as fast as they can
        text = "max_sessions_per_uid = 5000\nmax_messages_per_s = 1e6\n"
        if "max_messages_per_s_per_user" in (src / "gpushare" / "settings.py").read_text():
            text += "max_messages_per_s_per_user = 1e9\n"  # (issue 24's; older trees lack it)
        cfg.write_text(text)
        env = {**os.environ, "PYTHONPATH": str(src)}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gpushare",
                "node",
                "--config",
                str(cfg),
                "--socket",
                self.socket,
                "--admin-socket",
                self.admin,
                "--sim-gpus",
                "1",
                "--sim-memory",
                "80GiB",
                "--mode",
                "exclusive",
                "--tq",
                "600",
                "--metrics-port",
                str(self.port),
                "--metrics-address",
                "127.0.0.1",
                "--log-level",
                "error",
            ],
            env=env,
        )
        deadline = time.monotonic() + 30
        while not os.path.exists(self.admin):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the node did not start")
            time.sleep(0.02)
        while True:  # and its exporter serves (a process of its own: started by now)
            try:
                self.scrape()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("the node's exporter did not answer") from None
                time.sleep(0.02)

    def cpu(self) -> float:
        """The node's CPU seconds so far, every thread (exited ones too)."""
        return cpu_of(self.proc.pid)

    def exporter_cpu(self) -> float:
        """The CPU seconds of the node's children (its exporter process; none before)."""
        return sum(cpu_of(pid) for pid in children(self.proc.pid))

    def scrape(self) -> int:
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/metrics", headers={"Accept-Encoding": "gzip"}
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            return len(r.read())

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@contextlib.contextmanager
def node(src: Path, tmp: Path) -> Iterator[NodeRun]:
    n = NodeRun(src, tmp)
    try:
        yield n
    finally:
        n.stop()


SPACED_S = 1.05


def node_part(
    src: Path, tmp: Path, sizes: list[int], seconds: float, spaced: int
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for n in sizes:
        with node(src, tmp) as nd:
            idle = [Raw(nd.socket, f"idle{i}") for i in range(n - 2)]
            pair = [Raw(nd.socket, "a"), Raw(nd.socket, "b")]
            take_turns(pair, 200, start=True)  # warm
            grants, c0, t0 = 0, nd.cpu(), time.monotonic()
            while time.monotonic() - t0 < seconds:
                grants += len(take_turns(pair, 500))
            grant_cpu = (nd.cpu() - c0) / grants
            grant_rate = grants / (time.monotonic() - t0)
            nd.scrape()  # the first: every session's lines written
            k, size, c0, e0, t0 = 0, 0, nd.cpu(), nd.exporter_cpu(), time.monotonic()
            while k < 10 or time.monotonic() - t0 < seconds:
                size = nd.scrape()
                k += 1
            node_ms, exporter_ms = (nd.cpu() - c0) / k * 1e3, (nd.exporter_cpu() - e0) / k * 1e3
            # Scrapes a second apart, each a fresh snapshot (the node gives scrapes close
            # together its last one, for as long as 200 times its cost and at most 1 s)
            # less what the node does meanwhile unscraped (its sampler, each second)
            c0, e0 = nd.cpu(), nd.exporter_cpu()
            time.sleep(SPACED_S * spaced)
            idle_node, idle_exporter = nd.cpu() - c0, nd.exporter_cpu() - e0
            c0, e0 = nd.cpu(), nd.exporter_cpu()
            for _ in range(spaced):
                time.sleep(SPACED_S)
                nd.scrape()
            fresh_node, fresh_exporter = (
                (nd.cpu() - c0 - idle_node) / spaced * 1e3,
                (nd.exporter_cpu() - e0 - idle_exporter) / spaced * 1e3,
            )
            out[str(n)] = {
                "grant_cpu_us": grant_cpu * 1e6,
                "grants_per_s": grant_rate,
                "scrape_cpu_ms": node_ms + exporter_ms,
                "scrape_node_ms": node_ms,
                "scrape_exporter_ms": exporter_ms,
                "spaced_node_ms": fresh_node,
                "spaced_exporter_ms": fresh_exporter,
                "scrapes": k,
                "scrape_gzip_bytes": size,
            }
            for s in [*idle, *pair]:
                s.close()
    return out


def status_poller(admin: str, stop: Path) -> None:
    """``ctl status`` back to back (each on a connection of its own, as ctl makes it)."""
    from gpushare.tools.admin import AdminClient

    while not stop.exists():
        with contextlib.suppress(Exception), AdminClient(admin, timeout=30) as c:
            c.status()


def status_part(src: Path, tmp: Path, sizes: list[int], seconds: float) -> dict[str, Any]:
    """Per size: the node's CPU per status request (back to back, each on a connection
    of its own), and grants per second and the handoff's p99 with two sessions taking
    turns, alone and while another process polls the status back to back."""
    from gpushare.tools.admin import AdminClient

    out: dict[str, Any] = {}
    for n in sizes:
        with node(src, tmp) as nd:
            idle = [Raw(nd.socket, f"idle{i}") for i in range(n - 2)]
            pair = [Raw(nd.socket, "a"), Raw(nd.socket, "b")]
            take_turns(pair, 200, start=True)  # warm
            figures: dict[str, float] = {}
            for label in ("alone", "polled"):
                stop = nd.dir / f"stop-{label}"
                poller = None
                if label == "polled":
                    poller = subprocess.Popen(
                        [sys.executable, __file__, "--status-poller", nd.admin, str(stop)],
                        env={**os.environ, "PYTHONPATH": str(REPO / "src")},
                    )
                    time.sleep(0.5)
                lat: list[float] = []
                t0 = time.monotonic()
                while time.monotonic() - t0 < seconds:
                    lat += take_turns(pair, 200)
                figures[f"grants_per_s_{label}"] = len(lat) / (time.monotonic() - t0)
                figures[f"p99_us_{label}"] = percentile(lat, 0.99) * 1e6
                if poller is not None:
                    stop.touch()
                    poller.wait(timeout=60)
            k, c0, t0 = 0, nd.cpu(), time.monotonic()
            while k < 10 or time.monotonic() - t0 < seconds:
                with AdminClient(nd.admin, timeout=30) as c:
                    c.status()
                k += 1
            figures["status_node_ms"] = (nd.cpu() - c0) / k * 1e3
            figures["status_per_s"] = k / (time.monotonic() - t0)
            figures["load"] = os.getloadavg()[0]
            out[str(n)] = figures
            for s in [*idle, *pair]:
                s.close()
    return out


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def handoff_part(src: Path, tmp: Path, cycling: int, handoffs: int, repeats: int) -> dict[str, Any]:
    """Runs alone and while scraping, in turn, ``repeats`` of each: each figure is the
    median over the runs (one run's tail on a busy machine is its scheduler's)."""
    runs: dict[str, list[dict[str, float]]] = {"alone": [], "scraping": []}
    for _ in range(repeats):
        for scraping in (False, True):
            runs["scraping" if scraping else "alone"].append(
                handoff_run(src, tmp, cycling, handoffs, scraping)
            )
    return {
        k: {f: statistics.median(r[f] for r in rs) for f in rs[0]} | {"runs": len(rs)}
        for k, rs in runs.items()
    }


def handoff_run(
    src: Path, tmp: Path, cycling: int, handoffs: int, scraping: bool
) -> dict[str, float]:
    with node(src, tmp) as nd:
        sessions = [Raw(nd.socket, f"c{i}") for i in range(cycling)]
        take_turns(sessions, 500, start=True)  # warm, every session granted
        scraper = None
        stop = nd.dir / "stop-scraping"
        if scraping:
            scraper = subprocess.Popen(
                [sys.executable, __file__, "--scraper", str(nd.port), str(stop)],
                stdout=subprocess.PIPE,
                text=True,
            )
            nd.scrape()
            time.sleep(0.5)  # the scraper under way
        t0 = time.monotonic()
        lat = take_turns(sessions, handoffs)
        t1 = time.monotonic()
        scrapes = 0
        if scraper:
            stop.touch()
            done = json.loads(scraper.communicate(timeout=60)[0])
            scrapes = sum(1 for t in done if t0 <= t <= t1)
        for s in sessions:
            s.close()
    return {
        "p50_us": percentile(lat, 0.5) * 1e6,
        "p99_us": percentile(lat, 0.99) * 1e6,
        "grants_per_s": len(lat) / (t1 - t0),
        "scrapes_per_s": scrapes / (t1 - t0),
    }


def scraper(port: int, stop: Path) -> None:
    """Scrapes back to back until ``stop`` exists; prints when each ended (JSON)."""
    url = f"http://127.0.0.1:{port}/metrics"
    done = []
    while not stop.exists():
        req = urllib.request.Request(url, headers={"Accept-Encoding": "gzip"})
        with urllib.request.urlopen(req, timeout=60) as r:
            r.read()
        done.append(time.monotonic())  # CLOCK_MONOTONIC: the same in every process
    print(json.dumps(done))


def attach_client(sock: str, threads: int, go: Path, out: Path, stop: Path) -> None:
    """``threads`` attaches at once (after ``go`` exists); writes what each got."""
    import gpushare

    results: list[str] = []
    sessions: list[Any] = []
    lock = threading.Lock()
    ready = threading.Barrier(threads + 1)

    def run(i: int) -> None:
        ready.wait()
        try:
            s = gpushare.attach("1MiB", socket=sock, name=f"mass-{os.getpid()}-{i}")
            with lock:
                sessions.append(s)
                results.append("ok")
        except Exception as e:  # what a workload would see
            with lock:
                results.append(f"{type(e).__name__}: {e}")

    ts = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    out.with_suffix(".ready").touch()
    while not go.exists():
        time.sleep(0.002)
    ready.wait()
    for t in ts:
        t.join()
    part = out.with_suffix(".part")
    part.write_text(json.dumps(results))
    part.rename(out)  # whole, or not there
    while not stop.exists():
        time.sleep(0.05)
    for s in sessions:
        s.close()


def mass_attach(
    sock: str, folder: Path, processes: int, threads: int, src: Path | None = None
) -> dict[str, Any]:
    """``processes`` x ``threads`` attaches at once against the node at ``sock``, by
    the clients of ``src`` (default: this tree's)."""
    env = {**os.environ, "PYTHONPATH": str(src)} if src is not None else None
    go, stop = folder / f"go{threads}", folder / f"stop{threads}"
    outs = [folder / f"attach{threads}-{i}.json" for i in range(processes)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--attach-client",
                sock,
                str(threads),
                *map(str, (go, o, stop)),
            ],
            env=env,
        )
        for o in outs
    ]
    try:
        deadline = time.monotonic() + 120
        while not all(o.with_suffix(".ready").exists() for o in outs):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise SystemExit("the attach clients did not start")
            time.sleep(0.02)
        t0 = time.monotonic()
        go.touch()
        while not all(o.exists() for o in outs):
            if time.monotonic() > deadline + 120:
                raise SystemExit("the attach clients did not finish")
            time.sleep(0.01)
        wall = time.monotonic() - t0
        results = [r for o in outs for r in json.loads(o.read_text())]
    finally:
        stop.touch()
        for pr in procs:
            try:
                pr.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pr.kill()
    failed = [r for r in results if r != "ok"]
    return {
        "attaches": len(results),
        "ok": len(results) - len(failed),
        "seconds": wall,
        "first_failure": failed[0] if failed else "",
    }


def connect_burst(
    proc: subprocess.Popen[Any], path: str, n: int
) -> tuple[list[socket.socket], int]:
    """``n`` connects at once to ``path`` while its node (``proc``) accepts nothing (it is
    stopped meanwhile): the sockets the listen backlog took, and how many it refused
    (EAGAIN; a client tries those again)."""
    proc.send_signal(signal.SIGSTOP)
    socks, refused = [], 0
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            try:
                s.connect(path)
                socks.append(s)
            except BlockingIOError:
                refused += 1
                s.close()
    finally:
        proc.send_signal(signal.SIGCONT)
    return socks, refused


@contextlib.contextmanager
def cpu_quota(pids: list[int], fraction: float | None) -> Iterator[None]:
    """``pids`` held to ``fraction`` of one CPU (a cgroup's CPU quota: a CPU-starved node
    whatever else the machine runs; needs root and a cgroup v1 ``cpu`` controller or
    cgroup v2) while inside; nothing where ``fraction`` is None."""
    if fraction is None:
        yield
        return
    v1 = Path("/sys/fs/cgroup/cpu")
    base = v1 if (v1 / "cgroup.procs").exists() else Path("/sys/fs/cgroup")
    cg = base / f"gpushare-costs-{os.getpid()}"
    cg.mkdir()
    try:
        if base == v1:
            (cg / "cpu.cfs_period_us").write_text("100000")
            (cg / "cpu.cfs_quota_us").write_text(str(int(fraction * 100000)))
        else:
            (cg / "cpu.max").write_text(f"{int(fraction * 100000)} 100000")
        for pid in pids:
            (cg / "cgroup.procs").write_text(str(pid))
        yield
    finally:
        for pid in (cg / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (base / "cgroup.procs").write_text(pid)
        cg.rmdir()


def mass_part(
    src: Path, tmp: Path, counts: list[int], quota: float | None = None
) -> dict[str, Any]:
    """Per count: that many attaches at once (the node held to ``quota`` of a CPU, if
    given), how many succeed, and the node's CPU per attach; then how many connects a
    stopped node's listen backlog refuses."""
    out = {}
    for n in counts:
        procs = 10 if n % 10 == 0 else 8
        with node(src, tmp) as nd, cpu_quota([nd.proc.pid, *children(nd.proc.pid)], quota):
            c0 = nd.cpu()
            out[str(n)] = mass_attach(nd.socket, nd.dir, procs, n // procs, src)
            out[str(n)]["node_cpu_ms_per_attach"] = (nd.cpu() - c0) / n * 1e3
            out[str(n)]["load"] = os.getloadavg()[0]
        with node(src, tmp) as nd:
            socks, out[str(n)]["refused_at_first_try"] = connect_burst(nd.proc, nd.socket, n)
            for s in socks:
                s.close()
    return out


# --- both trees, side by side ------------------------------------------------------------


def in_tree(src: Path, part: str, args: list[str]) -> Any:
    """A part run in a child whose gpushare is ``src``'s."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    r = subprocess.run(
        [sys.executable, __file__, "--part", part, *args],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(r.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def tree(before: str, tmp: Path) -> Iterator[Path]:
    """The src folder of ``before``: a folder with src/, or a revision checked out."""
    if (Path(before) / "src" / "gpushare").is_dir():
        yield Path(before) / "src"
        return
    wt = tmp / "before"
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(wt), before], check=True
    )
    try:
        yield wt / "src"
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(wt)])


PARTS = (
    "arbiter_us",
    "render",
    "node",
    "handoff64",
    "mass_attach",
    "mass_attach_starved",
    "status",
)


def measure(
    trees: dict[str, Path],
    tmp: Path,
    quick: bool,
    only: list[str] | None = None,
    quota: float = 0.15,
) -> dict[str, dict[str, Any]]:
    """Each part for every tree in turn, so that both see the machine as it is then."""
    sizes = [16, 256] if quick else [16, 256, 1024]
    handoffs = "2000" if quick else "10000"
    parts: dict[str, Any] = {
        "arbiter_us": lambda src: in_tree(
            src, "arbiter", ["2", "16", "256", "1024", "--handoffs", handoffs]
        ),
        "render": lambda src: in_tree(src, "render", [str(n) for n in sizes]),
        "node": lambda src: node_part(src, tmp, sizes, 1.0 if quick else 2.0, 5 if quick else 10),
        "handoff64": lambda src: handoff_part(
            src, tmp, 64, 1000 if quick else 3000, 1 if quick else 3
        ),
        "mass_attach": lambda src: mass_part(src, tmp, [256] if quick else [256, 1000]),
        "mass_attach_starved": lambda src: mass_part(
            src, tmp, [256] if quick else [256, 1000], quota
        ),
        "status": lambda src: status_part(
            src, tmp, [256] if quick else [256, 1000], 1.0 if quick else 2.0
        ),
    }
    out: dict[str, dict[str, Any]] = {label: {} for label in trees}
    for name, part in parts.items():
        if only and name not in only:
            continue
        if name == "mass_attach_starved" and not only and os.geteuid() != 0:
            continue  # a cgroup of its own needs root
        for label, src in trees.items():
            out[label][name] = part(src)
    return out


def rows(r: dict[str, Any]) -> list[tuple[str, str, float]]:
    """(figure, unit, value) in print order."""
    out = [
        (f"arbiter per handoff, {n} sessions", "us", v) for n, v in r.get("arbiter_us", {}).items()
    ]
    for n, v in r.get("render", {}).items():
        out += [
            (f"scrape in process, {n} sessions: status()", "ms", v["status_ms"]),
            (f"  text, every session changed, {n}", "ms", v["text_first_ms"]),
            (f"  text, nothing changed, {n}", "ms", v["text_next_ms"]),
            (f"  gzip of the text, {n}", "ms", v.get("gzip_ms", 0.0)),
        ]
        if "encode_ms" in v:
            out += [
                (f"  snapshot msgpack encode (node), {n}", "ms", v["encode_ms"]),
                (f"  snapshot decode (exporter), {n}", "ms", v["decode_ms"]),
            ]
    for n, v in r.get("node", {}).items():
        out += [
            (f"node CPU per grant, {n} sessions", "us", v["grant_cpu_us"]),
            (f"  grants per second, {n} sessions", "/s", v["grants_per_s"]),
            (f"node CPU per scrape (gzip), {n} sessions", "ms", v["scrape_cpu_ms"]),
            (f"  of which the node process, {n}", "ms", v.get("scrape_node_ms", 0.0)),
            (f"  of which the exporter process, {n}", "ms", v.get("scrape_exporter_ms", 0.0)),
        ]
        if "spaced_node_ms" in v:
            out += [
                (f"node CPU per scrape, 1 s apart, {n}", "ms", v["spaced_node_ms"]),
                (f"  the exporter's, 1 s apart, {n}", "ms", v["spaced_exporter_ms"]),
            ]
    for k, v in r.get("handoff64", {}).items():
        out += [
            (f"handoff p50, 64 cycling, {k}", "us", v["p50_us"]),
            (f"handoff p99, 64 cycling, {k}", "us", v["p99_us"]),
            (f"  grants per second, {k}", "/s", v["grants_per_s"]),
        ]
        if v["scrapes_per_s"]:
            out.append(("  scrapes per second meanwhile", "/s", v["scrapes_per_s"]))
    for n, v in r.get("status", {}).items():
        out += [
            (f"node CPU per ctl status, {n} sessions", "ms", v["status_node_ms"]),
            (f"  ctl status per second, back to back, {n}", "/s", v["status_per_s"]),
            (f"  grants per second, {n}, unpolled", "/s", v["grants_per_s_alone"]),
            (f"  grants per second, {n}, status polled", "/s", v["grants_per_s_polled"]),
            (f"  handoff p99, {n}, unpolled", "us", v["p99_us_alone"]),
            (f"  handoff p99, {n}, status polled", "us", v["p99_us_polled"]),
            (f"  load average (1 min) after, status {n}", "", v.get("load", 0.0)),
        ]
    return out + mass_rows(r)


def mass_rows(r: dict[str, Any]) -> list[tuple[str, str, float]]:
    out: list[tuple[str, str, float]] = []
    for part, what in (("mass_attach", ""), ("mass_attach_starved", ", node starved")):
        for n, v in r.get(part, {}).items():
            out.append((f"mass attach{what}: {n} at once, succeeded", "", v["ok"]))
            out.append((f"  seconds to all answered, {n}{what}", "s", v["seconds"]))
            if "node_cpu_ms_per_attach" in v:
                out.append((f"  node CPU per attach, {n}{what}", "ms", v["node_cpu_ms_per_attach"]))
                out.append((f"  load average (1 min) after, {n}{what}", "", v["load"]))
            out.append(
                (f"  connects refused at once, node busy, {n}{what}", "", v["refused_at_first_try"])
            )
    return out


def report(after: dict[str, Any], before: dict[str, Any] | None, label: str) -> str:
    lines = [
        f"node costs on one simulated GPU, {os.cpu_count()} CPUs (figures of one run)",
        f"{'figure':<52} {'before':>11} {'after':>11} {'after/before':>12}",
    ]
    b_rows = {f: v for f, _, v in rows(before)} if before else {}
    for f, unit, v in rows(after):
        bv = b_rows.get(f)
        ratio = f"{v / bv:.2f}" if bv else ""
        fmt = "{:.0f}" if unit in ("/s", "") or v >= 100 else "{:.1f}" if v >= 10 else "{:.2f}"
        left = (fmt.format(bv) + f" {unit}") if bv is not None else "-"
        lines.append(f"{f:<52} {left:>11} {fmt.format(v) + ' ' + unit:>11} {ratio:>12}")
    for name, r in (("before", before), ("after", after)):
        for part in ("mass_attach", "mass_attach_starved"):
            for n, v in (r or {}).get(part, {}).items():
                if v["first_failure"]:
                    lines.append(f"{name}, {part} {n}, first failure: {v['first_failure']}")
    lines.append(f"before: {label}" if before else "before: not measured (--before REV)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--part":
        part, rest = argv[1], argv[2:]
        if part == "arbiter":
            sizes = [int(x) for x in rest[: rest.index("--handoffs")]]
            print(json.dumps(arbiter_part(sizes, int(rest[rest.index("--handoffs") + 1]))))
        else:
            print(json.dumps(render_part([int(x) for x in rest])))
        return 0
    if argv and argv[0] == "--scraper":
        scraper(int(argv[1]), Path(argv[2]))
        return 0
    if argv and argv[0] == "--status-poller":
        status_poller(argv[1], Path(argv[2]))
        return 0
    if argv and argv[0] == "--attach-client":
        attach_client(argv[1], int(argv[2]), Path(argv[3]), Path(argv[4]), Path(argv[5]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", metavar="REV|DIR", help="also measure this version (ea541dc)")
    ap.add_argument("--quick", action="store_true", help="fewer sizes and turns (a smoke)")
    ap.add_argument("--json", metavar="FILE", help="also write the figures here")
    ap.add_argument(
        "--parts",
        metavar="P,...",
        help=f"only these parts, comma-separated, of {', '.join(PARTS)}",
    )
    ap.add_argument(
        "--node-cpu",
        type=float,
        default=0.15,
        metavar="FRACTION",
        help="mass_attach_starved: the node held to this share of one CPU (root; 0.15)",
    )
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="gs-costs-") as d, contextlib.ExitStack() as stack:
        tmp = Path(d)
        trees = {"after": REPO / "src"}
        if a.before:
            trees = {"before": stack.enter_context(tree(a.before, tmp)), **trees}
        only = a.parts.split(",") if a.parts else None
        if only and not set(only) <= set(PARTS):
            ap.error(f"--parts: choose from {', '.join(PARTS)}")
        r = measure(trees, tmp, a.quick, only, a.node_cpu)
    after, before = r["after"], r.get("before")
    print(report(after, before, a.before or ""))
    result = {"before": before, "after": after, "before_rev": a.before, "cpus": os.cpu_count()}
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

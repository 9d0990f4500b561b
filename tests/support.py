"""What tests share: a real node daemon process on simulated GPUs over real Unix sockets,
its arguments, waiting, and where the recorded fixtures are."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import gpushare
from gpushare.status import to_json_object
from gpushare.tools.admin import AdminClient
from gpushare.tools.demo import wait_for_socket
from gpushare.tools.report import read_events

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"


def sim(memory: str, gpus: int | str = 1, **flags: object) -> list[str]:
    """Node arguments for simulated GPUs: ``sim("16GiB", mode="exclusive", tq=0.3)``."""
    args = ["--sim-gpus", str(gpus), "--sim-memory", memory]
    for key, value in flags.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    return args


class NodeProcess:
    def __init__(self, tmp: Path, *args: str) -> None:
        # Socket paths must stay short (108 bytes): pytest's tmp paths can be long.
        self.dir = tmp
        self.socket = str(tmp / "w.sock")
        self.admin = str(tmp / "a.sock")
        self.events = tmp / "events.jsonl"
        self.log = tmp / "node.log"
        self.args = list(args)
        # The exporter is on by default: tests that want it pass --metrics-port.
        self.metrics = [] if "--metrics-port" in args else ["--metrics-port", "0"]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, *extra: str) -> NodeProcess:
        cmd = [
            sys.executable,
            "-m",
            "gpushare",
            "node",
            "--socket",
            self.socket,
            "--admin-socket",
            self.admin,
            "--event-log",
            str(self.events),
            *self.metrics,
            *self.args,
            *extra,
        ]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stderr=log)
        wait_for_socket(self.admin, self.proc)
        return self

    def stop(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def restart(self, *extra: str) -> NodeProcess:
        self.stop()
        return self.start(*extra)

    def status(self) -> dict:
        """The status as ``ctl status --json`` prints it (plain JSON types)."""
        with AdminClient(self.admin) as c:
            return to_json_object(c.status())

    def ctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        r = subprocess.run(
            [sys.executable, "-m", "gpushare", "ctl", "--socket", self.admin, *args],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if check and r.returncode != 0:
            raise AssertionError(f"ctl {args} failed: {r.stderr}")
        return r

    def event_list(self) -> list[dict]:
        # the node may be writing a line now (or have been killed writing one); its
        # writer thread takes a line within 0.05 s of the event (node/keep/events.py):
        # read once the file has stood still longer than that (a 2 s bound)
        size, deadline = -1, time.monotonic() + 2.0
        while time.monotonic() < deadline:
            now = self.events.stat().st_size if self.events.exists() else 0
            if now == size:
                break
            size = now
            time.sleep(0.1)
        return read_events(self.events)

    def workload(self, kind: str, *args: str, **kw) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gpushare.tools.workloads",
                kind,
                "--socket",
                self.socket,
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            **kw,
        )


def wait_until(pred, timeout: float = 10.0, what: str = "condition", every: float = 0.02):
    """``pred()`` once it is true, looked at every ``every`` seconds: a test waits for
    what it means, not for a time a busy machine may not keep (``timeout`` only bounds
    it, loosely)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


@contextlib.contextmanager
def all_start_together(node: NodeProcess, waiting: int, gpu: int = 0) -> Iterator[None]:
    """Hold the GPU (exclusive mode) until ``waiting`` sessions wait for it, then let
    them go at once: workloads started in the body contend from their first burst, however
    late the machine starts one of them."""
    with gpushare.attach("1MiB", socket=node.socket, name="gate", gpu=gpu) as gate, gate.gpu():
        yield
        wait_until(
            lambda: len(node.status()["gpus"][gpu]["queue"]) >= waiting,
            timeout=60,
            what=f"{waiting} sessions waiting",
        )

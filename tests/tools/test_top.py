"""``gpushare top``: frames fit 80 columns; the live view runs in a real terminal (tmux)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

import pytest

from gpushare.core.clock import ManualClock
from gpushare.node.config import NodeConfig
from gpushare.node.daemon import Node
from gpushare.node.gpus import simulated_gpus
from gpushare.tools.top import ShareTracker, render
from tests.support import sim, wait_until

G = 2**30


def scenario():
    clock = ManualClock()
    node = Node(NodeConfig(metrics_port=0), simulated_gpus(1, 80 * G), clock=clock)
    a = node.arbiters[0]
    a.configure(mode="exclusive", tq_s=5)
    for i, name in enumerate(["a-very-long-session-name-indeed", "b", "c"], start=1):
        a.attach(i, name=name, limit=30 * G)
        a.acquire(i)
    return node, clock


def test_frames_fit_80_columns_and_show_every_session():
    node, clock = scenario()
    clock.advance(3)
    st = node.status()
    lines = render(st, ShareTracker().update(0.0, st), 80)
    assert all(len(x) <= 80 for x in lines)
    text = "\n".join(lines)
    assert "[SIMULATED]" in text and "holding" in text and text.count("waiting") == 2


def test_share_over_the_window():
    node, clock = scenario()
    tr = ShareTracker(window=60)
    tr.update(clock.monotonic(), node.status())
    clock.advance(4)
    shares = tr.update(clock.monotonic(), node.status())
    assert shares[(0, 1)] == pytest.approx(1.0)
    assert shares[(0, 2)] == 0


def test_once_prints_a_frame(node_factory):
    node = node_factory(*sim("16GiB"))
    r = subprocess.run(
        [sys.executable, "-m", "gpushare", "top", "--socket", node.admin, "--once"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0 and "GPU 0" in r.stdout and "no sessions" in r.stdout


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_live_view_in_tmux(node_factory):
    node = node_factory(*sim("80GiB", mode="exclusive", tq="1"))
    procs = [
        node.workload("batch", "--memory", "30GiB", "--seconds", "20", "--name", f"job{i}")
        for i in range(3)
    ]
    sess = f"gstop{time.monotonic_ns()}"
    cmd = f"{sys.executable} -m gpushare top --socket {node.admin}"
    subprocess.run(
        ["tmux", "new-session", "-d", "-s", sess, "-x", "80", "-y", "24", cmd], check=True
    )
    try:

        def screen() -> str:
            return subprocess.run(
                ["tmux", "capture-pane", "-p", "-t", sess], capture_output=True, text=True
            ).stdout

        def shows_all() -> str | None:
            t = screen()
            ok = all(f"job{i}" in t for i in range(3)) and "holding" in t and "waiting" in t
            return t if ok else None

        text = wait_until(shows_all, timeout=20, what="top to show the sessions")
        assert "[SIMULATED]" in text and "exclusive/equal" in text
        assert all(len(line) <= 80 for line in text.splitlines())
        subprocess.run(["tmux", "send-keys", "-t", sess, "q"], check=True)
        wait_until(
            lambda: (
                subprocess.run(["tmux", "has-session", "-t", sess], capture_output=True).returncode
                != 0
            ),
            timeout=10,
            what="q to quit",
        )
    finally:
        subprocess.run(["tmux", "kill-session", "-t", sess], capture_output=True)
        for p in procs:
            p.kill()
            p.wait()


def test_share_over_the_history_for_sessions_older_than_the_window():
    node, clock = scenario()
    clock.advance(10)  # session 1 has held for 10 s
    tr = ShareTracker(window=5)
    tr.update(clock.monotonic(), node.status())
    a = node.arbiters[0]
    a.release(1, resident=0, swapped=0)  # 2 takes over
    clock.advance(4)
    shares = tr.update(clock.monotonic(), node.status())
    assert shares[(0, 1)] == pytest.approx(0.0)  # not since attach (10/14), the last 4 s
    assert shares[(0, 2)] == pytest.approx(1.0)

"""``gpushare top``: frames fit 80 columns; the live view runs in a real terminal (tmux)."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import time

import pytest

import gpushare
from gpushare.core.attach import AttachRecord
from gpushare.core.clock import ManualClock
from gpushare.node.daemon import Node
from gpushare.node.host.gpus import simulated_gpus
from gpushare.node.keep.config import NodeConfig
from gpushare.tools.ctl import show_status
from gpushare.tools.top import render
from gpushare.tools.top_model import ShareTracker
from tests.support import sim, wait_until

G = 2**30


def scenario():
    clock = ManualClock()
    node = Node(NodeConfig(metrics_port=0), simulated_gpus(1, 80 * G), clock=clock)
    a = node.arbiters[0]
    a.set_config({"mode": "exclusive", "tq_s": 5})
    for i, name in enumerate(["a-very-long-session-name-indeed", "b", "c"], start=1):
        a.attach(i, AttachRecord(name=name, memory_limit=30 * G))
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


def test_a_name_too_long_for_its_column_ends_in_a_mark():
    node, _ = scenario()
    st = node.status()
    text = "\n".join(render(st, ShareTracker().update(0.0, st), 80))
    row = next(line for line in text.splitlines() if "holding" in line)
    assert row.split()[0] == "a-very-long-sessi…"  # the holder line above has it whole
    wide = "\n".join(render(st, ShareTracker().update(0.0, st), 120))
    row = next(line for line in wide.splitlines() if "holding" in line)
    assert row.split()[0] == "a-very-long-session-name-indeed"  # room for it: whole


def test_once_json_and_a_pipe_get_one_frame_and_no_drawing_loop(node_factory):
    node = node_factory(*sim("16GiB"))
    with gpushare.attach("1GiB", socket=node.socket, name="trainer") as s:
        top = [sys.executable, "-m", "gpushare", "top", "--socket", node.admin]
        r = subprocess.run([*top, "--once", "--json"], capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        frame = json.loads(r.stdout)
        (row,) = frame["gpus"][0]["sessions"]
        assert (row["id"], row["name"], row["state"]) == (s.id, "trainer", "idle")
        assert 0 <= row["share"] <= 1 and frame["gpus"][0]["simulated"] is True
        # stdin and stdout not a terminal: one frame, a line saying so, exit 0 (issue 16:
        # it kept drawing into the pipe)
        r = subprocess.run(
            top, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30
        )
        assert r.returncode == 0 and r.stdout.count("gpushare top") == 1
        assert "\x1b" not in r.stdout and "trainer" in r.stdout
        assert r.stderr.strip().splitlines() == [
            "gpushare top: not a terminal: one frame printed (--once); run it in a terminal"
            " for the live view"
        ]
        r = subprocess.run([*top, "--json"], capture_output=True, text=True, timeout=30)
        assert r.returncode == 1 and "use it with --once" in r.stderr


needs_tmux = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


class Tmux:
    """A real terminal: tmux runs the command; keys in, the screen out."""

    def __init__(self, cmd: str, width: int = 80, height: int = 24) -> None:
        self.name = f"gstop{time.monotonic_ns()}"
        subprocess.run(
            [
                "tmux",
                "new-session",
                "-d",
                "-s",
                self.name,
                "-x",
                str(width),
                "-y",
                str(height),
                cmd,
            ],
            check=True,
        )

    def screen(self, colours: bool = False) -> str:
        args = ["tmux", "capture-pane", "-p", "-t", self.name] + (["-e"] if colours else [])
        return subprocess.run(args, capture_output=True, text=True).stdout

    def keys(self, *keys: str) -> None:
        subprocess.run(["tmux", "send-keys", "-t", self.name, *keys], check=True)

    def until(self, pred, what: str, timeout: float = 60, colours: bool = False) -> str:
        def shown() -> str | None:
            t = self.screen(colours)
            return t if pred(t) else None

        try:
            return wait_until(shown, timeout, what)
        except AssertionError:
            raise AssertionError(
                f"timed out waiting for {what}; the screen:\n{self.screen()}"
            ) from None

    def press_until(self, key: str, pred, what: str, timeout: float = 60) -> str:
        """``key`` (one that is the same pressed twice: End, Home) pressed again every 5 s
        until the screen shows ``pred``: on a loaded machine a terminal may read an escape
        sequence's bytes apart, and the program then sees Escape and letters (a user
        presses again); once seen, the key did what it says."""
        deadline = time.monotonic() + timeout
        while True:
            self.keys(key)
            try:
                return self.until(pred, what, timeout=min(5.0, deadline - time.monotonic()))
            except AssertionError:
                if time.monotonic() >= deadline - 0.1:
                    raise

    def alive(self) -> bool:
        r = subprocess.run(["tmux", "has-session", "-t", self.name], capture_output=True)
        return r.returncode == 0

    def close(self) -> None:
        subprocess.run(["tmux", "kill-session", "-t", self.name], capture_output=True)


@needs_tmux
def test_live_view_in_tmux(node_factory):
    node = node_factory(*sim("80GiB", mode="exclusive", tq="1"))
    # Until killed (at the end): the screen is read while all three are there, however
    # long a busy machine takes to start them (it was 20 s of work: read after it, 0/0).
    procs = [
        node.workload("batch", "--memory", "30GiB", "--seconds", "600", "--name", f"job{i}")
        for i in range(3)
    ]
    term = Tmux(f"{sys.executable} -m gpushare top --socket {node.admin}")
    try:

        def shows_all(t: str) -> bool:
            return all(f"job{i}" in t for i in range(3)) and "holding" in t and "waiting" in t

        text = term.until(shows_all, "top to show the sessions")
        assert "[SIMULATED]" in text and "exclusive/equal" in text
        assert all(len(line) <= 80 for line in text.splitlines())
        # colour: a waiting state in yellow (SGR 93; one row at most is the highlighted
        # focus, and two wait), the simulated mark in yellow too
        term.until(
            lambda t: "\x1b[93mwaiting" in t and "93m [SIMULATED]" in t,
            "a waiting state and the simulated mark in yellow",
            colours=True,
        )
        term.keys("q")
        wait_until(lambda: not term.alive(), timeout=10, what="q to quit")
    finally:
        term.close()
        for p in procs:
            p.kill()
            p.wait()


@needs_tmux
def test_sort_keys_details_resize_and_scrolling_in_tmux(node_factory):
    node = node_factory(*sim("80GiB", mode="exclusive", tq="1"))
    long_name = "a-very-long-name-for-a-training-job-indeed"
    # 25 sessions: more than 24 rows hold
    sessions = [gpushare.attach("1GiB", socket=node.socket, name=f"s{i:02d}") for i in range(24)]
    sessions.append(gpushare.attach("1GiB", socket=node.socket, name=long_name))
    term = Tmux(f"{sys.executable} -m gpushare top --socket {node.admin} --interval 0.2")
    try:
        text = term.until(lambda t: "s00" in t, "the first sessions")
        assert "a-very-long-na…" not in text  # sorted by share: all 0, by id: it is last
        # scrolling: End brings the last session into view, Home the first back
        term.keys("5")  # sort by memory: all equal, then in id order
        term.until(lambda t: "sort: memory" in t, "the sort by memory")
        text = term.press_until(
            "End", lambda t: "a-very-long-na…" in t, "End to scroll to the last"
        )
        assert "s00" not in text
        term.press_until(
            "Home", lambda t: "s00" in t and "a-very-long" not in t, "Home to scroll back"
        )
        # sort by name, reversed: the long name (a...) last, s23 first
        term.keys("2", "r")
        term.until(lambda t: "sort: name ↑" in t, "the sort to change")

        def first_rows(t: str) -> list[str]:
            return [line.split()[0] for line in t.splitlines() if line.startswith("s")][:3]

        # the focus followed s00 down: Home, back to the top
        term.press_until("Home", lambda t: first_rows(t) == ["s23", "s22", "s21"], "s23 first")
        # the focused session's details
        term.keys("Enter")
        text = term.until(lambda t: "memory_limit_bytes" in t, "the details")
        assert "session" in text and "s23" in text and "(1.0 GiB)" in text
        term.keys("Escape")
        term.until(lambda t: "SESSION" in t, "Escape to go back")
        # resize: wider, the long name whole; narrower, cut with its mark again
        subprocess.run(["tmux", "resize-window", "-t", term.name, "-x", "130"], check=True)
        term.keys("6")  # by id: the long name last
        term.until(lambda t: "sort: id" in t, "the sort by id")
        text = term.press_until(
            "End", lambda t: long_name in t, "the long name whole at 130 columns"
        )
        assert max(len(line) for line in text.splitlines()) > 80
        subprocess.run(["tmux", "resize-window", "-t", term.name, "-x", "80"], check=True)
        term.press_until("End", lambda t: "a-very-long-na…" in t, "the mark again at 80 columns")
        term.keys("h")
        term.until(lambda t: "this help" in t, "the help")
        term.keys("x")
        term.until(lambda t: "SESSION" in t, "any key back from the help")
        term.keys("q")
        wait_until(lambda: not term.alive(), timeout=10, what="q to quit")
    finally:
        term.close()
        for s in sessions:
            s.close()


@needs_tmux
def test_the_live_view_without_its_library_says_what_to_install(node_factory):
    node = node_factory(*sim("16GiB"))
    code = (
        "import sys; sys.modules['urwid'] = None; from gpushare.tools.cli import main;"
        f" sys.exit(main(['top', '--socket', '{node.admin}']))"
    )
    term = Tmux(f'{sys.executable} -c "{code}"; echo exit=$?; sleep 30')
    try:
        text = term.until(lambda t: "exit=" in t, "top to exit")
        assert "gpushare top: error: the live view needs urwid: pip install 'gpushare[cli]'" in text
        assert "exit=1" in text and "Traceback" not in text
    finally:
        term.close()


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


def test_enter_on_a_heading_opens_the_first_session_below_it():
    # Home scrolls to the GPU's heading; Enter before the next refresh opened nothing (CI saw it)
    urwid = pytest.importorskip("urwid")
    from gpushare.tools.top_ui import TopView

    node, _clock = scenario()
    view = TopView(client=None, interval=1)  # type: ignore[arg-type]
    view.status = node.status()
    view.sort = "name"
    view.draw()
    view.walker.set_focus(0)  # what Home does: the heading, not a row
    assert view.focused() is None
    view.key("enter")
    assert view.detail == (0, 1)  # "a-very-long-..." sorts first by name
    text = " ".join(w.text for w in view.walker if isinstance(w, urwid.Text))
    assert "memory_limit_bytes" in text


def test_the_ranks_of_a_job_show_together_as_one_holder():
    clock = ManualClock()
    node = Node(NodeConfig(metrics_port=0), simulated_gpus(1, 80 * G), clock=clock)
    a = node.arbiters[0]
    a.set_config({"mode": "exclusive", "tq_s": 1})
    for i, name, job in ((1, "r0", "job7@uid:1000"), (2, "solo", ""), (3, "r1", "job7@uid:1000")):
        a.attach(
            i, AttachRecord(name=name, memory_limit=10 * G, gang=job, gang_size=2 if job else 0)
        )
        a.acquire(i)
    st = node.status()
    line = render(st, ShareTracker().update(0.0, st), 80)[3]
    assert line.split("   ") == ["  holder: job7 [r0, r1]", "queue: solo"]
    clock.advance(1)
    a.tick()
    a.release(1, resident=0, swapped=0, again=True)  # r0 yields first: parked
    st = node.status()
    assert "holder: job7 [r1]   queue: solo, job7 [(r0)]" in render(st, {}, 80)[3]


def _a_server_after_one_turn() -> Node:
    """A node whose server (session 2) took one turn ahead of a batch job."""
    clock = ManualClock()
    node = Node(NodeConfig(metrics_port=0), simulated_gpus(1, 80 * G), clock=clock)
    a = node.arbiters[0]
    a.set_config({"mode": "exclusive", "tq_s": 30, "turn_s": 1.0})
    a.attach(1, AttachRecord(name="batch", memory_limit=30 * G))
    a.attach(2, AttachRecord(name="server", memory_limit=10 * G))
    a.acquire(2)  # its first burst, alone: 0.2 s
    clock.advance(0.2)
    a.release(2, resident=G, swapped=0)
    clock.advance(1.0)
    a.tick()  # its window passed
    a.acquire(1)
    clock.advance(3.0)
    a.acquire(2)  # a request: a turn ahead of the batch job
    a.release(1, resident=G, swapped=0, again=True)
    clock.advance(0.3)
    a.release(2, resident=G, swapped=0)
    return node


def test_a_sessions_turn_figures_are_in_status_top_and_the_metrics():
    """Issue 28: an operator could not see why a server took no turns. Its credit, usual
    burst and measured use are in its status row, top's JSON frame and the exporter."""
    from gpushare.node.observe.metrics import Exposition
    from gpushare.tools.top import frame_json

    node = _a_server_after_one_turn()
    a = node.arbiters[0]
    (row,) = [s for s in node.status().gpus[0].sessions if s.name == "server"]
    assert row.turns_total == 1 and row.usual_burst_seconds == pytest.approx(0.2)
    assert row.turn_credit_seconds == pytest.approx(a.sessions[2].share.credit)
    assert row.turn_credit_seconds > 0
    assert 0 < row.measured_use_ratio < 1 and row.turn_credit_rate > 0
    st = node.status()
    shown = {s["name"]: s for s in frame_json(st, {})["gpus"][0]["sessions"]}
    assert shown["server"]["usual_burst_seconds"] == pytest.approx(0.2)
    text = Exposition().render(st).decode()
    lines = text.splitlines()
    (line,) = [x for x in lines if x.startswith("gpushare_turn_credit_seconds{") and 'n="2"' in x]
    assert float(line.split()[-1]) == pytest.approx(row.turn_credit_seconds)
    assert any(x.startswith("gpushare_turns_total{") and 'n="2"' in x for x in lines)


def test_a_sessions_turn_figures_are_in_the_text_of_top_and_ctl_status():
    """Issue 40: credit and usual burst were in --json and the metrics only."""
    st = _a_server_after_one_turn().status()
    (row,) = [s for s in st.gpus[0].sessions if s.name == "server"]
    text = "\n".join(render(st, {}, 80))
    assert f"turns  server: credit {row.turn_credit_seconds:.2f} s, usual burst 0.20 s" in text
    assert all(len(x) <= 80 for x in text.splitlines())
    out = io.StringIO()
    show_status(st, out)
    head, srv = [x for x in out.getvalue().splitlines() if "CREDIT s" in x or " server " in x]
    assert head.split()[-4:] == ["CREDIT", "s", "BURST", "s"]
    assert srv.split()[-2:] == [f"{row.turn_credit_seconds:.2f}", "0.20"]

"""The mistakes a person makes at the command line (issue 16), each driven as a person
would, through the real ``gpushare`` command: every one is answered with one clear line
on stderr and a non-zero exit, never a traceback."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import gpushare
from gpushare.errors import GpushareError
from gpushare.tools.admin import AdminClient
from tests.node.observe.test_metrics import free_port
from tests.support import REPO, sim, wait_until

GPUSHARE = [sys.executable, "-m", "gpushare"]


def gpushare_cmd(*args: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*GPUSHARE, *args], capture_output=True, text=True, timeout=timeout, **kw)


def one_line(r: subprocess.CompletedProcess[str], code: int | None = None) -> str:
    """The one line on stderr of a command that failed (with ``code``, if given)."""
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert r.returncode != 0 if code is None else r.returncode == code, (r.returncode, r.stderr)
    return lines[0]


# --- settings: one validation whichever way they arrive ------------------------------

BAD_FILES = [
    ("tq = -5", "TQ must be positive"),
    ("tq = 0", "TQ must be positive"),
    ("tq = 1e12", "TQ must be a number of seconds from 0.05 s to 86400 s (1 d), not 1e+12"),
    ("grace = -1", "grace must be positive"),
    ("idle_release = -3", "idle_release must be positive"),
    ("max_sessions_per_uid = -1", "max_sessions_per_uid must be a whole number from 1"),
    ("sim_bandwidth = 0", "sim_bandwidth must be a number from"),
    ("sim_swap_failure_rate = 7", "sim_swap_failure_rate must be a number from 0 to 1, not 7"),
    ("metrics_port = 99999", "metrics_port must be a whole number from 0 to 65535"),
    ("[gpu.5]\ntq = 3", "[gpu.5]: this node has 1 GPU (0..0)"),
]


@pytest.mark.parametrize(("text", "words"), BAD_FILES, ids=[t for t, _ in BAD_FILES])
def test_a_bad_value_in_the_config_file_stops_the_node_at_start(short_tmp, text, words):
    cfg = short_tmp / "node.toml"
    cfg.write_text(text + "\n")
    r = gpushare_cmd(
        "node", "--config", str(cfg), *sim("1GiB"), "--metrics-port", "0",
        "--socket", str(short_tmp / "w.sock"), "--admin-socket", str(short_tmp / "a.sock"),
    )  # fmt: skip
    line = one_line(r, 2)
    assert words in line and line.startswith("gpushare node: error:")
    assert not (short_tmp / "w.sock").exists()


@pytest.mark.parametrize(
    ("flag", "words"),
    [
        (["--tq", "-5"], "TQ must be positive"),
        (["--tq", "1e9"], "to 86400 s (1 d), not 1e+09"),
        (["--tq", "1000000000"], "to 86400 s (1 d), not 1e+09"),  # the same as 1e9
        (["--grace", "-1"], "grace must be positive"),
        (["--metrics-port", "99999"], "metrics_port must be a whole number from 0 to 65535"),
        (["--sim-swap-failure-rate", "7"], "sim_swap_failure_rate must be a number from 0 to 1"),
    ],
)
def test_the_same_values_are_refused_on_the_command_line_in_the_same_words(flag, words):
    line = one_line(gpushare_cmd("node", *sim("1GiB"), *flag), 2)
    assert words in line and line.startswith("gpushare node: error: argument")


@pytest.fixture
def node(node_factory):
    return node_factory(*sim("16GiB", mode="exclusive", tq="30"))


def ctl(node, *args: str, **kw) -> subprocess.CompletedProcess[str]:
    return gpushare_cmd("ctl", "--socket", node.admin, *args, **kw)


def test_ctl_tq_shows_sets_and_refuses(node):
    r = ctl(node, "tq")
    assert r.returncode == 0 and r.stdout.startswith("GPU 0: TQ 30 s")
    r = ctl(node, "tq", "--json")
    assert json.loads(r.stdout)["gpus"][0]["tq_s"] == 30
    r = ctl(node, "tq", "5m", "--json")
    assert json.loads(r.stdout)["gpus"] == [
        {"index": 0, "tq_s": 300.0, "mode": "exclusive", "policy": "equal", "escalation": "log"}
    ]
    assert "must be positive" in one_line(ctl(node, "tq", "-5"), 2)  # not "unreadable"
    assert "must be positive" in one_line(ctl(node, "tq", "-5m"), 2)  # not an unknown option
    big = [one_line(ctl(node, "tq", v), 2).split("error: ")[1] for v in ("1e9", "1000000000")]
    assert big[0] == big[1] and "to 86400 s (1 d)" in big[0]
    assert "no GPU 3 on this node" in one_line(ctl(node, "tq", "--gpu", "3"), 1)
    assert "no GPU 3 on this node" in one_line(ctl(node, "tq", "5", "--gpu", "3"), 1)
    r = ctl(node, "tq", "--help")
    assert r.returncode == 0 and "5m" in r.stdout and "1d" in r.stdout
    assert node.status()["gpus"][0]["tq_s"] == 300  # the refusals changed nothing
    refused = [e for e in node.event_list() if e["event"] == "config_refused"]
    assert [e["source"] for e in refused] == ["ctl"]  # the one that reached the node


def test_the_admin_client_sets_a_change_and_names_what_only_the_file_sets(node):
    with AdminClient(node.admin) as c:
        r = c.set_config({"tq_s": 12.0, "policy": "weighted"}, gpu=0)
        assert [(g.tq_s, g.policy) for g in r.gpus] == [(12.0, "weighted")]
        with pytest.raises(GpushareError, match="idle_release, overlap: not changed over"):
            c.set_config({"overlap": False, "anticipate_s": 1.0, "tq_s": 5.0})
    assert node.status()["gpus"][0]["tq_s"] == 12  # the refused change sent nothing
    (config,) = [e for e in node.event_list() if e["event"] == "config"]
    assert (config["tq_s"], config["policy"]) == (12.0, "weighted")


def test_socket_before_or_after_the_subcommand(node):
    for args in (
        ["ctl", "status", "--socket", node.admin],
        ["ctl", "--admin-socket", node.admin, "status"],
        ["--socket", node.admin, "ctl", "status"],
        ["--socket", node.admin, "top", "--once"],
        ["top", "--once", "--admin-socket", node.admin],
    ):
        r = gpushare_cmd(*args)
        assert r.returncode == 0 and "GPU 0" in r.stdout, (args, r.stderr)


def test_the_wrong_socket_is_named_with_the_right_one(node):
    for args in (
        ["ctl", "--socket", node.socket, "status"],
        ["top", "--socket", node.socket, "--once"],
        ["ctl", "events", "--socket", node.socket],
    ):
        line = one_line(gpushare_cmd(*args), 1)
        assert f"{node.socket} is this node's workload socket" in line
        assert f"its admin socket, {node.admin}" in line
    r = gpushare_cmd("run", "--socket", node.admin, "--", sys.executable, "-c", "print(1)")
    line = one_line(r, 3)
    assert f"{node.admin} is this node's admin socket" in line
    assert f"its workload socket, {node.socket}" in line


def test_a_reader_that_goes_away_is_no_traceback(node):
    for i in range(30):  # enough events that the output outlasts the reader
        with gpushare.attach("1MiB", socket=node.socket, name=f"s{i}"):
            pass
    for args in (["status"], ["events"], ["status", "--json"]):
        # a reader gone before anything is written: the write fails for certain
        p = subprocess.Popen(
            [*GPUSHARE, "ctl", "--socket", node.admin, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert p.stdout is not None and p.stderr is not None
        p.stdout.close()
        assert p.wait(timeout=30) == 141  # as `yes | head` ends: SIGPIPE's status
        assert p.stderr.read() == ""
        p.stderr.close()
        # and the way a person does it
        r = subprocess.run(
            f"{' '.join(GPUSHARE)} ctl --socket {node.admin} {' '.join(args)} | head -n 1",
            shell=True,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert r.stdout.count("\n") == 1 and r.stderr == ""


def test_a_busy_metrics_port_is_a_clear_error_before_anything_is_up(short_tmp):
    port = free_port()
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", port))
        busy.listen()
        w, a = short_tmp / "w.sock", short_tmp / "a.sock"
        r = gpushare_cmd(
            "node", *sim("1GiB"), "--metrics-port", str(port),
            "--socket", str(w), "--admin-socket", str(a),
        )  # fmt: skip
    line = one_line(r, 2)  # nothing logged as up before it
    assert f"metrics port 0.0.0.0:{port}: Address already in use" in line
    assert "--metrics-port PORT" in line
    assert not w.exists() and not a.exists() and not list(short_tmp.glob("w.sock*"))


def test_a_node_running_on_the_same_socket_is_left_alone(node, short_tmp):
    r = gpushare_cmd(
        "node", *sim("1GiB"), "--metrics-port", "0",
        "--socket", node.socket, "--admin-socket", str(short_tmp / "other-a.sock"),
    )  # fmt: skip
    assert f"another gpushare node is serving {node.socket}" in one_line(r, 2)
    assert Path(node.socket).exists() and node.status()["gpus"]  # the first one serves on


def test_following_events_when_the_node_stops_ends_with_a_line(node):
    with gpushare.attach("1MiB", socket=node.socket, name="ping"):
        pass  # an event in the backlog: the follower prints it once connected
    p = subprocess.Popen(
        [*GPUSHARE, "ctl", "--socket", node.admin, "events", "--follow"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stdout is not None and '"event":"attach"' in p.stdout.readline()
        node.stop()
        _, err = p.communicate(timeout=30)
    finally:
        p.kill()
    assert p.returncode == 1 and "Traceback" not in err
    assert err.strip().splitlines() == [
        f"gpushare ctl: error: the node at {node.admin} closed the event stream: it stopped"
        " or restarted (the events are in its --event-log, if it keeps one)"
    ]


def test_long_names_are_shown_whole_in_ctl_status(node):
    name = "a-very-long-training-job-name-on-gpu0"
    with gpushare.attach("1GiB", socket=node.socket, name=name):
        r = ctl(node, "status")
    row = next(line for line in r.stdout.splitlines() if "idle" in line)
    assert row.split()[1] == name


def test_shell_completion(tmp_path):
    r = gpushare_cmd("completion", "bash")
    assert r.returncode == 0 and "complete" in r.stdout and "gpushare" in r.stdout
    out = tmp_path / "completions"
    env = {
        **os.environ,
        "_ARGCOMPLETE": "1",
        "COMP_LINE": "gpushare ctl st",
        "COMP_POINT": "15",
        "_ARGCOMPLETE_STDOUT_FILENAME": str(out),
    }
    subprocess.run([*GPUSHARE], env=env, timeout=60, check=True, capture_output=True)
    assert out.read_text().split() == ["status"]
    code = "import sys; sys.modules['argcomplete'] = None; from gpushare.tools.cli import main"
    code += "; sys.exit(main(['completion']))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "shell completion needs argcomplete: pip install 'gpushare[cli]'" in one_line(r, 1)


# --- gpushare run --------------------------------------------------------------------

HOLD = (
    "import time\n"
    "from gpushare.client.runner import SESSION\n"
    "with SESSION.gpu():\n"
    "    print('holding', flush=True)\n"
    "    time.sleep(60)\n"  # GPU work until its session is ended (60 s at most)
    "print('finished normally')\n"
)


def test_run_says_it_attached_and_stops_when_its_session_is_ended(node):
    p = subprocess.Popen(
        [
            *GPUSHARE,
            "run",
            "--socket",
            node.socket,
            "--memory",
            "1GiB",
            "--name",
            "job",
            "--",
            sys.executable,
            "-c",
            HOLD,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stdout is not None and p.stdout.readline() == "holding\n"
        (s,) = node.status()["gpus"][0]["sessions"]
        assert ctl(node, "end", str(s["id"]), "--grace", "0").returncode == 0
        out, err = p.communicate(timeout=30)
    finally:
        p.kill()
    assert p.returncode != 0 and "finished normally" not in out and "Traceback" not in err
    assert err.splitlines() == [
        f"gpushare run: attached as session {s['id']} (job) on GPU 0 (Simulated GPU (16.0 GiB),"
        " simulated), memory limit 1.0 GiB, TQ 30 s",
        "gpushare run: error: session ended: ended by an administrator: stopping the program"
        " (SIGTERM, SIGKILL after 10 s)",
    ]
    events = node.event_list()
    mine = [e for e in events if e.get("session") == s["id"]]
    assert [e["event"] for e in mine][-2:] == ["release", "detach"]
    assert mine[-2]["reason"] == "ended" and mine[-1]["reason"] == "ended"


def test_run_ended_while_waiting_for_the_lease_stops_without_a_traceback(node):
    # The program waits in a gated call when its session is ended: it is stopped there,
    # not left to raise from inside PyTorch's hook (seen following the README).
    wait = "from gpushare.client.runner import SESSION\nprint('asking', flush=True)\n"
    wait += "with SESSION.gpu():\n    print('granted', flush=True)\n"
    with gpushare.attach("1GiB", socket=node.socket, name="holder") as holder, holder.gpu():
        p = subprocess.Popen(
            [*GPUSHARE, "run", "--socket", node.socket, "--memory", "1GiB", "--name", "waiter",
             "--", sys.executable, "-c", wait],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        try:
            assert p.stdout is not None and p.stdout.readline() == "asking\n"
            waiter = wait_until(
                lambda: next(
                    (s for s in node.status()["gpus"][0]["sessions"] if s["state"] == "waiting"),
                    None,
                ),
                timeout=30,
                what="the program to wait for the lease",
            )
            assert ctl(node, "end", str(waiter["id"]), "--grace", "0").returncode == 0
            out, err = p.communicate(timeout=30)
        finally:
            p.kill()
    assert p.returncode == -15 and "granted" not in out  # SIGTERM, as a deleted pod
    assert "Traceback" not in err and err.splitlines()[-1] == (
        "gpushare run: error: session ended: ended by an administrator: stopping the program"
        " (SIGTERM, SIGKILL after 10 s)"
    )


def test_run_memory_mistakes_speak_in_sizes(node):
    r = gpushare_cmd("run", "--socket", node.socket, "--memory", "200GiB", "--", sys.executable)
    assert one_line(r, 3) == (
        "gpushare run: error: memory limit 200.0 GiB is more than GPU 0's usable 16.0 GiB: ask"
        " for 16.0 GiB or less (gpushare run --memory SIZE, or GPUSHARE_MEMORY)"
    )
    r = gpushare_cmd("run", "--memory", "-1GiB", "--", sys.executable)  # a value, not an option
    assert one_line(r, 2) == "gpushare run: error: --memory: size must not be negative: -1GiB"
    r = gpushare_cmd("run", "--memory", "lots", "--", sys.executable)
    assert "cannot read size 'lots'" in one_line(r, 2)


def test_usage_mistakes_are_one_line(node):
    for args in (["ctl"], ["ctl", "tq", "5", "--gpu", "x"], ["bogus"], ["ctl", "end"]):
        line = one_line(gpushare_cmd(*args), 2)
        assert "error:" in line and "--help" in line


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="PyTorch is not installed")
def test_the_readme_example_programs_take_turns_gated(node_factory):
    # README step 3: two unmodified PyTorch loops under gpushare run, 10 + 10 GiB on 16
    node = node_factory(*sim("16GiB", mode="exclusive", tq="0.5"))
    train = str(REPO / "deploy" / "examples" / "train.py")
    procs = {
        name: subprocess.Popen(
            [
                *GPUSHARE,
                "run",
                "--socket",
                node.socket,
                "--memory",
                "10GiB",
                "--name",
                name,
                "--",
                sys.executable,
                train,
                "--steps",
                "100",
                "--step-seconds",
                "0.02",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in ("train-a", "train-b")
    }
    for name, p in procs.items():
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        assert "attached as session" in err and f"({name}) on GPU 0" in err
        assert "memory limit 10.0 GiB, TQ 0.5 s" in err
        assert "step 100 loss" in out
    events = node.event_list()
    sessions = {e["session"]: e["name"] for e in events if e["event"] == "attach"}
    grants = [sessions[e["session"]] for e in events if e["event"] == "grant"]
    assert {"train-a", "train-b"} <= set(grants)
    assert any(e["event"] == "revoke" for e in events)  # they took turns


@pytest.mark.parametrize(
    "argv", [["node", "--sim-gpu", "1"], ["run", "--mem", "4GiB", "--", "true"]]
)
def test_an_abbreviated_option_is_not_taken_for_the_whole_one(argv, capsys):
    # `node --sim-gpu 1` passed for --sim-gpus and started a real node on the default paths
    from gpushare.tools.cli import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2
    assert "unrecognized arguments: " + argv[1] in capsys.readouterr().err

"""Faults survived, with real processes: crashes, hangs, node restarts, failing swaps,
sessions over their limit, and workloads reaching for what is not theirs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import gpushare
from gpushare.errors import DaemonUnavailableError
from tests.support import all_start_together, sim, wait_until

G = 2**30

STUBBORN = """
import sys, time, gpushare
s = gpushare.attach("4GiB", socket=sys.argv[1], name="stubborn")
with s.gpu():
    print("holding", flush=True)
    time.sleep(float(sys.argv[2]))  # GPU work with no checkpoint: it never yields
print("done", flush=True)
"""


def proc_state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def stubborn(node, seconds: float = 30.0) -> subprocess.Popen[str]:
    pr = subprocess.Popen(
        [sys.executable, "-c", STUBBORN, node.socket, str(seconds)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert pr.stdout is not None and pr.stdout.readline().strip() == "holding"
    return pr


def events(node, kind: str) -> list[dict]:
    return [e for e in node.event_list() if e["event"] == kind]


def test_holder_that_ignores_revoke_is_frozen_then_thawed(node_factory):
    node = node_factory(*sim("16GiB", mode="exclusive", tq="0.3", grace="0.3", escalation="freeze"))
    pr = stubborn(node, seconds=3.0)
    try:
        with gpushare.attach("4GiB", socket=node.socket, name="patient") as s:
            t0 = time.monotonic()
            with s.gpu():  # granted once the stubborn one is frozen
                # stopped by SIGSTOP: 'T' once the process runs to take the signal
                wait_until(lambda: proc_state(pr.pid) == "T", timeout=5, what="stopped")
                waited = time.monotonic() - t0
        assert waited < 5
        # its turn comes again: thawed (SIGCONT), it finishes its sleep and its burst
        out, _ = pr.communicate(timeout=30)
        assert "done" in out and pr.returncode == 0
        esc = events(node, "escalate")
        assert esc and esc[0]["action"] == "freeze" and esc[0]["reason"] == "no_yield_within_grace"
        assert any(e["reason"] == "frozen" for e in events(node, "release"))
    finally:
        if pr.poll() is None:
            os.kill(pr.pid, signal.SIGCONT)
            pr.kill()


def test_holder_that_ignores_revoke_is_killed(node_factory):
    node = node_factory(*sim("16GiB", mode="exclusive", tq="0.3", grace="0.3", escalation="kill"))
    pr = stubborn(node)
    with gpushare.attach("4GiB", socket=node.socket, name="patient") as s, s.gpu():
        assert s.holding
    assert pr.wait(timeout=10) == -signal.SIGKILL
    assert events(node, "escalate")[0]["action"] == "kill"


def test_escalation_log_only_logs(node_factory):
    node = node_factory(*sim("16GiB", mode="exclusive", tq="0.2", grace="0.2", escalation="log"))
    pr = stubborn(node, seconds=1.5)
    with gpushare.attach("4GiB", socket=node.socket) as s, s.gpu():
        pass  # granted only when the stubborn burst ends by itself
    assert pr.wait(timeout=10) == 0
    assert events(node, "escalate")[0]["action"] == "log"
    assert "escalation log" in node.log.read_text()


def two_batch_jobs(node, seconds: float) -> list[subprocess.Popen[str]]:
    """Two 6 GiB batch sessions that wait up to 30 s for a node that went away."""
    env = {**os.environ, "GPUSHARE_RECONNECT_TIMEOUT": "30"}
    return [
        node.workload(
            "batch", "--memory", "6GiB", "--seconds", str(seconds), "--seed", str(i),
            "--name", f"w{i}", env=env,
        )
        for i in (1, 2)
    ]  # fmt: skip


def kill_and_restart(node, away: float) -> None:
    node.proc.send_signal(signal.SIGKILL)
    node.proc.wait()
    time.sleep(away)  # the workloads carry on (or wait) without it
    node.start()


def finished_intact(procs: list[subprocess.Popen[str]]) -> None:
    outs = [pr.communicate(timeout=60) for pr in procs]
    assert [pr.returncode for pr in procs] == [0, 0], [err[-500:] for _, err in outs]
    figures = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert all(f["failures"] == 0 and f["checks"] >= 1 for f in figures), figures


@pytest.mark.slow
def test_node_killed_and_restarted_loses_nothing(node_factory):
    node = node_factory(*sim("10GiB", mode="exclusive", tq="0.3", sim_bandwidth="1e12"))
    procs = two_batch_jobs(node, 6)
    # killed mid-run: once each session has been swapped out at least once (12 GiB on a
    # 10 GiB GPU), so that both hold memory on the GPU and on the host to lose
    wait_until(lambda: {e["session"] for e in events(node, "swap_out")} >= {1, 2},
               timeout=60, what="both sessions swapped out")  # fmt: skip
    kill_and_restart(node, 1.0)
    finished_intact(procs)
    resumed = [e for e in events(node, "attach") if e.get("resumed")]
    assert len(resumed) == 2
    assert sum(e["resident_bytes"] + e["swapped_bytes"] for e in resumed) == 12 * G


@pytest.mark.slow
def test_node_killed_during_an_overlapped_switch_loses_nothing(node_factory):
    # A slow modelled link (2 GB/s): each switch moves 2 GiB each way over a second, and
    # the incoming session spends it waiting for room. The node dies right then.
    node = node_factory(*sim("10GiB", mode="exclusive", tq="0.5", sim_bandwidth="2e9"))
    procs = two_batch_jobs(node, 8)

    def filling() -> bool:
        return any(e.get("room_bytes") for e in events(node, "grant"))

    wait_until(filling, timeout=20, what="an overlapped switch")
    kill_and_restart(node, 0.5)
    finished_intact(procs)
    assert len([e for e in events(node, "attach") if e.get("resumed")]) == 2


@pytest.mark.slow
def test_failing_swaps_are_survived(node_factory):
    # 30 bursts, each a swap cycle: 30% of the swap-outs fail (each costs the node a
    # second's wait before it asks again); P(none fails, or none succeeds) < 1e-4.
    node = node_factory(
        *sim(
            "10GiB",
            mode="exclusive",
            tq="5",
            sim_bandwidth="1e13",
            sim_swap_failure_rate="0.3",
            idle_release="0.02",  # each burst's end a switch (workloads.cycles)
        )
    )
    with all_start_together(node, waiting=2):
        procs = [
            node.workload(
                "cycles", "--memory", "6GiB", "--bursts", "15", "--seconds", "60", "--seed", str(i)
            )
            for i in (1, 2)
        ]
    outs = [json.loads(pr.communicate(timeout=90)[0].strip().splitlines()[-1]) for pr in procs]
    assert all(o["failures"] == 0 for o in outs)
    failed = [e for e in events(node, "swap_out") if e.get("error")]
    ok = [e for e in events(node, "swap_out") if not e.get("error")]
    assert failed and ok
    assert "host memory exhausted" in failed[0]["error"]


def test_admin_can_end_a_session(node_factory):
    node = node_factory(*sim("16GiB"))
    s = gpushare.attach("1GiB", socket=node.socket, name="doomed")
    r = node.ctl("end", str(s.id), "--reason", "maintenance", "--grace", "0")
    assert f"session {s.id} ended" in r.stdout
    wait_until(lambda: s._fatal, what="the session to learn it was ended")
    with pytest.raises(DaemonUnavailableError, match="maintenance"), s.gpu():
        pass
    s.close()
    assert node.ctl("end", "999", check=False).returncode == 1


def test_an_end_with_a_grace_tells_the_session_and_ends_it_after(node_factory):
    node = node_factory(*sim("16GiB"))
    s = gpushare.attach("1GiB", socket=node.socket, name="draining")
    r = node.ctl("end", str(s.id), "--reason", "maintenance", "--grace", "1h")
    assert "keeps its turns for 3600 s" in r.stdout, r.stdout
    wait_until(lambda: s._link.ending is not None, what="the session to be told")
    assert s._link.ending.reason == "maintenance" and s._link.ending.grace_s == 3600
    with s.gpu():  # its turns go on within its grace
        pass
    assert not s._fatal
    # A second end without a grace ends it now; one with a grace changes nothing.
    assert "ending" in node.ctl("end", str(s.id), "--grace", "5s").stdout
    assert f"session {s.id} ended" in node.ctl("end", str(s.id), "--grace", "0").stdout
    wait_until(lambda: s._fatal, what="the session to learn it was ended")
    s.close()


def _status_as(path: str, uid: int, gid: int) -> str:
    """Ask for status as another user (a forked child drops to uid/gid); returns
    "ok" or the error."""
    from gpushare.tools.admin import AdminClient

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            with AdminClient(path) as c:
                c.status()
            os.write(w, b"ok")
        except BaseException as e:
            os.write(w, str(e).encode()[:1000])
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    out = os.read(r, 4096).decode()
    os.close(r)
    return out


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_admin_socket_admits_root_and_the_admin_group_only(node_factory, short_tmp):
    os.chmod(short_tmp, 0o755)
    node = node_factory(*sim("16GiB", admin_group="65534"))
    assert _status_as(node.admin, 65534, 65534) == "ok"  # in the group
    assert "permission denied" in _status_as(node.admin, 65534, 65533)  # the socket's mode
    os.chmod(node.admin, 0o666)  # loosened by hand: the peer check still holds
    assert "may not administer" in _status_as(node.admin, 65534, 65533)
    assert events(node, "refused")[-1]["uid"] == 65534

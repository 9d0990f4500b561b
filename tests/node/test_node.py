"""The node daemon with real workload processes over its real sockets: acceptance runs,
the command line against a running node, and what needs a process of its own (its
socket, its exit code, its restart). The node's logic alone is tested in process
(test_workload_server, test_admin_server, test_dispatch, test_live_config)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import gpushare
from gpushare.tools.report import switches
from tests.support import NodeProcess, all_start_together, sim, wait_until

G = 2**30


@pytest.mark.slow
def test_oversubscribed_sessions_survive_1000_swap_cycles(node_factory):
    # Two sessions of 6 GiB on a 10 GiB GPU: a handoff swaps whenever the other waits
    # (nearly always: 1200 bursts leave room for a tenth that did not, as seen under
    # load). Fast modelled link.
    # each burst's end a switch (workloads.cycles)
    node = node_factory(
        *sim("10GiB", mode="exclusive", tq="5", sim_bandwidth="1e13", idle_release="0.02")
    )
    with all_start_together(node, waiting=2):  # both cycling from the first burst
        procs = [
            node.workload(
                "cycles", "--memory", "6GiB", "--bursts", "600", "--seconds", "240",
                "--seed", str(i), "--name", f"c{i}",
            )
            for i in (1, 2)
        ]  # fmt: skip
    outs = [json.loads(pr.communicate(timeout=280)[0].strip().splitlines()[-1]) for pr in procs]
    assert all(pr.returncode == 0 for pr in procs)
    assert all(o["failures"] == 0 for o in outs), outs
    ev = node.event_list()
    swap_ins = [e for e in ev if e["event"] == "swap_in" and e["bytes"] > 0]
    assert len(swap_ins) >= 1000
    assert sum(o["checks"] for o in outs) >= 1000  # each a full pattern check after a swap-in
    assert not [e for e in ev if e.get("error")]


@pytest.mark.slow
def test_acceptance_three_30gib_on_80gib_exclusive_tq1(node_factory):
    node = node_factory(*sim("80GiB", mode="exclusive", tq="1"))
    procs = [
        node.workload(
            "batch", "--memory", "30GiB", "--seconds", "12", "--name", f"job{i}", "--seed", str(i)
        )
        for i in range(3)
    ]
    samples, outs = sampled_until_done(node, procs)
    assert all(o["failures"] == 0 for o in outs)
    assert_exclusive_within_capacity(samples, 80 * G)
    # the events: revokes at quantum ends, swaps, and fair shares
    ev = node.event_list()
    kinds = {e["event"] for e in ev}
    assert {"attach", "grant", "revoke", "release", "swap_out", "swap_in", "detach"} <= kinds
    releases = [e for e in ev if e["event"] == "release"]
    leases = whole_rounds_revoked(releases)
    assert len(leases) >= 3, [(e["session"], e["reason"]) for e in releases]
    for i in range(0, len(leases), 3):  # each round serves each session once
        assert {e["session"] for e in leases[i : i + 3]} == {1, 2, 3}, leases
    held = {s: sum(e["seconds"] for e in leases if e["session"] == s) for s in (1, 2, 3)}
    assert min(held.values()) > 0.7 * max(held.values()), held


def sampled_until_done(
    node: NodeProcess, procs: list[subprocess.Popen[str]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """GPU 0's status, a look every 50 ms while any of ``procs`` runs (the invariants hold
    in every one), and each process's summary once they are done."""
    samples = []
    while any(pr.poll() is None for pr in procs):
        st = node.status()["gpus"][0]
        samples.append(st)
        time.sleep(0.05)
    outs = [json.loads(pr.communicate()[0].strip().splitlines()[-1]) for pr in procs]
    return samples, outs


def assert_exclusive_within_capacity(samples: list[dict[str, Any]], cap: int) -> None:
    """Exclusive access and no capacity overrun, as status showed it all along."""
    assert all(len(s["holders"]) <= 1 for s in samples)
    assert all(s["used_bytes"] <= cap for s in samples)
    assert any(s["simulated"] for s in samples)
    assert max(sum(x["swapped_bytes"] for x in s["sessions"]) for s in samples) > 0


def whole_rounds_revoked(releases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The releases of whole round-robin rounds while all three contend: the quanta
    revoked one after another, once each has had its first (its memory filled in a first
    burst, the rest of that quantum continued after it: as short as the fill was long on
    a loaded machine) and until a burst ends (over 12 s, a partial last round would weigh
    one quantum against none)."""
    start = 1 + max(
        next(i for i, e in enumerate(releases) if e["session"] == s and e["reason"] == "revoked")
        for s in (1, 2, 3)
    )
    leases = []
    for e in releases[start:]:
        if e["reason"] != "revoked":
            break
        leases.append(e)
    return leases[: len(leases) // 3 * 3]


def test_killed_holder_lease_goes_to_next_waiter(node_factory):
    node = node_factory(*sim("80GiB", mode="exclusive", tq="60"))
    holder = node.workload("batch", "--memory", "10GiB", "--seconds", "60", "--name", "holder")
    wait_until(lambda: node.status()["gpus"][0]["holders"], what="a holder")
    waiter = node.workload("batch", "--memory", "10GiB", "--seconds", "1", "--name", "waiter")
    wait_until(lambda: node.status()["gpus"][0]["queue"], what="a waiter")
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    out, _ = waiter.communicate(timeout=20)
    assert waiter.returncode == 0 and json.loads(out.strip().splitlines()[-1])["steps"] > 0
    ev = node.event_list()
    det = next(e for e in ev if e["event"] == "detach" and e["reason"] == "disconnected")
    grant = next(e for e in ev if e["event"] == "grant" and e["ts"] >= det["ts"])
    assert grant["ts"] - det["ts"] < 1.0  # at once, not after the 60 s quantum


def test_ctl_tq_live_and_persist_across_restart(node_factory, short_tmp):
    cfg = short_tmp / "conf" / "node.toml"  # does not exist yet
    node = node_factory(*sim("16GiB", gpus="2", config=str(cfg)))
    r = node.ctl("tq", "7")
    assert "GPU 0: TQ 7 s" in r.stdout and "GPU 1: TQ 7 s" in r.stdout
    assert [g["tq_s"] for g in node.status()["gpus"]] == [7, 7]
    assert "TQ 7 s" in node.log.read_text()  # the node logs the new value
    assert not cfg.exists()
    node.restart()
    assert [g["tq_s"] for g in node.status()["gpus"]] == [30, 30]  # not persisted
    r = node.ctl("tq", "5", "--gpu", "1", "--persist")
    assert "persisted to" in r.stdout and cfg.exists()
    node.restart()
    assert [g["tq_s"] for g in node.status()["gpus"]] == [30, 5]
    ev = node.event_list()
    assert any(e["event"] == "config" and e.get("tq_s") == 5 and e["gpu"] == 1 for e in ev)


def test_ctl_errors_are_one_clear_line(node_factory, short_tmp):
    node = node_factory(*sim("16GiB"))
    r = node.ctl("tq", "5", "--persist", check=False)
    assert r.returncode == 1 and "without --config" in r.stderr
    r = node.ctl("tq", "5", "--gpu", "3", check=False)
    assert r.returncode == 1 and "no GPU 3" in r.stderr
    r = node.ctl("tq", "-1", check=False)
    assert r.returncode == 2 and "TQ must be positive" in r.stderr
    r = node.ctl("--socket", str(short_tmp / "none.sock"), "status", check=False)
    assert r.returncode == 1 and "is 'gpushare node' running" in r.stderr


def test_status_json_has_the_contract_fields(node_factory):
    node = node_factory(*sim("16GiB"))
    with gpushare.attach("4GiB", socket=node.socket, name="probe") as s, s.gpu():
        st = json.loads(node.ctl("status", "--json").stdout)
    g = st["gpus"][0]
    for k in (
        "index",
        "name",
        "simulated",
        "memory_bytes",
        "tq_s",
        "mode",
        "policy",
        "holders",
        "queue",
        "sessions",
    ):
        assert k in g
    (sess,) = g["sessions"]
    for k in (
        "id",
        "name",
        "pid",
        "pod",
        "namespace",
        "container",
        "state",
        "memory_limit_bytes",
        "resident_bytes",
        "swapped_bytes",
        "lease_seconds_total",
        "wait_seconds_total",
        "grants_total",
        "swap_out_bytes_total",
        "swap_in_bytes_total",
    ):
        assert k in sess
    assert sess["pid"] == os.getpid() and sess["state"] == "holding" and g["simulated"] is True
    assert sess["memory_limit_bytes"] == 4 * G


def test_events_follow_streams_new_events(node_factory):
    node = node_factory(*sim("16GiB"))
    f = subprocess.Popen(
        [sys.executable, "-m", "gpushare", "ctl", "--socket", node.admin, "events", "--follow"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert f.stdout is not None

    def burst(name: str) -> list[dict]:
        with gpushare.attach("1GiB", socket=node.socket, name=name) as s, s.gpu():
            pass
        return [json.loads(f.stdout.readline()) for _ in range(4)]

    try:
        # The first session's events reach the follower from the backlog or live (it may
        # start late); once it has printed them it follows, so the next are live.
        assert burst("opening")[0]["name"] == "opening"
        lines = burst("followed")
        assert [e["event"] for e in lines] == ["attach", "grant", "release", "detach"]
        assert lines[0]["name"] == "followed" and all("ts" in e and "gpu" in e for e in lines)
    finally:
        f.kill()
        f.wait()
    r = node.ctl("events", "--since", "1h", "--session", str(lines[0]["session"]))
    assert len(r.stdout.splitlines()) == 4


def test_bad_config_file_is_one_line_exit_2(node_factory, short_tmp):
    cfg = short_tmp / "bad.toml"
    cfg.write_text("tq = [unclosed")
    node = node_factory("--sim-gpus", "1", "--config", str(cfg), start=False)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpushare",
            "node",
            "--socket",
            node.socket,
            "--admin-socket",
            node.admin,
            "--config",
            str(cfg),
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "not valid TOML" in r.stderr and str(cfg) in r.stderr


def test_second_node_on_same_socket_is_refused(node_factory):
    node = node_factory(*sim("16GiB"))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpushare",
            "node",
            "--socket",
            node.socket,
            "--admin-socket",
            node.admin + "2",
            "--sim-gpus",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2 and "another gpushare node" in r.stderr
    assert node.status()  # the first one is untouched


def _switching(folder: Path, *extra: str) -> tuple[NodeProcess, list[subprocess.Popen[str]]]:
    """Two 30 GiB batch sessions on a 40 GiB simulated GPU: every switch moves 20 GiB
    each way. They start contending together (behind a gate session), and run long
    enough for several switches on a loaded machine: one process started late, or a
    slow run, left only two."""
    folder.mkdir()
    node = NodeProcess(folder, *sim("40GiB", mode="exclusive", tq="0.5"), *extra).start()
    with all_start_together(node, waiting=2):
        procs = [
            node.workload("batch", "--memory", "30GiB", "--seconds", "8", "--name", f"j{i}")
            for i in (1, 2)
        ]
    return node, procs


def _switch_seconds(
    node: NodeProcess, procs: list[subprocess.Popen[str]]
) -> tuple[list[float], list[dict[str, Any]]]:
    """Each switch's revoke-to-swapped-in time, and the events."""
    outs = [json.loads(pr.communicate(timeout=60)[0].strip().splitlines()[-1]) for pr in procs]
    assert all(o["failures"] == 0 for o in outs), outs
    ev = node.event_list()
    node.stop()
    out = switches(ev).seconds
    assert len(out) >= 3, ev
    return out, ev


@pytest.mark.slow
def test_a_switch_overlaps_swap_out_and_swap_in(short_tmp):
    # Both at once, or one after the other (--sequential-switches): only the first
    # grants a session before the last holder's swap-out is done.
    overlapped = _switching(short_tmp / "o")
    sequential = _switching(short_tmp / "s", "--sequential-switches")
    try:
        over, ev = _switch_seconds(*overlapped)
        seq, ev_seq = _switch_seconds(*sequential)
    finally:
        for node, procs in (overlapped, sequential):
            for pr in [node.proc, *procs]:
                if pr is not None and pr.poll() is None:
                    pr.kill()
                    pr.wait()
    rooms = [e for e in ev if e["event"] == "grant" and e.get("room_bytes")]
    assert rooms, "no switch overlapped"
    assert not [e for e in ev_seq if e["event"] == "grant" and e.get("room_bytes")]
    # The overlapped grant comes before the last holder's swap-out is done.
    g = rooms[0]
    out = next(e for e in ev if e["event"] == "swap_out" and e["ts"] >= g["ts"])
    assert out["session"] != g["session"] and out["bytes"] > 0
    # How much sooner (about 0.6 of one after the other, full duplex) is a figure of the
    # machine's load: benchmarks/switch_overlap.py measures it, side by side in one run.
    assert over and seq

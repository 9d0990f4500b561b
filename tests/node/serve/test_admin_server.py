"""The admin socket, in process on virtual time: status, live settings (checked whole
before anything changes), --persist, ending a session, the event stream."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import stat

from gpushare import protocol as p
from gpushare.node.serve.admin_server import IDLE_S, MAX_CONNECTIONS
from gpushare.status import to_json_object
from gpushare.tools import ctl
from tests.node.harness import G, InProcessNode, Peer, in_process

# DESIGN.md's contract: these stay.
CONTRACT_GPU = {"index", "name", "simulated", "memory_bytes", "tq_s", "mode", "policy"}
CONTRACT_GPU |= {"holders", "queue", "sessions"}
CONTRACT_SESSION = {
    "id", "name", "pid", "pod", "namespace", "container", "state", "memory_limit_bytes",
    "resident_bytes", "swapped_bytes", "lease_seconds_total", "wait_seconds_total",
    "grants_total", "swap_out_bytes_total", "swap_in_bytes_total",
}  # fmt: skip
# What `ctl status --json` printed before the snapshot was typed: exactly these keys.
TODAY_NODE = ["pid", "started", "config"]
TODAY_GPU = [
    "index", "name", "uuid", "simulated", "memory_bytes", "usable_bytes", "used_bytes",
    "utilization_ratio", "grants_total", "shared_utilization_seconds_total", "tq_s", "mode",
    "policy", "escalation", "holders", "queue", "sessions", "workloads",
]  # fmt: skip
TODAY_SESSION = [
    "id", "name", "frozen", "state", "weight", "memory_limit_bytes", "resident_bytes",
    "swapped_bytes", "pending_swap_out_bytes", "room_bytes", "lease_seconds_total",
    "wait_seconds_total", "wait_seconds_max", "grants_total", "bursts_total", "revokes_total",
    "escalations_total", "swap_out_total", "swap_in_total", "swap_out_bytes_total",
    "swap_in_bytes_total", "swap_out_seconds_total", "swap_in_seconds_total",
    "attached_seconds", "wait_seconds_completed_total", "wait_seconds_buckets",
    "wait_seconds_p95", "utilization_seconds_total", "pid", "uid", "pod", "namespace",
    "container", "identity_verified", "identity_source", "claimed", "pod_uid",
    "container_id", "runtime",
]  # fmt: skip


def tqs(node: InProcessNode) -> list[float]:
    return [a.settings.tq_s for a in node.node.arbiters]


@in_process(mode="exclusive")
async def test_status_json_keeps_todays_keys_and_the_contract(node, capsys):
    w = await node.workload(memory_limit=4 * G, name="probe")
    await w.send(p.Acquire())
    await w.expect(p.Grant)
    reply = await node.ask(p.StatusRequest())
    assert isinstance(reply, p.StatusReply)
    (s,) = reply.status.gpus[0].sessions  # typed through the wire
    assert (s.name, s.state, s.pid, s.memory_limit_bytes) == (
        "probe",
        "holding",
        os.getpid(),
        4 * G,
    )
    # `ctl status --json`, the real command's code, against this node
    assert await asyncio.to_thread(ctl.status, node.admin_socket, True) == 0
    st = json.loads(capsys.readouterr().out)
    assert set(st) == set(to_json_object(node.node.status()))
    # today's keys first, in today's order; keys added since come after them
    assert list(st)[:2] == ["node", "gpus"] and list(st["node"])[:3] == TODAY_NODE
    (g,) = st["gpus"]
    assert list(g)[: len(TODAY_GPU)] == TODAY_GPU
    assert list(g["sessions"][0])[: len(TODAY_SESSION)] == TODAY_SESSION
    assert set(g) >= CONTRACT_GPU and set(g["sessions"][0]) >= CONTRACT_SESSION
    assert g["simulated"] is True and g["holders"] == [w.session]


@in_process(gpus=2)
async def test_settings_change_live_on_every_gpu_or_one(node, caplog):
    caplog.set_level(logging.INFO, logger="gpushare")
    r = await node.ask(p.SetConfig(tq_s=7))
    assert isinstance(r, p.ConfigReply) and [g.tq_s for g in r.gpus] == [7, 7]
    assert tqs(node) == [7, 7] and "TQ 7 s" in caplog.text
    r = await node.ask(p.SetConfig(gpu=1, mode="exclusive", policy="weighted", escalation="kill"))
    assert isinstance(r, p.ConfigReply) and [g.index for g in r.gpus] == [1]
    assert (r.gpus[0].mode, r.gpus[0].policy, r.gpus[0].escalation) == (
        "exclusive",
        "weighted",
        "kill",
    )
    a0 = node.node.arbiters[0]
    assert (a0.settings.mode, a0.settings.policy, a0.settings.escalation) == (
        "auto",
        "equal",
        "log",
    )
    changes = [(e["gpu"], e.get("tq_s"), e.get("mode")) for e in node.events("config")]
    assert changes == [(0, 7.0, None), (1, 7.0, None), (1, None, "exclusive")]
    assert r.persisted_to == ""


@in_process(gpus=2)
async def test_a_bad_setting_changes_nothing(node):
    before = [vars(a.settings).copy() for a in node.node.arbiters]
    r = await node.ask(p.SetConfig(mode="exclusive", tq_s=-1.0))
    assert isinstance(r, p.Error) and r.code == "value"
    assert "TQ must be positive: a number of seconds from 0.05 s to 86400 s" in r.message
    r = await node.ask(p.SetConfig(tq_s=2e5))
    assert isinstance(r, p.Error) and r.code == "value" and "to 86400 s (1 d)" in r.message
    r = await node.ask(p.SetConfig(gpu=3, tq_s=5))
    assert isinstance(r, p.Error) and r.code == "gpu" and "no GPU 3" in r.message
    # each refusal is an event (and a log line), as a bad edit of the config file is
    refusals = node.events("config_refused")
    assert [e["source"] for e in refusals] == ["ctl"] * 3
    assert "no GPU 3" in refusals[-1]["reason"] and refusals[0]["gpu"] is None
    # a mode outside its literal is not a SetConfig at all: refused, connection closed
    admin = await node.admin()
    await admin.send(p.SetConfig(mode="fastest", tq_s=5))  # type: ignore[arg-type]
    err = await admin.expect(p.Error)
    assert err.code == "protocol" and "mode" in err.message and await admin.closed()
    assert node.events("refused")[-1]["socket"] == "admin"
    assert [vars(a.settings) for a in node.node.arbiters] == before
    assert not node.events("config")


@in_process()
async def test_persist_without_a_file_says_so_and_keeps_the_live_change(node):
    r = await node.ask(p.SetConfig(tq_s=5, persist=True))
    assert isinstance(r, p.Error) and r.code == "persist" and "without --config" in r.message
    assert tqs(node) == [5]


@in_process(mode="exclusive", tq=1, grace=1, escalation="freeze")
async def test_an_administrator_ends_a_session(node):
    w = await node.workload(memory_limit=G, name="doomed")
    r = await node.ask(p.EndSession(session=w.session, reason="maintenance"))
    assert isinstance(r, p.Done) and f"session {w.session} ended" in r.message
    err = await w.expect(p.Error)
    assert err.code == "ended" and "maintenance" in err.message and await w.closed()
    await node.until(lambda: node.events("detach"))
    assert node.events("detach")[0]["reason"] == "ended" and not node.node.conns
    r = await node.ask(p.EndSession(session=999))
    assert isinstance(r, p.Error) and r.code == "session"
    # a frozen session is continued as it is ended (a stopped process cannot close)
    a = await node.workload(memory_limit=G, name="stubborn")
    b = await node.workload(memory_limit=G, name="patient")
    await a.send(p.Acquire())
    await a.expect(p.Grant)
    await b.send(p.Acquire())
    await b.expect(p.Grant)  # after the quantum and the grace: a was frozen
    await node.until(lambda: node.signals)  # once what it stops is on disk
    assert node.signals == [(os.getpid(), signal.SIGSTOP)]
    await node.ask(p.EndSession(session=a.session))
    assert node.signals[-1] == (os.getpid(), signal.SIGCONT)
    # b holds the lease as it is ended: its lease ends with it, as a release (issue 16)
    await node.ask(p.EndSession(session=b.session, reason="maintenance"))
    await node.until(lambda: len(node.events("detach")) == 3)
    release = node.events("release")[-1]
    assert (release["session"], release["reason"]) == (b.session, "ended")
    assert node.events("detach")[-1]["reason"] == "ended"


async def _events(node: InProcessNode, **req: object) -> list[dict[str, object]]:
    admin = await node.admin()
    await admin.send(p.EventsRequest(**req))  # type: ignore[arg-type]
    out = []
    while not isinstance(msg := await admin.recv(), p.EventsEnd):
        assert isinstance(msg, p.EventMsg)
        out.append(msg.event)
    assert await admin.closed()
    return out


@in_process()
async def test_events_backlog_by_time_and_session(node):
    a = await node.workload(memory_limit=G, name="a")
    await asyncio.sleep(100)  # virtual time: b attaches 100 s after a
    b = await node.workload(memory_limit=G, name="b")
    for w in (a, b):
        await w.send(p.Acquire(), p.Release(resident=0, swapped=0))
    await node.until(lambda: len(node.events("release")) == 2)
    kinds = [e["event"] for e in await _events(node)]
    assert kinds == ["attach", "attach", "grant", "release", "grant", "release"]
    mine = await _events(node, session=b.session)
    assert [e["event"] for e in mine] == ["attach", "grant", "release"]
    assert all(e["session"] == b.session for e in mine)
    recent = await _events(node, since_s=50.0)  # a attached 100 virtual seconds ago
    assert [e["event"] for e in recent] == ["attach", "grant", "release", "grant", "release"]


@in_process()
async def test_events_follow_streams_live_events(node):
    admin = await node.admin()
    await admin.send(p.EventsRequest(follow=True))
    await admin.expect(p.EventsEnd)
    w = await node.workload(memory_limit=G, name="followed")
    await w.send(p.Acquire(), p.Release(resident=0, swapped=0))
    w.close()
    live = [(await admin.expect(p.EventMsg)).event for _ in range(4)]
    assert [e["event"] for e in live] == ["attach", "grant", "release", "detach"]
    assert live[0]["name"] == "followed" and all("ts" in e and "gpu" in e for e in live)


async def flood(node: InProcessNode, bursts: int) -> None:
    """Events faster than a reader may take them: one write of many bursts, handled by
    the node without a pause (a grant and a release each)."""
    w = await node.workload(memory_limit=G, name="busy")
    await w.send(
        *[m for _ in range(bursts) for m in (p.Acquire(), p.Release(resident=0, swapped=0))]
    )
    await node.until(lambda: len(node.events("release")) == bursts)


@in_process()
async def test_a_follower_that_falls_behind_is_told_it_was_dropped(node):
    node.node.events.follow_limit = 5
    admin = await node.admin()
    await admin.send(p.EventsRequest(follow=True))
    await admin.expect(p.EventsEnd)
    await flood(node, 10)
    got = []
    while isinstance(msg := await admin.recv(timeout=10), p.EventMsg):
        got.append(msg.event)
    assert [e["event"] for e in got[:2]] == ["attach", "grant"]  # before the flood, then
    assert len(got) == 1 + 5  # as many as it may be behind, then the word
    assert isinstance(msg, p.Error) and msg.code == "behind" and "dropped" in msg.message
    assert await admin.closed() and not node.node.events.followers


@in_process()
async def test_ctl_events_follow_exits_non_zero_when_dropped(node, capsys):
    node.node.events.follow_limit = 5
    cli = asyncio.ensure_future(
        asyncio.to_thread(ctl_main, ["ctl", "--socket", node.admin_socket, "events", "-f"])
    )
    await node.until_wall(lambda: node.node.events.followers)  # the command is following
    await flood(node, 10)
    await node.until_wall(cli.done)  # or ctl events --follow hangs
    assert cli.result() == 1
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 1 + 5  # the attach, then as many as it may be behind
    assert err.count("\n") == 1 and "dropped" in err and err.startswith("gpushare ctl: error:")


def ctl_main(argv: list[str]) -> int:
    from gpushare.tools.cli import main

    return main(argv)


@in_process()
async def test_garbage_on_the_admin_socket_is_refused(node):
    for data, words in [
        (b"\xff" * 64, "exceeds"),
        (p.encode(p.Acquire()), "not an admin request"),
    ]:
        peer = await Peer.connect(node.admin_socket)
        await peer.send_raw(data)
        err = await peer.expect(p.Error)
        assert err.code == "protocol" and words in err.message and await peer.closed()
    assert [e["socket"] for e in node.events("refused")] == ["admin", "admin"]
    assert isinstance(await node.ask(p.StatusRequest()), p.StatusReply)


@in_process(max_messages_per_s=5.0)
async def test_admin_requests_are_rate_limited(node):
    admin = await node.admin()
    t0 = node.clock.monotonic()
    await admin.send(*[p.StatusRequest()] * 30)
    for _ in range(30):  # each answered, the ones over the rate later (not refused)
        assert isinstance(await admin.expect(p.StatusReply), p.StatusReply)
    assert 0.99 * (30 - 10) / 5 <= node.clock.monotonic() - t0 <= 10 * (30 - 10) / 5
    assert not node.events("refused")


@in_process()
async def test_the_admin_socket_is_owner_only(node):
    assert stat.S_IMODE(os.stat(node.admin_socket).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(node.socket).st_mode) == 0o666


# --- timeouts and bounds (issue 24) -----------------------------------------------------


@in_process(hello_timeout=10)
async def test_a_half_sent_admin_request_is_dropped_within_the_frame_timeout(node):
    # Before: the admin socket waited 3,600 s for the rest of a frame, holding the
    # connection and its task; now hello_timeout after the frame's first byte.
    admin = await node.admin()
    assert isinstance(await admin.request(p.StatusRequest()), p.StatusReply)
    t0 = node.clock.monotonic()
    await admin.send_raw(p.encode(p.StatusRequest())[:3])
    err = await admin.expect(p.Error)
    assert err.code == "timeout" and "hello_timeout" in err.message
    assert await admin.closed()
    assert 10 <= node.clock.monotonic() - t0 <= 100
    await node.until(lambda: node.node.admin.open == 0)
    assert [e["code"] for e in node.events("refused")] == ["timeout"]


@in_process(hello_timeout=10)
async def test_an_idle_admin_connection_is_closed_and_a_follower_is_not(node):
    silent = await node.admin()  # never asks: closed after hello_timeout
    t0 = node.clock.monotonic()
    assert await silent.closed()
    assert 10 <= node.clock.monotonic() - t0 <= 100
    polling = await node.admin()  # asked once, then idle (a `top` that stopped)
    assert isinstance(await polling.request(p.StatusRequest()), p.StatusReply)
    follower = await node.admin()
    await follower.send(p.EventsRequest(follow=True))
    await follower.expect(p.EventsEnd)
    t0 = node.clock.monotonic()
    assert await polling.closed(timeout=10 * IDLE_S)
    assert IDLE_S <= node.clock.monotonic() - t0 <= 10 * IDLE_S
    await asyncio.sleep(IDLE_S)  # the follower, quiet for twice as long, still follows
    w = await node.workload(memory_limit=G, name="late")
    assert (await follower.expect(p.EventMsg)).event["name"] == "late"
    w.close()
    follower.close()
    await node.until(lambda: node.node.admin.open == 0)


@in_process()
async def test_admin_connections_are_bounded(node):
    followers = []
    for _ in range(MAX_CONNECTIONS):
        f = await node.admin()
        await f.send(p.EventsRequest(follow=True))
        await f.expect(p.EventsEnd)
        followers.append(f)
    extra = await node.admin()
    err = await extra.expect(p.Error)
    assert err.code == "busy" and f"{MAX_CONNECTIONS} admin connections" in err.message
    assert await extra.closed()
    followers.pop().close()
    await node.until(lambda: node.node.admin.open == MAX_CONNECTIONS - 1)
    assert isinstance(await node.ask(p.StatusRequest()), p.StatusReply)  # room again
    for f in followers:
        f.close()

"""The node believes only what it can check (issue 11), in process on virtual time: each
case as it was seen, then what holds now. Lies in well-formed messages are refused with
an error frame naming the field and change nothing; a lease claimed after a restart comes
back only to the session the node's records name, with the token it was granted with;
non-holders that ignore a swap-out are escalated; what a client sends is bounded."""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import math
import os
import signal
import time
from typing import Any

import msgspec
import pytest

from gpushare import protocol as p
from gpushare.node.guard import LINE_FACTOR
from gpushare.node.keep.events import EventBus
from gpushare.node.observe.snapshot import fit
from gpushare.status import GpuStatus, NodeInfo, NodeStatus, SessionStatus, WorkloadStatus
from gpushare.tools import ctl
from tests.node.harness import G, InProcessNode, Peer, Workload, in_process


def hello(**kw) -> p.Hello:
    return p.Hello(version=p.PROTOCOL_VERSION, **kw)


async def holder(node: InProcessNode, limit: int, name: str = "holder") -> Workload:
    w = await node.workload(memory_limit=limit, name=name)
    await w.send(p.Acquire())
    await w.expect(p.Grant)
    return w


def consistent(node: InProcessNode) -> None:
    """The invariants, as status shows them."""
    for g in node.node.status().gpus:
        if g.mode == "exclusive":
            assert len(g.holders) <= 1, g.holders
        assert g.used_bytes <= g.usable_bytes, (g.used_bytes, g.usable_bytes)


# --- 1. a hello that says holding=True ------------------------------------------------


@in_process(memory="80GiB", mode="exclusive")
async def test_a_new_connection_claiming_a_lease_is_told_to_yield_not_granted(node):
    a = await holder(node, 60 * G)
    liar = await node.workload(memory_limit=60 * G, name="liar", holding=True, lease=1)
    rev = await liar.expect(p.Revoke)
    assert rev.lease == 1 and rev.swap_out == 0
    await node.settle()
    (g,) = node.node.status().gpus
    assert g.holders == [a.session] and g.used_bytes <= g.usable_bytes
    assert liar.session in g.queue
    ev = [e for e in node.events("revoke") if e["session"] == liar.session]
    assert ev and ev[0]["reason"] == "claim_not_honoured"
    # a claim with someone else's token is no better
    token = node.node.recovery.token(0, a.session, 1)
    other = await node.workload(memory_limit=G, name="thief", holding=True, lease=1,
                                token=token, session=a.session)  # fmt: skip
    assert other.session != a.session
    await other.expect(p.Revoke)
    consistent(node)


# --- 2-4. figures the node knows to be wrong --------------------------------------------


@in_process(mode="exclusive")
async def test_a_refused_release_names_the_field_and_leaves_no_ghost_holder(node):
    a = await holder(node, 4 * G)
    b = await node.workload(memory_limit=4 * G, name="b")
    await b.send(p.Acquire())
    await node.settle()
    before = node.node.status()
    await a.send(p.Release(resident=-1, swapped=0))
    err = await a.expect(p.Error)
    assert err.code == "value" and "release: resident" in err.message
    after = node.node.status()
    assert after.gpus[0].holders == before.gpus[0].holders == [a.session]
    assert [s.state for s in after.gpus[0].sessions] == ["holding", "waiting"]
    a.close()  # its disconnect works: the waiter gets the GPU
    assert isinstance(await b.expect(p.Grant), p.Grant)


@in_process(tq=5, mode="exclusive")
async def test_swapped_bytes_beyond_the_limit_are_refused_and_quanta_stay_bounded(node):
    w = await node.workload(memory_limit=G)
    await w.send(p.Report(resident=0, swapped=2**62))
    err = await w.expect(p.Error)
    assert err.code == "value" and "swapped" in err.message
    await w.send(p.Acquire())
    g = await w.expect(p.Grant)
    assert g.quantum_s == 5 and g.swap_in == 0


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"weight": 1e308}, "weight must be a number in"),
        ({"weight": math.inf}, "weight must be a number in"),
        ({"weight": math.nan}, "weight must be a number in"),
        ({"weight": -1.0}, "weight must be a number in"),
        ({"portion": math.nan}, "portion must be a fraction"),
        ({"portion": -1.0}, "portion must be a fraction"),
        ({"portion": 2.0}, "portion must be a fraction"),
        ({"name": "n" * 254}, "name is 254 characters long, the most is 253"),
        ({"namespace": "x" * 64}, "namespace is 64 characters long, the most is 63"),
        ({"pod": "p" * 900_000}, "pod is 900000 characters long"),
        ({"name": "evil\x1b]0;pwned\x07"}, "name holds control characters"),
        ({"resident": 2 * G, "memory_limit": G}, "resident"),
        ({"gang_size": 10**6}, "gang_size"),
    ],
)
@in_process(policy="weighted")
async def test_hostile_hello_fields_are_refused_naming_the_field(node, fields, words):
    by = await holder(node, G, "bystander")
    peer = await Peer.connect(node.socket)
    await peer.send(hello(**fields))
    err = await peer.expect(p.Error)
    assert err.code == "attach" and words in err.message, err.message
    assert await peer.closed()
    (g,) = node.node.status().gpus
    assert [s.name for s in g.sessions] == ["bystander"] and g.holders == [by.session]


@in_process(memory="40GiB")
async def test_the_weights_source_is_shown(node):
    kai = await node.workload(portion=0.5, weight=0.5, name="kai")
    own = await node.workload(memory_limit=G, weight=2.0, name="own")
    plain = await node.workload(memory_limit=G, name="plain")
    by_id = {s.id: s for s in node.node.status().gpus[0].sessions}
    assert by_id[kai.session].weight_source == "portion"
    assert by_id[kai.session].memory_limit_bytes == 20 * G
    assert by_id[own.session].weight_source == "claimed"
    assert by_id[plain.session].weight_source == "default"


# --- 8. non-holders that ignore a swap-out -----------------------------------------------


@in_process(memory="16GiB", mode="exclusive", grace=2, escalation="kill")
async def test_a_non_holder_that_ignores_a_swap_out_is_escalated(node):
    deaf = await holder(node, 10 * G, "deaf")
    await deaf.send(p.Report(resident=10 * G, swapped=0))
    await deaf.send(p.Release(resident=10 * G, swapped=0))
    w = await node.workload(memory_limit=10 * G, name="needs-room")
    await w.send(p.Acquire())
    ask = await deaf.expect(p.SwapOut)
    t0 = node.clock.monotonic()
    assert ask.bytes == 4 * G  # and deaf never answers
    await node.until(lambda: node.events("escalate"))
    (e,) = node.events("escalate")
    assert e["session"] == deaf.session and e["reason"] == "no_swap_out_within_grace"
    assert node.clock.monotonic() - t0 == pytest.approx(2, abs=0.01)
    assert (os.getpid(), signal.SIGKILL) in node.signals  # this process holds its socket


# --- 7. escalation reaches every process holding the connection -------------------------


def _child_holding_fds(seconds: float = 30.0) -> int:
    """A forked child that keeps every descriptor it inherited (a DataLoader worker)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        time.sleep(seconds)  # holds the descriptors this long: the behaviour under test
        os._exit(0)
    return pid


@in_process(mode="exclusive", tq=1, grace=1, escalation="freeze")
async def test_escalation_reaches_a_forked_child_holding_the_connection(node):
    stuck = await holder(node, G, "stuck")  # it will not yield
    child = _child_holding_fds()
    try:
        w = await node.workload(memory_limit=G, name="next")
        await w.send(p.Acquire())
        await w.expect(p.Grant)  # the stuck one was frozen, its lease handed on
        await node.until(lambda: node.signals)  # once what it stops is on disk
        stopped = {pid for pid, sig in node.signals if sig == signal.SIGSTOP}
        assert {os.getpid(), child} <= stopped
        stuck.close()
        await node.settle()
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


# --- 9. bounded names, events, status ---------------------------------------------------


def test_the_event_ring_is_bounded_by_bytes_as_well_as_count():
    bus = EventBus(backlog=50_000, backlog_bytes=2**20)
    for i in range(20_000):
        bus.publish({"ts": 0.0, "event": "attach", "session": i, "name": "n" * 253})
    assert bus.bytes <= 2**20 and 0 < len(bus.backlog) < 20_000
    assert bus.backlog[-1]["session"] == 19_999  # the newest kept


@in_process(max_sessions_per_uid=4000, max_messages_per_s=1e9, mode="exclusive")
async def test_status_always_fits_one_frame_and_says_what_it_left_out(node):
    first = await holder(node, 1, "h" * 253)
    peers = [await node.workload(memory_limit=1, name=f"{i:06d}" + "n" * 247) for i in range(1500)]
    assert len(node.node.status().gpus[0].sessions) == 1501
    reply = await node.ask(p.StatusRequest())
    assert isinstance(reply, p.StatusReply) and reply.status.truncated
    (g,) = reply.status.gpus
    assert 0 < len(g.sessions) < 1501 and len(g.sessions) + g.sessions_omitted == 1501
    assert g.sessions[0].id == first.session  # the holder first
    assert len(p.encode(reply)) <= p.MAX_FRAME
    # `ctl status`, the liveness probe's command, works and says what it left out
    assert await asyncio.to_thread(ctl.status, node.admin_socket, False) == 0
    shown = io.StringIO()
    ctl.show_status(reply.status, shown)
    assert f"and {g.sessions_omitted} more sessions" in shown.getvalue()
    for w in peers:
        w.close()


def blank(kind: type, **given):
    """A status struct with zeros and empties where ``given`` says nothing."""
    zero = {int: 0, float: 0.0, str: "", bool: False}
    out = {}
    for f in msgspec.structs.fields(kind):
        if f.name in given or f.required is False:
            continue
        t = f.type
        out[f.name] = zero.get(t, [] if getattr(t, "__origin__", None) is list else None)
    out["claimed"] = {} if "claimed" in out else None
    return msgspec.convert({k: v for k, v in {**out, **given}.items() if v is not None}, kind)


def gpu_status(index: int, **fields: Any) -> GpuStatus:
    """GPU ``index`` in mode auto, policy equal, with ``fields``; the rest blank."""
    return blank(GpuStatus, index=index, mode="auto", policy="equal", escalation="log", **fields)


def test_fit_keeps_holders_then_the_queue_of_every_gpu():
    gpus = []
    for k in range(2):
        ids = [k * 10_000 + i for i in range(3000)]
        gpus.append(
            gpu_status(
                k,
                holders=[ids[-1]],
                queue=[ids[5]],
                sessions=[blank(SessionStatus, id=i, name="x" * 253) for i in ids],
            )
        )
    st = fit(NodeStatus(node=blank(NodeInfo), gpus=gpus), 2**20)
    assert st.truncated and len(msgspec.msgpack.encode(st)) <= 2**20
    for k, g in enumerate(st.gpus):
        assert [x.id for x in g.sessions[:2]] == [k * 10_000 + 2999, k * 10_000 + 5]
        assert g.sessions_omitted == 3000 - len(g.sessions) > 0
    assert abs(len(st.gpus[0].sessions) - len(st.gpus[1].sessions)) <= 1


def test_fit_leaves_out_workloads_totals_too_those_with_sessions_kept_first():
    # 1,000 workloads' totals a GPU (the most kept) with names as long as allowed are
    # more than a frame on two GPUs: they are cut like sessions, never the frame broken.
    gpus = []
    for k in range(2):
        workloads = [
            blank(
                WorkloadStatus,
                name=f"{i:04d}" + "w" * 249,
                namespace="n" * 63,
                pod="p" * 253,
                container="c" * 63,
                sessions=int(i == 999),
            )
            for i in range(1000)
        ]
        gpus.append(
            gpu_status(
                k, holders=[1], sessions=[blank(SessionStatus, id=1, name="x")], workloads=workloads
            )
        )
    st = fit(NodeStatus(node=blank(NodeInfo), gpus=gpus), 2**20)
    assert st.truncated and len(msgspec.msgpack.encode(st)) <= 2**20
    for g in st.gpus:
        assert [s.id for s in g.sessions] == [1] and g.sessions_omitted == 0
        assert g.workloads[0].name.startswith("0999")  # the one with a session first
        assert g.workloads_omitted == 1000 - len(g.workloads) > 0


# --- 10. connections that never say hello ------------------------------------------------


@in_process(max_pending_per_uid=4, hello_timeout=30)
async def test_connections_without_a_hello_are_bounded_and_their_refusals_logged_at_a_rate(
    node, caplog
):
    idle = [await Peer.connect(node.socket) for _ in range(4)]
    await node.settle()
    assert node.node.guard.pending == {os.getuid(): 4}
    caplog.set_level(logging.WARNING, logger="gpushare.node")
    extra = [await Peer.connect(node.socket) for _ in range(200)]
    line = LINE_FACTOR * 4  # these wait in line for room to say hello in
    for x in extra[line:]:  # the rest are refused at once
        err = await x.expect(p.Error)
        assert err.code == "busy" and "max_pending_per_uid" in err.message
    assert node.node.guard.waiting == line
    lines = [r for r in caplog.records if "refused" in r.getMessage()]
    assert 1 <= len(lines) <= 25  # a flood is logged at a bounded rate
    assert len(node.events("refused")) <= 25
    for x in extra:
        x.close()
    idle[0].close()
    await node.until(lambda: node.node.guard.pending_total == 3 and not node.node.guard.waiting)
    w = await node.workload(memory_limit=G)  # room again
    assert w.session
    for x in idle[1:]:
        x.close()
    await node.until(lambda: node.node.guard.pending_total == 0)


# --- 5. a node restart ---------------------------------------------------------------------


async def back(node: InProcessNode, was: Workload, **hello_fields) -> Workload:
    """``was`` re-registering with a node that restarted, as the client does."""
    w = await node.workload(session=was.session, memory_limit=was.welcome.memory_limit,
                            name=was.welcome.name, **hello_fields)  # fmt: skip
    assert w.session == was.session  # its id, back
    return w


@in_process(memory="80GiB", mode="exclusive", tq=5)
async def test_a_restarted_node_grants_nothing_until_its_sessions_are_back(node):
    b = await holder(node, 30 * G, "b")
    await b.send(p.Report(resident=30 * G, swapped=0), p.Release(resident=30 * G, swapped=0))
    a = await node.workload(memory_limit=30 * G, name="a")
    await a.send(p.Acquire())
    grant = await a.expect(p.Grant)
    assert grant.token and not grant.resume
    await a.send(p.Report(resident=30 * G, swapped=0))
    c = await node.workload(memory_limit=10 * G, name="c")
    await c.send(p.Acquire())
    await node.settle()
    ids = {a.session, b.session, c.session}

    await node.restart()  # the workloads outlive it
    (begin,) = node.events("recovery")
    assert (begin["phase"], begin["expected"]) == ("begin", 3)
    a2 = await back(node, a, holding=True, lease=grant.lease, token=grant.token,
                    resident=30 * G)  # fmt: skip
    c2 = await back(node, c)
    await c2.send(p.Acquire())
    await node.settle()
    (g,) = node.node.status().gpus
    assert g.recovering and g.holders == [] and g.used_bytes <= g.usable_bytes
    b2 = await back(node, b, resident=30 * G)  # the last one: the window ends
    resumed = await a2.expect(p.Grant)
    assert resumed.resume and resumed.lease > grant.lease and resumed.token
    end = node.events("recovery")[-1]
    assert (end["phase"], end["returned"], end["missing"]) == ("end", 3, 0)
    (g,) = node.node.status().gpus
    assert not g.recovering and g.holders == [a2.session] and g.queue == [c2.session]
    consistent(node)
    fresh = await node.workload(memory_limit=G, name="new")
    assert fresh.session > max(ids)  # ids are never used twice
    b2.close()


@in_process(memory="80GiB", mode="exclusive", recovery_window=3)
async def test_the_recovery_window_ends_when_a_session_does_not_come_back(node):
    a = await holder(node, 10 * G, "a")
    gone = await node.workload(memory_limit=10 * G, name="gone")
    await node.settle()
    await node.restart()
    t0 = node.clock.monotonic()
    del gone  # never comes back (its process still runs: this one)
    a2 = await back(node, a)
    await a2.send(p.Acquire())
    await a2.expect(p.Grant, timeout=10)  # after the window, not before
    assert node.clock.monotonic() - t0 == pytest.approx(3, abs=0.01)
    end = node.events("recovery")[-1]
    assert (end["expected"], end["returned"], end["missing"]) == (2, 1, 1)
    assert end["reason"] == "the window ended"


@in_process(memory="80GiB", mode="exclusive")
async def test_a_stale_token_or_another_sessions_lease_is_not_given_back(node):
    a = await holder(node, 10 * G, "a")
    first = node.node.arbiters[0].sessions[a.session].lease.number
    token = node.node.recovery.token(0, a.session, first)
    b = await node.workload(memory_limit=10 * G, name="b")
    await node.settle()
    await node.restart()
    signed = node.node.recovery.token(0, b.session, first)  # b never held it
    forged = signed[:-1] + ("1" if signed.endswith("0") else "0")  # never the signed one
    b2 = await back(node, b, holding=True, lease=first, token=forged)
    a2 = await back(node, a, holding=True, lease=first, token=token)
    assert (await b2.expect(p.Revoke)).lease == first  # not verified: told to yield
    assert (await a2.expect(p.Grant)).resume
    consistent(node)


# --- 11. names shown as verified are verified --------------------------------------------


@in_process(policy="weighted")
async def test_the_apis_names_and_weight_count_and_stay_when_the_pod_is_deleted(node):
    from gpushare.node.kube.k8s import PodCache

    uid, cid = "6d3e1f20-1a2b-4c3d-9e8f-0a1b2c3d4e5f", "ab" * 32
    proc = node.dir / "proc" / str(os.getpid())
    proc.mkdir(parents=True)
    slice_ = f"kubepods-burstable-pod{uid.replace('-', '_')}.slice"
    (proc / "cgroup").write_text(f"0::/kubepods.slice/{slice_}/cri-containerd-{cid}.scope\n")
    node.node.live.config = msgspec.structs.replace(
        node.node.live.config, proc_root=str(node.dir / "proc")
    )
    pod = {
        "metadata": {"uid": uid, "namespace": "research", "name": "train-7",
                     "annotations": {"gpu-fraction": "0.25"}},
        "status": {"containerStatuses": [{"name": "trainer", "containerID": f"containerd://{cid}"}]},
    }  # fmt: skip
    node.node.pods = cache = PodCache()
    cache.replace([pod])
    w = await node.workload(memory_limit=G, weight=1.0, pod="kube-apiserver",
                            namespace="kube-system", pod_uid=uid)  # fmt: skip
    assert w.welcome.weight == 0.25  # the annotation's, not the workload's word

    def shown():
        (s,) = node.node.status().gpus[0].sessions
        return (s.namespace, s.pod, s.container, s.identity_verified, s.weight_source)

    assert shown() == ("research", "train-7", "trainer", True, "kubernetes")
    cache.apply("DELETED", pod)  # deleted from the API while its process runs
    assert shown() == ("research", "train-7", "trainer", True, "kubernetes")  # pinned


def test_an_event_log_path_that_is_a_symlink_is_refused(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("")
    os.symlink(target, tmp_path / "events.jsonl")
    with pytest.raises(OSError, match=r"event log .*events\.jsonl.*never followed"):
        EventBus(str(tmp_path / "events.jsonl"))
    assert target.read_text() == ""


# --- issue 24: what the node can check, round 2 -------------------------------------------


@in_process(memory="80GiB", mode="exclusive", escalation="log")
async def test_memory_a_new_session_says_is_resident_is_not_booked(node, caplog):
    # Seen: a brand-new session said 75 GiB were resident; the node booked them, and an
    # honest 40 GiB session on the 80 GiB GPU was never granted.
    caplog.set_level(logging.WARNING, logger="gpushare.node")
    liar = await node.workload(memory_limit=80 * G, name="liar", resident=75 * G, swapped=5 * G)
    (s,) = node.node.status().gpus[0].sessions
    assert s.resident_bytes == 0  # nothing it could have on the GPU yet
    assert any("not on record" in r.getMessage() for r in caplog.records)
    honest = await node.workload(memory_limit=40 * G, name="honest")
    await honest.send(p.Acquire())
    assert isinstance(await honest.expect(p.Grant, timeout=30), p.Grant)
    consistent(node)
    liar.close()


@in_process(memory="80GiB", mode="exclusive", tq=5)
async def test_in_the_recovery_window_only_sessions_on_record_attach(node):
    # Seen: after a restart a stranger said hello with 60 GiB resident as soon as the new
    # node listened; the returning workload was refused "does not fit".
    a = await holder(node, 30 * G, "a")
    await a.send(p.Report(resident=30 * G, swapped=0), p.Release(resident=30 * G, swapped=0))
    await node.settle()
    await node.restart()
    stranger = await Peer.connect(node.socket)
    await stranger.send(hello(memory_limit=80 * G, name="stranger", resident=60 * G))
    err = await stranger.expect(p.Error)
    assert err.code == "busy" and "recover" in err.message and "try again" in err.message
    a2 = await back(node, a, resident=30 * G)  # the one on record: back first
    (g,) = node.node.status().gpus
    assert not g.recovering and g.used_bytes == 30 * G
    late = await node.workload(memory_limit=80 * G, name="stranger", resident=60 * G)
    assert late.session > a2.session  # after the window, as a new session: nothing resident
    assert node.node.status().gpus[0].used_bytes == 30 * G
    consistent(node)
    rec = {r.id: r for r in node.node.recovery.live()}
    assert rec[a2.session].resident == 30 * G  # records say how much memory it had


@in_process(memory="80GiB", mode="exclusive")
async def test_a_lease_token_is_good_once_for_the_lease_live_at_the_crash(node):
    # Seen: the token of a lease released before the crash got the GPU back as a resumed
    # lease; and again after a second restart.
    a = await holder(node, 10 * G, "a")
    first = node.node.arbiters[0].sessions[a.session].lease.number
    token = node.node.recovery.token(0, a.session, first)
    await a.send(p.Release(resident=0, swapped=0))  # released before the crash
    await node.settle()
    await node.restart()
    a2 = await back(node, a, holding=True, lease=first, token=token)
    rev = await a2.expect(p.Revoke)
    assert rev.lease == first and rev.swap_out == 0  # not live at the crash: not given back
    live = await a2.expect(p.Grant)  # queued: a new lease, at its turn
    assert not live.resume and live.lease > first
    await node.settle()
    await node.restart()  # the lease live now comes back, once
    a3 = await back(node, a2, holding=True, lease=live.lease, token=live.token)
    resumed = await a3.expect(p.Grant)
    assert resumed.resume and resumed.lease > live.lease
    await node.settle()
    await node.restart()  # the same token a second time: no longer the live lease
    a4 = await back(node, a3, holding=True, lease=live.lease, token=live.token)
    assert (await a4.expect(p.Revoke)).lease == live.lease
    consistent(node)


@in_process(memory="80GiB", mode="exclusive", tq=5)
async def test_a_lease_granted_just_before_the_node_was_killed_comes_back(node):
    # Seen: a node killed within 0.1 s of a grant had not written the lease down; its
    # holder, told to yield while it worked, blocked no one, and the next holder went in
    # beside it (three 30 GiB workloads on an 80 GiB GPU).
    a = await holder(node, 50 * G, "a")
    b = await node.workload(memory_limit=50 * G, name="b")
    await b.send(p.Acquire())
    await node.settle()
    rec = node.node.recovery
    # From here a SIGKILL: no save later than the ones made at once, none at the stop.
    rec.save_soon = lambda delay=0.1: None  # type: ignore[method-assign]
    rec.hold = lambda: setattr(rec, "_held", True)  # type: ignore[method-assign]
    await a.send(p.Release(resident=0, swapped=0))
    grant = await b.expect(p.Grant)
    await node.restart()
    await back(node, a)
    b2 = await back(node, b, holding=True, lease=grant.lease, token=grant.token)
    resumed = await b2.expect(p.Grant)
    assert resumed.resume and resumed.lease > grant.lease  # its claim believed, honoured
    assert not [e for e in node.events("revoke") if e["session"] == b.session]
    consistent(node)


@in_process(memory="80GiB", mode="exclusive", tq=5)
async def test_memory_dropped_before_a_restart_is_booked_when_its_session_is_back(node):
    # Seen: a reconnecting hello's discarded bytes were not used: the session's bound
    # left out the memory it makes again (empty) at its next grant.
    a = await holder(node, 20 * G, "a")
    await a.send(p.Release(resident=0, swapped=4 * G, discarded=6 * G))
    await node.settle()
    await node.restart()
    a2 = await back(node, a, swapped=4 * G, discarded=6 * G)
    await node.settle()
    assert a2.welcome.session == a.session
    m = node.node.arbiters[0].sessions[a.session].memory
    assert (m.resident, m.swapped, m.discarded) == (0, 4 * G, 6 * G)
    (row,) = node.node.status().gpus[0].sessions
    assert row.discarded_bytes == 6 * G
    consistent(node)


@in_process(memory="80GiB")
async def test_session_ids_stay_unique_when_the_state_directory_is_full(node, monkeypatch):
    # Seen: with the state directory full, session ids repeated after SIGKILL + restart.
    import errno

    from gpushare.node.keep import recovery

    monkeypatch.setattr(recovery, "ID_BLOCK", 2)
    first = await node.workload(memory_limit=G)
    seen = [first.session]
    d = node.node.recovery.dir

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(d, "write", full)
    refused = []
    for _ in range(6):
        peer = await Peer.connect(node.socket)
        await peer.send(hello(memory_limit=G))
        m = await peer.recv()
        if isinstance(m, p.Welcome):
            seen.append(m.session)
        else:
            assert m.code == "busy" and "session ids" in m.message and d.path in m.message
            refused.append(m)
    assert refused  # refused rather than handed out unreserved
    await node.restart()  # its files as the full disk left them (nothing more written)
    await back(node, first)  # on record from before the disk filled: it comes back first
    again = [(await node.workload(memory_limit=G)).session for _ in range(6)]
    assert not set(again) & set(seen), (seen, again)


@in_process(files={"config": "tq = 7\n"})
async def test_a_fifo_at_the_config_path_does_not_freeze_the_node(node):
    import threading

    path = node.node.live.path
    os.unlink(path)
    os.mkfifo(path)
    freed = threading.Event()

    def free() -> None:  # should the node block opening it, this frees it after 3 s
        time.sleep(3)
        freed.set()
        with contextlib.suppress(OSError):  # no reader (not blocked): nothing to free
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))

    threading.Thread(target=free, daemon=True).start()
    t0 = node.clock.monotonic()
    await node.until(lambda: node.clock.monotonic() - t0 > 2.5)  # the watch looks twice
    reply = await node.ask(p.StatusRequest())
    assert isinstance(reply, p.StatusReply) and not freed.is_set()
    assert node.node.arbiters[0].settings.tq_s == 7  # kept


@in_process(files={"config": "tq = 7\n"})
async def test_a_config_file_caught_half_written_is_not_applied(node):
    path = node.node.live.path
    with open(path, "w") as f:  # truncated; the writer has not written yet
        t0 = node.clock.monotonic()
        while node.clock.monotonic() - t0 < 1.9:  # one look at it, or two
            await asyncio.sleep(0.1)  # virtual time: looks while the watch runs
            assert node.node.arbiters[0].settings.tq_s == 7  # not the default
        f.write("tq = 7\n")
        f.flush()
        f.write('mode = "exclusive"\n')
    t0 = node.clock.monotonic()
    await node.until(lambda: node.node.arbiters[0].settings.mode == "exclusive", timeout=10)
    assert node.node.arbiters[0].settings.tq_s == 7
    with open(path, "w") as f:  # broken for good: kept, said once
        f.write("tq = [")
    t0 = node.clock.monotonic()
    await node.until(lambda: node.clock.monotonic() - t0 > 5)
    assert node.node.arbiters[0].settings.tq_s == 7
    assert len(node.events("config_refused")) == 1


def test_a_lease_key_symlink_is_replaced_never_followed(tmp_path):
    from gpushare.node.keep.recovery import KEY_FILE, Recovery
    from gpushare.node.keep.safefs import SafeDir

    shared = tmp_path / "shared"
    shared.mkdir(mode=0o1777)
    shared.chmod(0o1777)  # a shared sticky directory, as /tmp
    target = tmp_path / "victim"
    target.write_bytes(b"x" * 40)
    os.symlink(target, shared / KEY_FILE)
    r = Recovery(SafeDir(shared), 1, list, lambda: "/proc")
    assert target.read_bytes() == b"x" * 40  # never followed
    assert not (shared / KEY_FILE).is_symlink() and len(r.key) == 32
    assert (shared / KEY_FILE).read_bytes() == r.key


def test_status_polled_back_to_back_takes_a_bounded_share_of_the_loop():
    # Issue 24: `ctl status` took 4.4-4.8 ms of the node's loop per call at 256 sessions;
    # polled back to back it halved grants. Now a reply is taken no more often than
    # every SHARE times its cost: requests sooner wait for the next one and share it,
    # and every reply is taken after the request it answers (never stale).
    from gpushare.core.clock import ManualClock
    from gpushare.node.host import virtual_time
    from gpushare.node.observe.snapshot import StatusFrames

    clock, cost = ManualClock(), 0.0045

    def status() -> NodeStatus:
        clock.advance(cost)  # what taking it costs the loop
        return NodeStatus(node=blank(NodeInfo, started=clock.monotonic()), gpus=[])

    frames = StatusFrames(status, clock.monotonic)
    busy = [0.0]

    def counted() -> NodeStatus:
        t0 = clock.monotonic()
        st = status()
        busy[0] += clock.monotonic() - t0
        return st

    frames._status = counted

    async def poller(stop: float) -> None:
        while clock.monotonic() < stop:  # back to back
            asked = clock.monotonic()
            reply = p.decode((await frames.take())[p.HEADER_SIZE :])
            assert isinstance(reply, p.StatusReply) and reply.status.node.started >= asked

    async def main() -> None:
        start = clock.monotonic()
        await asyncio.gather(*(poller(start + 10.0) for _ in range(4)))
        assert busy[0] / (clock.monotonic() - start) <= 1.5 / (StatusFrames.SHARE + 1)
        assert frames.shared > frames.taken > 10

    virtual_time.run(main(), clock)


@in_process(memory="80GiB", mode="exclusive", escalation="log")
async def test_a_new_session_cannot_report_memory_it_was_never_let_have(node):
    # The same lie as in its hello, a moment later in a report: a session that has had
    # no lease (nor prefetch room) since it attached, and is not on record, has nothing
    # on the GPU: its report is refused, naming the field, and the session goes on.
    liar = await node.workload(memory_limit=80 * G, name="liar")
    await liar.send(p.Report(resident=75 * G, swapped=0))
    err = await liar.expect(p.Error)
    assert err.code == "value" and "resident" in err.message and "lease" in err.message
    (s,) = node.node.status().gpus[0].sessions
    assert s.resident_bytes == 0
    honest = await node.workload(memory_limit=40 * G, name="honest")
    await honest.send(p.Acquire())
    await honest.expect(p.Grant, timeout=30)
    await honest.send(p.Report(resident=40 * G, swapped=0))  # within its lease: counted
    await node.settle()
    by = {x.name: x for x in node.node.status().gpus[0].sessions}
    assert by["honest"].resident_bytes == 40 * G
    liar.close()

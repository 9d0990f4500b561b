"""The workload socket, in process on virtual time: every refusal is logged, made a
`refused` event and answered with an error frame; a refused message changes no state and
harms no one else; a message not valid now is answered and the session goes on."""

from __future__ import annotations

import logging
import os
import struct

import msgspec
import pytest

from gpushare import protocol as p
from tests.node.harness import G, InProcessNode, Peer, Workload, in_process


def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


HELLO = p.encode(p.Hello(version=p.PROTOCOL_VERSION, memory_limit=G))
NOT_MINE = [  # messages a workload may not send: the admin's, or the node's own
    p.SetConfig(tq_s=1),
    p.EndSession(session=1),
    p.StatusRequest(),
    p.EventsRequest(),
    p.Revoke(lease=1, swap_out=0, grace_s=1),
    p.Grant(lease=1, swap_in=0, quantum_s=1),
    p.SwapOut(bytes=1),
]
REFUSALS = [
    pytest.param(b"\xff" * 64, "protocol", id="garbage"),  # a length beyond any frame
    pytest.param(struct.pack(">I", p.MAX_FRAME + 1) + b"x" * 16, "protocol", id="oversized"),
    pytest.param(_frame(b"\x81\xa1t\xa5bogus"), "protocol", id="unknown-tag"),
    pytest.param(p.encode(p.Acquire()), "protocol", id="not-a-hello"),
    pytest.param(p.encode(p.Hello(version=99)), "version", id="version"),
    pytest.param(p.encode(p.Hello(version=1, gpu=7)), "gpu", id="gpu-index"),
    pytest.param(
        p.encode(p.Hello(version=1, gpu_uuid="GPU-00000000-0000-0000-0000-000000000000")),
        "gpu",
        id="gpu-uuid",
    ),
    pytest.param(p.encode(p.Hello(version=1, memory_limit=10**15)), "attach", id="too-big"),
    pytest.param(p.encode(p.Hello(version=1, weight=-1.0)), "attach", id="bad-weight"),
    pytest.param(p.encode(p.Hello(version=1, gang="j" * 300)), "attach", id="gang-id"),
    pytest.param(p.encode(p.Hello(version=1, gang="j", gang_size=-2)), "attach", id="gang-size"),
    pytest.param(p.encode(p.Hello(version=1, gang="j", rank=-5)), "attach", id="gang-rank"),
    pytest.param(
        p.encode(p.Hello(version=1, gang="j", world_size=10**9)), "attach", id="world-size"
    ),
    pytest.param(
        p.encode(p.Hello(version=1, memory_limit=G, memory_request=2 * G)), "attach", id="request"
    ),
    pytest.param(p.encode(p.Hello(version=1, sharing="mps")), "attach", id="sharing"),
    pytest.param(p.encode(p.Hello(version=1, compute_limit=2.0)), "attach", id="compute-limit"),
    pytest.param(
        p.encode(p.Hello(version=1, portion=0.5, portion_limit=0.25)), "attach", id="portion-limit"
    ),
    *[
        pytest.param(HELLO + p.encode(m), "denied", id=f"denied-{type(m).__name__}")
        for m in NOT_MINE
    ],
]


async def bystander(node: InProcessNode) -> Workload:
    """A session holding the GPU, which no refusal of another may disturb."""
    by = await node.workload(memory_limit=2 * G, name="bystander")
    await by.send(p.Acquire())
    await by.expect(p.Grant)
    return by


def unharmed(node: InProcessNode, by: Workload) -> None:
    (g,) = node.node.status().gpus
    assert [s.name for s in g.sessions] == ["bystander"]
    assert g.holders == [by.session] and g.queue == []


async def refused(node: InProcessNode, peer: Peer, code: str) -> p.Error:
    """The peer's error frame, then the end; and the event, written before the answer."""
    err = await peer.expect(p.Error)
    assert err.code == code and err.message
    assert await peer.closed()
    ev = node.events("refused")[-1]
    assert (ev["code"], ev["socket"], ev["reason"]) == (code, "workload", err.message)
    assert ev["pid"] == os.getpid() and ev["uid"] == os.getuid()
    return err


@pytest.mark.parametrize(("data", "code"), REFUSALS)
@in_process(mode="exclusive")
async def test_each_refusal_is_logged_an_event_and_an_error_frame(node, caplog, data, code):
    by = await bystander(node)
    peer = await Peer.connect(node.socket)
    await peer.send_raw(data)
    with caplog.at_level(logging.WARNING, logger="gpushare.node"):
        err = await refused(node, peer, code)
    assert f"refused pid {os.getpid()}" in caplog.text and err.message in caplog.text
    assert len(node.events("refused")) == 1
    unharmed(node, by)
    if code == "denied":
        assert "only on its own session" in err.message


@in_process()
async def test_refusals_name_the_fix(node):
    for hello, words in [
        (p.Hello(version=99), "use the same gpushare version"),
        (p.Hello(version=1, gpu=7), "choose gpu=0..0"),
        (p.Hello(version=1, memory_limit=10**15), "909.5 TiB is more than GPU 0's usable 16.0"),
        (p.Hello(version=1, memory_limit=10**15), "ask for 16.0 GiB or less"),  # sizes, not bytes
        (
            p.Hello(version=1, memory_limit=G, memory_request=2 * G),
            "ask for a limit at least as large as the request",
        ),
    ]:
        peer = await Peer.connect(node.socket)
        await peer.send(hello)
        err = await peer.expect(p.Error)
        assert words in err.message, err.message
    assert len(node.events("refused")) == 5 and not node.events("attach")


@in_process()
async def test_an_admin_request_at_the_workload_socket_names_the_admin_socket(node):
    # `ctl --socket WORKLOAD_SOCKET status`: said in the user's words, not the protocol's
    for req in (p.StatusRequest(), p.EventsRequest(), p.SetConfig(tq_s=5)):
        peer = await Peer.connect(node.socket)
        await peer.send(req)
        err = await peer.expect(p.Error)
        assert err.code == "protocol" and await peer.closed()
        assert f"{node.socket} is this node's workload socket" in err.message
        assert f"its admin socket, {node.admin_socket}" in err.message


@in_process()
async def test_a_hello_at_the_admin_socket_names_the_workload_socket(node):
    admin = await node.admin()
    await admin.send(p.Hello(version=p.PROTOCOL_VERSION, memory_limit=G))
    err = await admin.expect(p.Error)
    assert err.code == "protocol" and await admin.closed()
    assert f"{node.admin_socket} is this node's admin socket" in err.message
    assert f"its workload socket, {node.socket}" in err.message


@in_process(max_messages_per_s=50.0)
async def test_a_message_flood_is_slowed_down_alone_not_ended(node):
    # Issue 24: honest fast clients (a loop of empty `with s.gpu():` blocks) were ended
    # for the rate. Now a connection over it is read later, at the rate; nothing ends.
    by = await bystander(node)
    w = await node.workload(memory_limit=G)
    t0 = node.clock.monotonic()
    flood = p.encode(p.Report(resident=0, swapped=0)) * 500
    await w.send_raw(flood + p.encode(p.Release(resident=0, swapped=0)))  # marks the end
    await node.until(lambda: node.node.guard.slowed > 0)
    reply = await node.ask(p.StatusRequest())  # everyone else is served meanwhile
    assert isinstance(reply, p.StatusReply) and node.clock.monotonic() - t0 < 5
    err = await w.expect(p.Error, timeout=60)  # the last one, read in its turn
    assert err.code == "state" and not w.reader.at_eof()  # still connected
    took = node.clock.monotonic() - t0
    assert 0.99 * (501 - 100) / 50 <= took <= 10 * (501 - 100) / 50  # at the rate
    assert not node.events("refused")
    (g,) = node.node.status().gpus
    assert g.holders == [by.session] and len(g.sessions) == 2


@in_process(max_sessions_per_uid=3)
async def test_sessions_per_uid_are_bounded(node):
    by = await bystander(node)
    extra = [await node.workload(memory_limit=G) for _ in range(2)]
    peer = await Peer.connect(node.socket)
    await peer.send(p.Hello(version=1, memory_limit=G))
    err = await refused(node, peer, "limit")
    assert "most allowed" in err.message and "max_sessions_per_uid" in err.message
    for x in extra:
        x.close()
    await node.until(lambda: len(node.node.conns) == 1)
    unharmed(node, by)
    again = await node.workload(memory_limit=G)  # room again once others closed
    assert again.session > by.session


@in_process(hello_timeout=0.5)
async def test_a_connection_that_never_says_hello_is_dropped(node):
    t0 = node.clock.monotonic()
    idle = await Peer.connect(node.socket)
    err = await refused(node, idle, "timeout")
    assert "no hello within 0.5 s" in err.message
    assert node.clock.monotonic() - t0 == pytest.approx(0.5)


@in_process(mode="exclusive")
async def test_a_message_not_valid_now_is_answered_and_the_session_goes_on(node):
    by = await bystander(node)
    w = await node.workload(memory_limit=G)
    await w.send(p.Release(resident=0, swapped=0, again=True))  # it holds no lease
    err = await w.expect(p.Error)
    assert err.code == "state" and "holds no lease" in err.message
    assert not node.events("refused")
    g = node.node.status().gpus[0]
    assert g.holders == [by.session]
    await w.send(p.Acquire())  # still attached: it queues behind the holder
    await node.until(lambda: node.node.arbiters[0].queue)
    assert list(node.node.arbiters[0].queue) == [w.session]


@in_process(escalation="kill")
async def test_reported_memory_over_the_limit_escalates_once(node):
    w = await node.workload(memory_limit=G)
    await w.send(p.Report(resident=2 * G, swapped=0))
    await node.until(lambda: node.events("escalate"))
    (e,) = node.events("escalate")
    assert e["reason"] == "over_memory_limit" and e["resident_bytes"] == 2 * G
    assert e["action"] == "kill" and node.signals == [(os.getpid(), 9)]
    # killed, and its session ended by the node (whatever else holds the socket)
    assert await w.closed()
    await node.until(lambda: not node.node.conns)
    assert len(node.events("escalate")) == 1


@in_process(gpus=2, memory="40GiB")
async def test_hello_picks_the_gpu_by_uuid_and_the_limit_from_the_portion(node):
    uuid = node.node.gpus[1].uuid
    w = await node.workload(gpu_uuid=uuid, portion=0.5, weight=0.5, name="kai")
    assert (w.welcome.gpu, w.welcome.gpu_uuid) == (1, uuid)
    assert w.welcome.memory_limit == 20 * G and w.welcome.weight == 0.5
    assert w.welcome.simulated and w.welcome.sim_link.endswith(".link1")
    (s,) = node.node.status().gpus[1].sessions
    assert (s.name, s.pid, s.memory_limit_bytes) == ("kai", os.getpid(), 20 * G)


@in_process(memory="40GiB")
async def test_the_request_is_one_figure_in_welcome_status_and_event(node):
    """Issue 37: a session that asked no request is welcomed with its request filled in
    (its limit, as status and metrics show it; the welcome said 0), and its attach
    event says it too (it was left out); one that asked less, its own."""
    none_asked = await node.workload(memory_limit=8 * G, name="none")
    less = await node.workload(memory_limit=8 * G, memory_request=2 * G, name="less")
    whole = await node.workload(name="whole")  # no figure at all: the whole GPU
    rows = {s.id: s for s in node.node.status().gpus[0].sessions}
    events = {e["session"]: e for e in node.events("attach")}
    for w, request in ((none_asked, 8 * G), (less, 2 * G), (whole, 40 * G)):
        assert w.welcome.memory_request == request
        assert rows[w.session].memory_request_bytes == request
        assert events[w.session]["request_bytes"] == request


@in_process()
async def test_claims_are_shown_as_claims_and_only_where_the_kernel_agrees(node):
    # this process, as the kernel would show it inside a pod (a /proc root of our own)
    uid = "6d3e1f20-1a2b-4c3d-9e8f-0a1b2c3d4e5f"
    proc = node.dir / "proc" / str(os.getpid())
    proc.mkdir(parents=True)
    pod_slice = f"kubepods-burstable-pod{uid.replace('-', '_')}.slice"
    scope = f"cri-containerd-{'ab' * 32}.scope"
    path = f"/kubepods.slice/kubepods-burstable.slice/{pod_slice}/{scope}"
    (proc / "cgroup").write_text(f"0::{path}\n")
    node.node.live.config = msgspec.structs.replace(
        node.node.live.config, proc_root=str(node.dir / "proc")
    )
    claim = {"pod": "trainer-7", "namespace": "research", "container": "main"}
    true = await node.workload(memory_limit=G, pod_uid=uid, **claim)
    false = await node.workload(memory_limit=G, pod_uid="another-pod", **claim)
    by_id = {s.id: s for s in node.node.status().gpus[0].sessions}
    s, f = by_id[true.session], by_id[false.session]
    assert (s.namespace, s.pod, s.container) == ("research", "trainer-7", "main")
    # the kernel proves the pod UID, not the names claimed beside it: a claim, shown as one
    assert not s.identity_verified and s.identity_source == "claim" and s.pod_uid == uid
    assert s.runtime == "containerd" and s.container_id == "ab" * 32
    assert (f.namespace, f.pod, f.container, f.identity_verified) == ("", "", "", False)
    assert (f.claimed.pod, f.claimed.namespace) == ("trainer-7", "research")  # shown apart


@in_process(mode="exclusive")
async def test_a_grant_names_the_last_ask_the_node_accepted(node):
    # The client numbers its asks and takes only a grant of its latest: a grant that
    # crossed its withdrawal (Ctrl-C while waiting, then at once a new burst) is not.
    a = await node.workload(memory_limit=G, name="a")
    b = await node.workload(memory_limit=G, name="b")
    await a.send(p.Acquire(ask=1))
    assert (await a.expect(p.Grant)).ask == 1
    await b.send(p.Acquire(ask=1))
    await b.send(p.Release(resident=0, swapped=0))  # withdrawn
    await b.send(p.Acquire(ask=2))
    await b.send(p.Acquire(ask=9))  # refused (a burst is open): changes nothing
    err = await b.expect(p.Error)
    assert "already has a burst open" in err.message
    await a.send(p.Release(resident=0, swapped=0))
    g = await b.expect(p.Grant)
    assert g.ask == 2
    old = await node.workload(memory_limit=G, name="old")  # a client that numbers none
    await b.send(p.Release(resident=0, swapped=0))
    await old.send(p.Acquire())
    assert (await old.expect(p.Grant)).ask == 0

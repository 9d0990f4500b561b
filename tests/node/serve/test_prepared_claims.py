"""DRA claims prepared on the node (node/serve/prepared_claims.py): the plugin's word
checked field by field, and a session that names a claim, or comes from its pod,
attached only within the claim's figures, on its GPU; unprepare ends its sessions."""

from __future__ import annotations

import math
import os

import msgspec
import pytest

from gpushare import protocol as p
from gpushare.node.guard import Refused
from gpushare.node.observe.metrics import Exposition
from gpushare.node.serve.prepared_claims import MAX_CLAIMS, PreparedClaims, check
from tests.node.harness import G, InProcessNode, Peer, in_process

UID = "0f4c5e1a-2b3c-4d5e-8f90-a1b2c3d4e5f6"
POD = "6d3e1f20-1a2b-4c3d-9e8f-0a1b2c3d4e5f"


def prep(**kw: object) -> p.PrepareClaim:
    fields: dict[str, object] = {
        "uid": UID, "namespace": "research", "name": "share", "gpu": 0,
        "memory_request": G, "memory_limit": 2 * G,
    }  # fmt: skip
    return p.PrepareClaim(**(fields | kw))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "bad, says",
    [
        ({"uid": "not a uid"}, "is not a Kubernetes UID"),
        ({"uid": ""}, "is not a Kubernetes UID"),
        ({"namespace": "Research"}, "namespace 'Research' is not a Kubernetes name"),
        ({"name": "x" * 254}, "is not a Kubernetes name of at most 253"),
        ({"gpu": 2}, "gpu 2: this node has GPUs 0..1"),
        ({"gpu": -1}, "gpu -1"),
        ({"pods": ["pod"]}, "pods: 'pod' is not a pod UID"),
        ({"pods": [POD] * 257}, "pods must be at most 256"),
        ({"memory_request": -1}, "memory_request and memory_limit are bytes >= 0"),
        ({"memory_limit": G // 2}, "is below memory_request"),
        ({"weight": -1.0}, "weight -1 is out of range: 0.001 to 1000"),
        ({"weight": math.nan}, "weight nan is out of range"),
        ({"weight": 1e4}, "out of range"),
        ({"compute_limit": 1.5}, "compute_limit 1.5 is not a fraction in (0, 1]"),
        ({"compute_limit": -0.5}, "is not a fraction"),
        ({"compute_limit": math.nan}, "is not a fraction"),
        # a final newline: "$" matched before it (found by an attack)
        ({"uid": UID + "\n"}, "is not a Kubernetes UID"),
        ({"name": "share\n"}, "is not a Kubernetes name"),
        ({"namespace": "research\n"}, "is not a Kubernetes name"),
        ({"pods": [POD, POD + "\n"]}, "is not a pod UID"),
    ],
)
def test_a_prepare_out_of_bounds_is_refused_naming_the_field(bad, says):
    with pytest.raises(p.ProtocolError, match="prepare_claim") as e:
        check(prep(**bad), gpus=2)
    assert says in str(e.value)


def test_a_claim_bounds_a_hellos_limit_and_request():
    c = check(prep(), gpus=1)
    assert c.bounds(8 * G, None) == (2 * G, G)  # asked more: the claim's limit, its request
    assert c.bounds(G // 2, None) == (G // 2, G // 2)  # asked less: less, request within it
    assert c.bounds(8 * G, 4 * G) == (2 * G, G)
    only_request = check(prep(memory_limit=0), gpus=1)
    assert only_request.bounds(8 * G, None) == (G, G)  # no limit given: the request


def test_the_table_is_idempotent_and_bounded():
    t = PreparedClaims()
    c = check(prep(), gpus=1)
    assert t.prepare(c) == "prepared"
    assert t.prepare(c) == "prepared already"
    assert t.prepare(check(prep(memory_request=2 * G), gpus=1)) == "updated"
    for i in range(MAX_CLAIMS - 1):
        t.prepare(check(prep(uid=f"{i:08x}-0000-4000-8000-000000000000"), gpus=1))
    with pytest.raises(Refused, match=f"{MAX_CLAIMS} claims are prepared"):
        t.prepare(check(prep(uid="ffffffff-0000-4000-8000-000000000000"), gpus=1))
    assert len(t.by_uid) == MAX_CLAIMS
    assert t.unprepare(UID) is not None and t.unprepare(UID) is None


async def refused(node: InProcessNode, **hello: object) -> p.Error:
    peer = await Peer.connect(node.socket)
    await peer.send(p.Hello(version=p.PROTOCOL_VERSION, **hello))  # type: ignore[arg-type]
    err = await peer.expect(p.Error)
    assert await peer.closed()
    return err


def in_pod(node: InProcessNode, pod_uid: str) -> None:
    """This process, as the kernel shows one in that pod (a /proc root of the test's)."""
    proc = node.dir / "proc" / str(os.getpid())
    proc.mkdir(parents=True, exist_ok=True)
    slice_ = f"kubepods-besteffort-pod{pod_uid.replace('-', '_')}.slice"
    path = f"/kubepods.slice/kubepods-besteffort.slice/{slice_}/cri-containerd-{'cd' * 32}.scope"
    (proc / "cgroup").write_text(f"0::{path}\n")
    node.node.live.config = msgspec.structs.replace(
        node.node.live.config, proc_root=str(node.dir / "proc")
    )


@in_process(gpus=2, policy="weighted")
async def test_a_session_naming_its_claim_attaches_within_it_and_is_shown_by_it(node):
    r = await node.ask(prep(weight=3.0, pods=[POD]))
    assert isinstance(r, p.Done) and r.message == "claim research/share prepared"
    again = await node.ask(prep(weight=3.0, pods=[POD]))
    assert isinstance(again, p.Done) and again.message.endswith("prepared already")
    w = await node.workload(memory_limit=8 * G, weight=50.0, claim=UID, name="trainer")
    assert (w.welcome.memory_limit, w.welcome.memory_request) == (2 * G, G)
    (s,) = node.node.status().gpus[0].sessions
    assert (s.claim, s.weight, s.weight_source) == (UID, 3.0, "claim")
    assert node.events("attach")[0]["limit_bytes"] == 2 * G
    # its series carry the claim beside pod and namespace; a session without one, none
    free = await node.workload(memory_limit=G, name="free", gpu=1)
    lines = Exposition().render(node.node.status()).decode().splitlines()
    limits = [x for x in lines if x.startswith("gpushare_memory_limit_bytes{")]
    assert [f'claim="{UID}"' in x for x in limits] == [True, False], limits
    assert f'session="{free.session}"' in limits[1]
    # elsewhere than its GPU, or a claim never prepared: refused, and nothing attached
    err = await refused(node, memory_limit=G, claim=UID, gpu=1)
    assert err.code == "claim" and "is on GPU 0, not GPU 1" in err.message
    err = await refused(node, memory_limit=G, claim="aaaaaaaa-0000-4000-8000-000000000000")
    assert err.code == "claim" and "is not prepared on this node" in err.message
    assert "unset GPUSHARE_CLAIM" in err.message
    assert [s.id for g in node.node.status().gpus for s in g.sessions] == [w.session, free.session]
    # a bad prepare changes nothing: the claim's figures stay as they were
    bad = await node.ask(prep(memory_limit=1))
    assert isinstance(bad, p.Error) and "below memory_request" in bad.message
    assert node.node.claims.by_uid[UID].memory_limit == 2 * G


@in_process(gpus=2)
async def test_a_pods_process_is_bound_by_its_claim_without_naming_it(node):
    in_pod(node, POD)
    await node.ask(prep(pods=[POD]))
    w = await node.workload(memory_limit=8 * G, name="sly")  # GPUSHARE_CLAIM unset
    assert (w.welcome.memory_limit, w.welcome.memory_request) == (2 * G, G)
    assert node.node.status().gpus[0].sessions[0].claim == UID
    err = await refused(node, memory_limit=G, gpu=1)  # a GPU its claims do not give
    assert err.code == "claim" and "through ResourceClaims on GPU 0, not GPU 1" in err.message
    other = "bbbbbbbb-0000-4000-8000-000000000000"
    await node.ask(prep(uid=other, name="second", pods=[POD]))
    err = await refused(node, memory_limit=G)
    assert "has 2 claims on GPU 0" in err.message and "name one with GPUSHARE_CLAIM" in err.message
    named = await node.workload(memory_limit=8 * G, claim=other, name="named")
    assert named.welcome.memory_limit == 2 * G
    # a claim reserved for other pods is not this pod's to name
    third = "cccccccc-0000-4000-8000-000000000000"
    await node.ask(prep(uid=third, name="theirs", pods=["dddddddd-0000-4000-8000-000000000000"]))
    err = await refused(node, memory_limit=G, claim=third)
    assert "reserved for other pods" in err.message


@in_process()
async def test_unprepare_ends_the_claims_sessions_and_forgets_it(node):
    await node.ask(prep())
    w = await node.workload(memory_limit=G, claim=UID, name="trainer")
    free = await node.workload(memory_limit=G, name="unclaimed")
    r = await node.ask(p.UnprepareClaim(uid=UID))
    assert isinstance(r, p.Done)
    assert r.message == f"claim research/share unprepared; session {w.session} ended"
    err = await w.expect(p.Error)
    assert err.code == "ended" and "its ResourceClaim was unprepared" in err.message
    await node.until(lambda: node.events("detach"))
    assert [s.id for s in node.node.status().gpus[0].sessions] == [free.session]
    again = await node.ask(p.UnprepareClaim(uid=UID))  # the kubelet may ask again
    assert isinstance(again, p.Done) and "is not prepared on this node" in again.message
    err = await refused(node, memory_limit=G, claim=UID)
    assert "is not prepared" in err.message
    bad = await node.ask(p.UnprepareClaim(uid=UID, grace_s=-1))
    assert isinstance(bad, p.Error) and bad.code == "value"


@in_process()
async def test_a_session_back_after_a_restart_keeps_its_claim_until_the_plugin_resends(node):
    await node.ask(prep())
    w = await node.workload(memory_limit=G, claim=UID, name="trainer")
    sid = w.session
    await node.settle()
    await node.restart()  # the prepared claims are gone with the node: the plugin resends
    back = await node.workload(memory_limit=G, claim=UID, name="trainer", session=sid)
    assert back.session == sid
    (s,) = node.node.status().gpus[0].sessions
    assert s.claim == UID
    err = await refused(node, memory_limit=G, claim=UID)  # a new one: not until resent
    assert "is not prepared" in err.message
    await node.ask(prep())
    err = await refused(node, memory_limit=8 * G, claim=UID)  # the claim is back's
    assert err.code == "claim" and f"is held by session {sid} already" in err.message
    back.close()
    await node.until(lambda: not node.node.status().gpus[0].sessions)
    again = await node.workload(memory_limit=8 * G, claim=UID, name="new")
    assert again.welcome.memory_limit == 2 * G


def in_pod_as_itself(node: InProcessNode, pod_uid: str) -> None:
    """:func:`in_pod`, with this process's stat and status shown too, so that the node
    can match it to its record after a restart."""
    in_pod(node, pod_uid)
    proc = node.dir / "proc" / str(os.getpid())
    for f in ("stat", "status"):
        if not (proc / f).exists():
            (proc / f).symlink_to(f"/proc/{os.getpid()}/{f}")


@in_process(policy="weighted")
async def test_back_after_a_restart_before_the_resend_it_is_held_to_its_claim(node):
    # (found by an attack: the record kept only the limit, so the weight and request were
    # the hello's word again until the plugin's next resync)
    in_pod_as_itself(node, POD)
    await node.ask(prep(pods=[POD], memory_request=G // 2, memory_limit=2 * G, weight=0.5))
    w = await node.workload(memory_limit=8 * G, claim=UID, name="t")
    sid = w.session
    await node.settle()
    await node.restart()
    in_pod_as_itself(node, POD)
    back = await node.workload(
        session=sid, memory_limit=2 * G, memory_request=2 * G, weight=1000.0, claim=UID, name="t"
    )
    assert back.session == sid
    (s,) = node.node.status().gpus[0].sessions
    got = (back.welcome.memory_request, back.welcome.weight, s.weight_source, s.claim)
    assert got == (G // 2, 0.5, "claim", UID)


@in_process(memory="16GiB")
async def test_a_claim_is_one_sessions_share_a_second_is_refused_in_one_line(node):
    # (found by an attack: four sessions of one pod each got the claim's whole share)
    in_pod(node, POD)
    await node.ask(prep(pods=[POD], memory_request=G, memory_limit=2 * G))
    first = await node.workload(memory_limit=8 * G, name="w0")
    assert first.welcome.memory_limit == 2 * G
    for named in ({}, {"claim": UID}):  # by its pod, or by name
        err = await refused(node, memory_limit=8 * G, **named)
        assert err.code == "claim" and "\n" not in err.message
        assert f"is held by session {first.session} already" in err.message
        assert "a claim of its own" in err.message
    assert len(node.node.status().gpus[0].sessions) == 1
    first.close()
    await node.until(lambda: not node.node.status().gpus[0].sessions)
    second = await node.workload(memory_limit=8 * G, name="w1")  # the share is free again
    assert second.welcome.memory_limit == 2 * G


@in_process()
async def test_a_claim_reserved_for_no_pod_is_not_a_pods_to_name(node):
    # (found by an attack: a pod bound by its own claim stepped out of it by naming one
    # whose reservedFor held no pod)
    in_pod(node, POD)
    await node.ask(prep(pods=[POD], memory_request=G, memory_limit=G))
    open_ = "eeeeeeee-0000-4000-8000-000000000000"
    await node.ask(prep(uid=open_, name="open", pods=[], memory_request=8 * G, memory_limit=8 * G))
    err = await refused(node, memory_limit=8 * G, claim=open_)
    assert err.code == "claim" and "reserved for other pods" in err.message


@in_process()
async def test_a_claims_compute_limit_is_the_nodes_word_not_only_the_envs(node):
    # (found by an attack: the claim's computeLimit reached only the container's env,
    # which a workload may unset)
    await node.ask(prep(compute_limit=0.5))
    for asked, held in ((None, 0.5), (0.25, 0.25), (0.9, 0.5)):
        w = await node.workload(memory_limit=G, claim=UID, name="t", compute_limit=asked)
        (s,) = node.node.status().gpus[0].sessions
        assert s.compute_limit == held, (asked, s.compute_limit)
        w.close()
        await node.until(lambda: not node.node.status().gpus[0].sessions)


@in_process()
async def test_no_process_joins_a_session_its_claims_unprepare_is_ending(node, monkeypatch):
    # (found by an attack: a member joining in an unprepare's grace was never ended)
    from gpushare.node.serve import workload_server

    monkeypatch.setattr(workload_server, "descends", lambda pid, ancestor, root: True)
    await node.ask(prep())
    head = await node.workload(memory_limit=8 * G, claim=UID, name="head")
    r = await node.ask(p.UnprepareClaim(uid=UID, grace_s=10.0))
    assert isinstance(r, p.Done) and "ending" in r.message
    err = await refused(node, memory_limit=G, family=head.session, name="member")
    assert err.code == "family" and f"session {head.session} is being ended" in err.message
    await node.until(lambda: not node.node.status().gpus[0].sessions)  # ended after the grace

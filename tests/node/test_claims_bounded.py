"""A workload's word buys it nothing the node could not give it (issue 38): a GPU's mode
is its administrator's, and a session's compute-sharing mode and memory limit are
bounded by what the node can check (its pod through the API under ``--kubernetes``,
else the node's own settings). In process on virtual time, and one outside check with
real processes."""

from __future__ import annotations

import json
import logging
import os
import time
import types

import msgspec
import pytest

from gpushare import protocol as p
from gpushare.node.kube.k8s import PodCache
from tests.node.harness import G, InProcessNode, Peer, in_process
from tests.support import sim

POD_UID, CID = "6d3e1f20-1a2b-4c3d-9e8f-0a1b2c3d4e5f", "ab" * 32


def in_pod(node: InProcessNode, annotations: dict[str, str]) -> PodCache:
    """This process, as the kernel and the API see it: in a pod with ``annotations``."""
    proc = node.dir / "proc" / str(os.getpid())
    proc.mkdir(parents=True, exist_ok=True)
    slice_ = f"kubepods-burstable-pod{POD_UID.replace('-', '_')}.slice"
    (proc / "cgroup").write_text(f"0::/kubepods.slice/{slice_}/cri-containerd-{CID}.scope\n")
    node.node.live.config = msgspec.structs.replace(
        node.node.live.config, proc_root=str(node.dir / "proc")
    )
    pod = {
        "metadata": {"uid": POD_UID, "namespace": "research", "name": "train-7",
                     "annotations": annotations},
        "status": {"containerStatuses": [{"name": "trainer", "containerID": f"containerd://{CID}"}]},
    }  # fmt: skip
    node.node.pods = cache = PodCache()
    cache.replace([pod])
    return cache


async def granted(node: InProcessNode, n: int, **hello) -> list[int]:
    """``n`` more sessions that each ask for the GPU; the ids the node lets hold at once."""
    ws = [await node.workload(memory_limit=2 * G, name=f"w{i}", **hello) for i in range(n)]
    node.__dict__.setdefault("kept", []).extend(ws)  # open until the node stops
    for w in ws:
        await w.send(p.Acquire())
    await node.settle()
    return list(node.node.status().gpus[0].holders)


@in_process(mode="exclusive")
async def test_a_workload_cannot_choose_sm_sharing_on_an_exclusive_gpu(node):
    assert len(await granted(node, 3, sharing="sm-sharing")) == 1
    s = node.node.status().gpus[0].sessions[0]
    assert (s.sharing, s.sharing_source, s.claimed.sharing) == ("", "", "sm-sharing")


@in_process(mode="auto")
async def test_a_workload_cannot_choose_time_slicing_on_an_auto_gpu(node):
    # exclusive quanta for itself would keep everyone else from holding beside it
    await granted(node, 1, sharing="time-slicing")
    assert len(await granted(node, 2)) == 3


@in_process(mode="exclusive", workload_sharing=True)
async def test_where_the_node_allows_it_a_workload_chooses_its_sharing_mode(node):
    assert len(await granted(node, 3, sharing="sm-sharing")) == 3
    s = node.node.status().gpus[0].sessions[0]
    assert (s.sharing, s.sharing_source) == ("sm-sharing", "workload")


@in_process(mode="exclusive", workload_sharing=True)
async def test_under_kubernetes_the_pods_annotation_counts_not_the_hello(node):
    in_pod(node, {})  # the API knows the pod: no compute-sharing mode written
    assert len(await granted(node, 3, sharing="sm-sharing")) == 1


@in_process(mode="exclusive")
async def test_under_kubernetes_a_pod_annotated_sm_sharing_holds_beside_others(node):
    in_pod(node, {"kai.scheduler/gpu-compute-sharing-mode": "sm-sharing"})
    assert len(await granted(node, 3)) == 3  # its word unsaid: the pod's is read
    s = node.node.status().gpus[0].sessions[0]
    assert (s.sharing, s.sharing_source) == ("sm-sharing", "kubernetes")


@pytest.mark.parametrize(
    ("annotations", "limit"),
    [
        ({"gpu-fraction": "0.25"}, 4 * G),
        ({"gpu-fraction": "0.25", "gpu-fraction.limit": "0.5"}, 8 * G),
        ({"gpu-memory": "2048"}, 2 * G),
        ({"gpu-memory.limit": "3Gi", "gpu-memory": "1024"}, 3 * G),
        ({"nvidia.com/container.trainer.gpu-memory.limit": "5Gi"}, 5 * G),
        ({"nvidia.com/container.other.gpu-memory.limit": "5Gi"}, 16 * G),  # not its container
        ({"gpu-memory": "lots", "gpu-fraction": "0.125"}, 2 * G),  # unreadable: the next
        ({}, 16 * G),  # KAI gave it no fraction: the whole GPU, as before
    ],
)
@in_process(memory="16GiB")
async def test_under_kubernetes_a_memory_limit_is_bounded_by_the_pods_annotations(
    node, annotations, limit
):
    in_pod(node, annotations)
    w = await node.workload(memory_limit=16 * G, memory_request=12 * G, name="greedy")
    assert w.welcome.memory_limit == limit
    assert (w.welcome.memory_request or limit) == min(12 * G, limit)  # 0: the limit
    (s,) = node.node.status().gpus[0].sessions
    assert s.memory_limit_bytes == limit


@in_process(memory="16GiB")
async def test_a_limit_within_the_pods_is_kept(node):
    in_pod(node, {"gpu-fraction": "0.5"})
    w = await node.workload(memory_limit=2 * G, name="modest")
    assert w.welcome.memory_limit == 2 * G


# --- the outside check: real processes -----------------------------------------------


def test_three_workloads_claiming_sm_sharing_on_an_exclusive_node_hold_one_at_a_time(
    node_factory, short_tmp
):
    """Three real workloads whose downward-API annotations say sm-sharing, on a plain node
    whose GPU is in mode exclusive: never more than one holder, by status sampled all
    along and by the events' leases."""
    podinfo = short_tmp / "podinfo"
    podinfo.mkdir()
    (podinfo / "annotations").write_text('kai.scheduler/gpu-compute-sharing-mode="sm-sharing"\n')
    node = node_factory(*sim("80GiB", mode="exclusive", tq="0.5"))
    env = {**os.environ, "GPUSHARE_PODINFO": str(podinfo)}
    procs = [
        node.workload("batch", "--memory", "10GiB", "--seconds", "3", "--name", f"sm{i}", env=env)
        for i in range(3)
    ]
    samples = []
    while any(pr.poll() is None for pr in procs):
        samples.append(node.status()["gpus"][0])
        time.sleep(0.02)  # a look every 20 ms: the invariants hold in every one
    outs = [pr.communicate(timeout=60) for pr in procs]
    assert all(pr.returncode == 0 for pr in procs), [o[1][-2000:] for o in outs]
    assert all(json.loads(o[0].strip().splitlines()[-1])["failures"] == 0 for o in outs)
    assert samples and max(len(s["holders"]) for s in samples) == 1
    assert any(len(s["sessions"]) == 3 and s["queue"] for s in samples)  # they did contend
    sessions = [x for s in samples for x in s["sessions"]]
    assert {x["claimed"]["sharing"] for x in sessions} == {"sm-sharing"}
    assert {x["sharing"] for x in sessions} == {""}
    # The leases, from the node's events: each grant's session until its release.
    holding: set[int] = set()
    most = 0
    for e in node.event_list():
        if e["event"] == "grant":
            holding.add(e["session"])
        elif e["event"] in ("release", "detach"):
            holding.discard(e["session"])
        most = max(most, len(holding))
    assert most == 1, most


# --- a compute limit is the workload's -----------------------------------------------


@in_process(mode="exclusive", tq=1)
async def test_detaching_and_attaching_again_gets_no_new_compute_bucket(node):
    """A workload capped at 0.3 of the GPU that ends its session at every revoke and
    attaches again at once (a new session, a full bucket each time before): over 20 s
    it holds no more than its share and one bucket (0.3 x 20 + 0.3 x 10 s)."""
    start = node.clock.monotonic()
    held = 0.0
    while node.clock.monotonic() - start < 20:
        w = await node.workload(memory_limit=G, name="sneaky", compute_limit=0.3)
        await w.send(p.Acquire())
        await w.expect(p.Grant)
        await w.expect(p.Revoke)  # its bucket ran dry
        w.close()
        await node.until(lambda: not node.node.status().gpus[0].sessions)
    held = sum(e["seconds"] for e in node.events("release"))
    print(f"held {held:.2f} s of 20 s at a limit of 0.3")
    assert held <= 0.3 * 20 + 0.3 * 10 + 0.5, held


# --- names that would not show as themselves -------------------------------------------


@pytest.mark.parametrize(
    ("field", "text", "code"),
    [
        ("name", "train\u202egnp.exe", "U+202E"),  # right-to-left override
        ("name", "a\u2066b\u2069", "U+2066"),  # left-to-right isolate
        ("name", "jo\u200bb", "U+200B"),  # zero width space
        ("name", "two\u2028lines", "U+2028"),  # line separator
        ("pod", "p\u202d", "U+202D"),
        ("container", "c\ufeff", "U+FEFF"),
        ("gang", "job\u061c", "U+061C"),  # Arabic letter mark
        ("name", "\x9b31m", "U+009B"),  # C1 control sequence introducer
    ],
)
@in_process()
async def test_names_with_bidi_or_invisible_characters_are_refused(node, field, text, code):
    peer = await Peer.connect(node.socket)
    await peer.send(p.Hello(version=p.PROTOCOL_VERSION, memory_limit=G, **{field: text}))
    err = await peer.expect(p.Error)
    assert err.code == "attach" and f"{field} holds control characters ({code}" in err.message
    assert await peer.closed()
    assert node.node.status().gpus[0].sessions == []


@in_process()
async def test_names_in_any_script_are_welcome(node):
    name = "Überprüfung-тест-训练-تدريب"
    w = await node.workload(memory_limit=G, name=name)
    assert w.welcome.name == name
    assert [s.name for s in node.node.status().gpus[0].sessions] == [name]


# --- memory after a restart: no more than the record ------------------------------------


@pytest.mark.parametrize("nvml", ["simulated", "cannot say", "unlisted"])
@in_process(memory="80GiB", mode="exclusive", tq=5)
async def test_a_session_on_record_nvml_does_not_list_is_believed_no_more_than_its_record(
    node, nvml
):
    from tests.node.observe.test_nvml_memory import PID, real_gpu

    b = await node.workload(memory_limit=30 * G, name="b")
    await b.send(p.Acquire())
    await b.expect(p.Grant)
    await b.send(p.Report(resident=10 * G, swapped=0), p.Release(resident=10 * G, swapped=0))
    await node.settle()
    await node.restart()  # b outlives it, on record with 10 GiB
    if nvml != "simulated":
        real_gpu(node, {PID: None} if nvml == "cannot say" else {PID + 1: G})
    b2 = await node.workload(session=b.session, memory_limit=30 * G, name="b", resident=30 * G)
    assert b2.session == b.session  # back, on record
    (s,) = node.node.status().gpus[0].sessions
    assert s.resident_bytes == 10 * G  # its record's, not the 30 GiB it says
    b2.close()


# --- GPU work a session's program starts outside gpushare is said ------------------------


@in_process(memory="80GiB", mode="exclusive")
async def test_a_child_on_the_gpu_outside_the_session_is_said_not_left_unsaid(node, caplog):
    """A process the session's program started with a clean environment (no
    GPUSHARE_FAMILY, so it never joined) that the GPU shows with memory: the node cannot
    gate it, but it says so, once, in the log and as an ``ungated`` event."""
    import subprocess

    from tests.node.observe.test_nvml_memory import PID, real_gpu

    w = await node.workload(memory_limit=10 * G, name="parent")
    child = subprocess.Popen(["sleep", "60"], env={})  # a clean environment
    try:
        nvml = real_gpu(node, {PID: G, child.pid: 3 * G, 1: 5 * G})  # 1: no session's child
        nvml.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=50)
        with caplog.at_level(logging.WARNING, logger="gpushare.node"):
            node.node.sampler.sample(1.0)
            node.node.sampler.sample(1.0)  # said once
        (ev,) = node.events("ungated")
        assert (ev["session"], ev["pid"], ev["used_bytes"], ev["gpu"]) == (
            w.session, child.pid, 3 * G, 0,
        )  # fmt: skip
        said = [r.getMessage() for r in caplog.records if "ungated" in r.getMessage()]
        assert len(said) == 1 and f"process {child.pid}" in said[0]
        assert "GPUSHARE_FAMILY" in said[0]
    finally:
        child.kill()
        child.wait()
        w.close()


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(x) for x in f.read().split()]


@in_process(memory="80GiB", mode="exclusive")
async def test_a_grandchild_on_the_gpu_outside_the_session_is_said_too(node, caplog):
    """Issue 38 item 12: a process two generations down (a shell the program started
    with a clean environment, and the process that shell started) on the GPU with memory
    is said as its session's, as a child is: the chain of parents is followed, not one
    step of it."""
    import subprocess

    from tests.node.observe.test_nvml_memory import PID, real_gpu

    w = await node.workload(memory_limit=10 * G, name="parent")
    shell = subprocess.Popen(["sh", "-c", "sleep 60; true"], env={})  # it forks sleep
    grandchild = 0
    try:
        deadline = time.monotonic() + 10
        while not _children(shell.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        (grandchild,) = _children(shell.pid)
        nvml = real_gpu(node, {PID: G, grandchild: 2 * G})
        nvml.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=50)
        with caplog.at_level(logging.WARNING, logger="gpushare.node"):
            node.node.sampler.sample(1.0)
        (ev,) = node.events("ungated")
        assert (ev["session"], ev["pid"], ev["used_bytes"]) == (w.session, grandchild, 2 * G)
    finally:
        if grandchild:
            os.kill(grandchild, 9)  # (the shell's wait reaps it)
        shell.kill()
        shell.wait()
        w.close()

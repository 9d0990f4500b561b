"""Gangs through a running node (in process, virtual time): the ranks of one job, told
by their hellos, are granted as one holder; the job's key is the kernel's identity and
the job's id; figures out of bounds and jobs spanning nodes in mode exclusive are
refused; status shows each session's gang."""

from __future__ import annotations

import asyncio
import io
import os

from gpushare import protocol as p
from gpushare.tools.ctl import show_status
from tests.node.harness import G, InProcessNode, Workload, in_process


async def rank(node: InProcessNode, job: str, r: int, size: int = 2, **hello: object):
    return await node.workload(
        memory_limit=2 * G, name=f"{job}-{r}", gang=job, gang_size=size, rank=r, **hello
    )


@in_process(mode="exclusive", tq=5)
async def test_a_jobs_ranks_are_granted_together_and_shown(node: InProcessNode) -> None:
    r0, r1 = await rank(node, "job", 0), await rank(node, "job", 1)
    other = await node.workload(memory_limit=2 * G, name="other")
    await r0.send(p.Acquire())
    await r0.expect(p.Grant)
    await other.send(p.Acquire())
    await r1.send(p.Acquire())
    await r1.expect(p.Grant)  # joins its job's lease while "other" waits
    status = node.node.status()
    gpu = status.gpus[0]
    key = f"job@uid:{os.getuid()}"
    assert sorted(gpu.holders) == sorted([r0.session, r1.session])
    assert [(g.gang, g.sessions, g.size, g.state) for g in gpu.gangs] == [
        (key, sorted([r0.session, r1.session]), 2, "holding")
    ]
    by_id = {s.id: s for s in gpu.sessions}
    assert (by_id[r1.session].gang, by_id[r1.session].gang_rank) == (key, 1)
    assert (by_id[other.session].gang, by_id[other.session].gang_rank) == ("", -1)
    text = io.StringIO()
    show_status(status, text)
    assert (
        f"gang {key}: sessions" in text.getvalue() and "(2 of 2 ranks) holding" in text.getvalue()
    )
    attach = next(e for e in node.events("attach") if e["session"] == r0.session)
    assert attach["gang"] == key and attach["gang_size"] == 2
    # The quantum ends: both ranks are revoked, and "other" waits until both yielded.
    revokes = [await r.expect(p.Revoke) for r in (r0, r1)]
    await r0.send(p.Release(resident=0, swapped=0, again=True))
    await node.settle()
    assert node.node.status().gpus[0].holders == [r1.session]
    await r1.send(p.Release(resident=0, swapped=0, again=True))
    await other.expect(p.Grant)
    assert {r.grace_s for r in revokes} == {node.node.arbiters[0].settings.grace_s}


@in_process(mode="exclusive")
async def test_a_job_spanning_nodes_is_refused_in_exclusive_mode(node: InProcessNode) -> None:
    peer = Workload(*await asyncio.open_unix_connection(node.socket))
    await peer.send(p.Hello(version=1, memory_limit=G, gang="big", gang_size=2, world_size=16))
    err = await peer.expect(p.Error)
    assert err.code == "attach" and "ranks on other nodes" in err.message
    assert "mode auto" in err.message and "\n" not in err.message
    assert not node.node.arbiters[0].sessions


@in_process(mode="auto")
async def test_a_job_spanning_nodes_is_a_gang_flagged_in_mode_auto(node: InProcessNode) -> None:
    r0 = await rank(node, "big", 0, world_size=16)
    (g,) = node.node.status().gpus[0].gangs
    assert g.spans_nodes and g.size == 2
    text = io.StringIO()
    show_status(node.node.status(), text)
    assert "spans nodes" in text.getvalue()
    assert [e["spans_nodes"] for e in node.events("attach")] == [True]
    assert r0.welcome.gpu == 0


@in_process(gpus=2, mode="exclusive")
async def test_a_job_on_two_exclusive_gpus_is_granted_on_both_at_once(node: InProcessNode) -> None:
    a0, a1 = await rank(node, "a", 0, gpu=0), await rank(node, "a", 1, gpu=1)
    b0, b1 = await rank(node, "b", 0, gpu=0), await rank(node, "b", 1, gpu=1)
    await a0.send(p.Acquire())
    await a0.expect(p.Grant)
    await b1.send(p.Acquire())  # GPU 1 is a's, though its rank there has not asked
    await b0.send(p.Acquire())
    await a1.send(p.Acquire())
    await a1.expect(p.Grant)
    await node.settle()
    assert [a.holders for a in node.node.arbiters] == [[a0.session], [a1.session]]
    # The quantum ends on both; both of a's ranks yield, then b starts on both at once.
    for r in (a0, a1):
        await r.expect(p.Revoke)
        await r.send(p.Release(resident=0, swapped=0, again=True))
    await b0.expect(p.Grant)
    await b1.expect(p.Grant)
    assert [a.holders for a in node.node.arbiters] == [[b0.session], [b1.session]]


@in_process(gpus=2, mode="exclusive")
async def test_a_job_on_gpus_in_two_modes_is_refused_with_the_fix(node: InProcessNode) -> None:
    await node.ask(p.SetConfig(gpu=1, mode="auto"))
    r0 = await rank(node, "job", 0, gpu=0)
    peer = Workload(*await asyncio.open_unix_connection(node.socket))
    await peer.send(p.Hello(version=1, memory_limit=G, gpu=1, gang="job", gang_size=2, rank=1))
    err = await peer.expect(p.Error)
    assert err.code == "attach" and "GPUs 0 (exclusive), 1 (auto)" in err.message
    assert "set one mode on its GPUs" in err.message and "\n" not in err.message
    assert not node.node.arbiters[1].sessions and r0.session in node.node.arbiters[0].sessions
    other = await rank(node, "other-job", 0, gpu=1)  # another job: no matter
    assert other.session in node.node.arbiters[1].sessions


@in_process(gpus=2, mode="auto")
async def test_a_job_on_two_gpus_in_mode_auto_is_a_gang_on_each(node: InProcessNode) -> None:
    ranks = [await rank(node, "job", r, gpu=r) for r in (0, 1)]
    assert [list(a.gangs) for a in node.node.arbiters] == [[f"job@uid:{os.getuid()}"]] * 2
    assert [r.welcome.gpu for r in ranks] == [0, 1]

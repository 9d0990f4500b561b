"""A grant's bound (room above the request up to the limit) on a real GPU too (issue 39).

The torch backend's allocator asks before it grows past a bound (gs_on_grow: the
allocation is a safe point), so the node lends bounds on real GPUs as on simulated ones.
GPU 0 is marked real here (the hello is a torch-backend client's)."""

from __future__ import annotations

import dataclasses

from gpushare import protocol as p
from tests.node.harness import G, InProcessNode, in_process


def real_gpu(node: InProcessNode) -> None:
    node.node.gpus[0] = dataclasses.replace(node.node.gpus[0], simulated=False)


@in_process(memory="80GiB", mode="auto")
async def test_a_torch_session_on_a_real_gpu_is_granted_a_bound_below_its_limit(node):
    real_gpu(node)
    w = await node.workload(
        memory_limit=40 * G, memory_request=10 * G, name="t", backend="torch", grows=True
    )
    await w.send(p.Acquire())
    g = await w.expect(p.Grant)
    assert 0 < g.bound < 40 * G  # lent up to its request, not counted at its limit
    (s,) = node.node.status().gpus[0].sessions
    assert s.memory_bound_bytes == g.bound
    w.close()


@in_process(memory="80GiB", mode="auto")
async def test_a_client_that_does_not_ask_is_still_counted_at_its_limit(node):
    real_gpu(node)
    w = await node.workload(memory_limit=40 * G, memory_request=10 * G, name="t", backend="torch")
    await w.send(p.Acquire())
    g = await w.expect(p.Grant)
    assert g.bound in (0, 40 * G)  # no bound lent: it may not wait for room
    w.close()

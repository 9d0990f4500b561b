"""What leaves a running node, in process on virtual time: grants and revokes at the
quanta's ends on the node's clock, leases handed on at once when a holder goes, and what
each escalation would signal (recorded, never sent)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import types

import pytest

from gpushare import protocol as p
from tests.node.harness import G, InProcessNode, Peer, Workload, in_process

PID = os.getpid()


async def holder_and_waiter(node: InProcessNode, limit: int = G) -> tuple[Workload, Workload]:
    a = await node.workload(memory_limit=limit, name="a")
    await a.send(p.Acquire())
    await a.expect(p.Grant)
    b = await node.workload(memory_limit=limit, name="b")
    await b.send(p.Acquire())
    await node.until(lambda: node.node.arbiters[0].queue)
    return a, b


@in_process(mode="exclusive", tq=5)
async def test_quanta_end_on_the_nodes_clock_and_rotate(node):
    t0 = node.clock.monotonic()
    a, b = await holder_and_waiter(node)
    r = await a.expect(p.Revoke)
    assert node.clock.monotonic() - t0 == pytest.approx(5)
    assert (r.grace_s, r.lease) == (5.0, 1)
    await a.send(p.Release(resident=0, swapped=0, again=True))  # yields, wants more
    g = await b.expect(p.Grant)
    assert (g.quantum_s, g.shared) == (5.0, False)
    await b.expect(p.Revoke)  # and so on, a quantum each
    assert node.clock.monotonic() - t0 == pytest.approx(10)
    await b.send(p.Release(resident=0, swapped=0))
    await a.expect(p.Grant)
    kinds = [e["event"] for e in node.events() if e["event"] in ("grant", "revoke", "release")]
    assert kinds == ["grant", "revoke", "release", "grant", "revoke", "release", "grant"]


@in_process(mode="exclusive", tq=5)
async def test_nobody_waiting_the_lease_is_renewed_without_a_switch(node):
    a = await node.workload(memory_limit=G)
    await a.send(p.Acquire())
    await a.expect(p.Grant)
    with pytest.raises(TimeoutError):
        await a.recv(timeout=60)  # twelve quanta pass, nothing is said
    assert node.node.arbiters[0].holders == [a.session]
    assert [e["event"] for e in node.events()] == ["attach", "grant"]


@in_process(mode="exclusive", tq=60)
async def test_a_holder_that_goes_hands_its_lease_on_at_once(node):
    a, b = await holder_and_waiter(node)
    t = node.clock.monotonic()
    a.close()  # crash, kill, closed socket: all the node sees is the end
    await b.expect(p.Grant)
    assert node.clock.monotonic() == t  # not after the 60 s quantum
    (d,) = node.events("detach")
    assert d["reason"] == "disconnected" and not node.node.utilization[0].by_session.get(1)


@in_process(mode="exclusive", tq=10)
async def test_a_shorter_tq_cuts_the_running_quantum_and_applies_from_the_next(node):
    t0 = node.clock.monotonic()
    a, b = await holder_and_waiter(node)
    await node.ask(p.SetConfig(tq_s=2))
    await a.expect(p.Revoke)
    # the running quantum ends at its start plus the new TQ, not after the old 10 s
    assert node.clock.monotonic() - t0 == pytest.approx(2)
    await a.send(p.Release(resident=0, swapped=0, again=True))
    g = await b.expect(p.Grant)
    assert g.quantum_s == 2


@in_process(mode="exclusive", tq=10)
async def test_a_longer_tq_leaves_the_running_quantum_as_it_was(node):
    t0 = node.clock.monotonic()
    a, b = await holder_and_waiter(node)
    await node.ask(p.SetConfig(tq_s=60))
    await a.expect(p.Revoke)
    assert node.clock.monotonic() - t0 == pytest.approx(10)
    await a.send(p.Release(resident=0, swapped=0, again=True))
    assert (await b.expect(p.Grant)).quantum_s == 60


@in_process(mode="exclusive", tq=1, grace=2, escalation="freeze")
async def test_freeze_stops_the_holder_hands_the_lease_on_and_thaws_it_at_its_turn(node):
    t0 = node.clock.monotonic()
    a, b = await holder_and_waiter(node)
    await a.expect(p.Revoke)  # a never answers
    await b.expect(p.Grant)
    assert node.clock.monotonic() - t0 == pytest.approx(1 + 2)  # quantum, then grace
    # b's grant goes at once; the SIGSTOP once a's stopped processes are on disk
    await node.until(lambda: node.signals)
    assert node.signals == [(PID, signal.SIGSTOP)]
    (e,) = node.events("escalate")
    assert (e["action"], e["reason"], e["grace_s"]) == ("freeze", "no_yield_within_grace", 2)
    assert node.events("release")[-1]["reason"] == "frozen"
    assert node.node.status().gpus[0].sessions[0].frozen
    await b.send(p.Release(resident=0, swapped=0))  # b's burst ends: a's turn
    await a.expect(p.Grant)
    assert node.signals == [(PID, signal.SIGSTOP), (PID, signal.SIGCONT)]  # continued first
    assert not node.node.status().gpus[0].sessions[0].frozen


@in_process(mode="exclusive", tq=1, grace=1, escalation="kill")
async def test_kill_signals_once_and_the_lease_goes_with_the_session(node):
    a, b = await holder_and_waiter(node)
    await a.expect(p.Revoke)
    await node.until(lambda: node.signals)
    assert node.signals == [(PID, signal.SIGKILL)]
    # the node ends the session too: whatever still holds its socket (a process of
    # another uid, never signalled) keeps no lease
    assert await a.closed()
    await b.expect(p.Grant)
    assert node.signals == [(PID, signal.SIGKILL)]
    assert node.events("escalate")[0]["action"] == "kill"


@in_process(mode="exclusive", tq=1, grace=1, escalation="log")
async def test_log_only_logs(node, caplog):
    caplog.set_level(logging.WARNING, logger="gpushare.node")
    a, b = await holder_and_waiter(node)
    await a.expect(p.Revoke)
    await node.until(lambda: node.events("escalate"))
    with pytest.raises(TimeoutError):
        await b.recv(timeout=30)  # no grant while the stubborn burst lasts
    assert node.signals == [] and f"escalation log for session 1 (pid {PID})" in caplog.text
    await a.send(p.Release(resident=0, swapped=0))  # it ends by itself
    await b.expect(p.Grant)


@in_process(memory="10GiB", mode="exclusive", tq=1, grace=1, escalation="freeze")
async def test_frozen_memory_needed_by_the_next_is_killed_continued_first(node):
    a, b = await holder_and_waiter(node, limit=6 * G)
    await a.send(p.Report(resident=6 * G, swapped=0))
    await a.expect(p.Revoke)
    await node.until(lambda: len(node.events("escalate")) == 2)
    # frozen, and its 6 GiB (which a stopped process cannot swap) keep b out: killed
    assert [e["reason"] for e in node.events("escalate")] == [
        "no_yield_within_grace",
        "frozen_memory_needed",
    ]
    # killed before the freeze's record was on disk, it was never stopped; stopped, it
    # is continued first (a stopped process dies only once continued)
    sigs = [sig for _, sig in node.signals]
    assert sigs in (
        [signal.SIGCONT, signal.SIGKILL],
        [signal.SIGSTOP, signal.SIGCONT, signal.SIGKILL],
    )
    a.close()
    await b.expect(p.Grant)


@in_process(memory="10GiB", mode="exclusive", tq=5)
async def test_a_revoke_carries_the_swap_out_and_swap_outs_reach_idle_sessions(node):
    a, b = await holder_and_waiter(node, limit=6 * G)
    await a.send(p.Report(resident=6 * G, swapped=0))
    r = await a.expect(p.Revoke)
    assert r.swap_out == 2 * G  # b's 6 GiB fit beside 4 of a's
    await a.send(p.Release(resident=4 * G, swapped=2 * G, swapped_out=2 * G, seconds=0.1))
    await b.expect(p.Grant)
    await b.send(p.Report(resident=6 * G, swapped=0), p.Release(resident=6 * G, swapped=0))
    await a.send(p.Acquire())  # a wants its 6 GiB back: b, idle now, is asked to make room
    so = await b.expect(p.SwapOut)
    assert so.bytes == 2 * G


class FakeNvml:
    """pynvml's API for one GPU whose driver counts ``used`` bytes for pid ``pid``."""

    def __init__(self, pid: int, used: int) -> None:
        self.used = {pid: used}

    def nvmlDeviceGetHandleByIndex(self, i: int) -> str:
        return f"h{i}"

    def nvmlDeviceGetUtilizationRates(self, h: str) -> object:
        return types.SimpleNamespace(gpu=50, memory=0)

    def nvmlDeviceGetComputeRunningProcesses(self, h: str) -> list[object]:
        return [types.SimpleNamespace(pid=k, usedGpuMemory=v) for k, v in self.used.items()]

    def nvmlDeviceGetProcessUtilization(self, h: str, since: int) -> list[object]:
        return []


@in_process(escalation="kill", nvml_allowance="1GiB")
async def test_the_gpus_own_count_over_the_limit_escalates(node):
    # The node's real GPU here: NVML's view, faked at the driver's edge
    from gpushare.node.observe.utilization import NvmlUtilization

    node.node.gpus[0] = node.node.gpus[0].__class__(
        **{**vars(node.node.gpus[0]), "simulated": False}
    )
    nvml = FakeNvml(PID, int(2.5 * G))
    node.node.sampler.nvml = {0: NvmlUtilization(nvml, 0)}
    w = await node.workload(memory_limit=G)  # kept: a dropped writer closes its socket
    await node.until(lambda: node.events("escalate"))  # at the next sample (1 s)
    assert node.events("escalate")[0]["session"] == w.session
    (e,) = node.events("escalate")
    assert (e["reason"], e["used_bytes"]) == ("over_memory_limit", int(1.5 * G))
    assert node.signals == [(PID, signal.SIGKILL)]
    assert node.node.utilization[0].last_ratio == 0.5


@in_process(escalation="kill", nvml_allowance="1GiB")
async def test_a_process_nvml_counts_below_the_allowance_keeps_the_sampler_going(node):
    # On an H200 a session's process had less than the allowance on the GPU: the negative
    # figure "over" it was refused by the arbiter, and the sampling task died with it.
    from gpushare.node.observe.utilization import NvmlUtilization

    node.node.gpus[0] = node.node.gpus[0].__class__(
        **{**vars(node.node.gpus[0]), "simulated": False}
    )
    nvml = FakeNvml(PID, G // 2)
    node.node.sampler.nvml = {0: NvmlUtilization(nvml, 0)}
    w = await node.workload(memory_limit=G)
    await node.until(lambda: node.node.utilization[0].last_ratio == 0.5)  # sampled
    assert node.events("escalate") == []
    nvml.used[PID] = int(2.5 * G)  # then over: the same sampler, still running, sees it
    await node.until(lambda: node.events("escalate"))
    assert node.events("escalate")[0]["session"] == w.session
    assert node.signals == [(PID, signal.SIGKILL)]


@in_process()
async def test_a_stopping_node_ends_its_connections_and_detaches_its_sessions(node):
    w = await node.workload(memory_limit=G, name="attached")
    follower = await node.admin()
    await follower.send(p.EventsRequest(follow=True))
    await follower.expect(p.EventsEnd)
    silent = await Peer.connect(node.socket)  # connected, no hello yet
    await node.settle()
    await node.node.stop()
    for peer in (w, follower, silent):  # ended, not left to be cancelled
        assert await peer.closed(timeout=1)
    assert node.events("detach")[-1]["session"] == w.session
    handlers = [t for t in asyncio.all_tasks() if "handle" in repr(t.get_coro())]
    assert handlers == []

"""The scheduling rules (docs/scheduling.md) with a real node and real workload processes
on a simulated GPU: one acceptance run per rule, bounds loose (the machine may be
loaded). The figures are benchmarks/scheduling.py's."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.support import NodeProcess, all_start_together, sim, wait_until

pytestmark = pytest.mark.slow


def finish(procs: list[subprocess.Popen[str]]) -> list[dict]:
    outs = []
    for pr in procs:
        out, err = pr.communicate(timeout=120)
        assert pr.returncode == 0, err
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert all(o["failures"] == 0 for o in outs)  # every byte came back as it went
    return outs


def three(node: NodeProcess, kind: str, seconds: str, *extra: str) -> list[dict]:
    with all_start_together(node, waiting=3):
        procs = [
            node.workload(
                kind, "--memory", "30GiB", "--seconds", seconds, "--name", f"{kind}{i}",
                "--seed", str(i), *extra,
            )
            for i in range(3)
        ]  # fmt: skip
    return finish(procs)


def test_short_bursts_back_to_back_switch_once_a_quantum(node_factory):
    # Three sessions looping 100 ms bursts, 30 GiB each on 80 GiB: before, every burst's
    # end handed the GPU (and 10 GiB of swap) to the next. 15 bursts each (1.5 s of work
    # in a 5 s quantum: a machine three times slower still runs them in one, and one ten
    # times slower in four), counted, not timed (it was bursts in 6 s: 24 on a busy
    # machine); 120 s only bounds the run.
    node = node_factory(*sim("80GiB", mode="exclusive", tq="5"))
    outs = three(node, "short", "120", "--bursts", "15")
    grants = [e for e in node.event_list() if e["event"] == "grant"]
    switches = [e for e in grants if not e.get("continued")]
    bursts = sum(o["bursts"] for o in outs)
    assert bursts >= 45
    assert len(switches) <= bursts / 3, (len(switches), bursts)
    assert sum(1 for e in grants if e.get("continued")) >= bursts / 2


def test_the_next_session_swaps_in_during_the_quantum(node_factory):
    # Three batch jobs of 30 GiB on 80 GiB, TQ 1 s: the next one has 10 GiB in host
    # memory, and 30 + 30 fit beside the third's 20: it comes back before the switch.
    node = node_factory(*sim("80GiB", mode="exclusive", tq="1"))
    three(node, "batch", "6")
    ev = node.event_list()
    assert any(e["event"] == "prefetch" for e in ev)
    assert any(e["event"] == "swap_in" and e.get("prefetch") and e["bytes"] for e in ev)
    grants = [e for e in ev if e["event"] == "grant" and not e.get("continued")][4:]
    assert len(grants) >= 3
    handoffs = [e for e in grants if e["swap_in_bytes"] == 0]
    assert len(handoffs) >= len(grants) / 2, [e["swap_in_bytes"] for e in grants]


def test_a_notebook_cell_beside_batch_jobs_goes_first(node_factory):
    # Two batch jobs and a notebook, TQ 20 s: in the queue a cell would wait up to 40 s.
    node = node_factory(*sim("80GiB", mode="exclusive", tq="20", idle_release="0.3"))
    with all_start_together(node, waiting=3):
        # the notebook first in the queue: its allocation (a first burst, never a turn)
        # must not wait for both batch jobs' quanta, or its cells meet an idle GPU
        procs = [
            node.workload("interactive", "--memory", "30GiB", "--seconds", "8", "--name", "nb")
        ]
        wait_until(lambda: node.status()["gpus"][0]["queue"], what="the notebook waiting")
        procs += [
            node.workload("batch", "--memory", "30GiB", "--seconds", "8", "--name", f"b{i}")
            for i in range(2)
        ]
    outs = finish(procs)
    nb = outs[0]
    assert nb["bursts"] >= 4  # the allocation and cells
    assert nb["wait_max_s"] < 5.0, nb
    turns = [e for e in node.event_list() if e["event"] == "grant" and e.get("turn")]
    assert turns


def test_weighted_shares_follow_the_weights(node_factory):
    # Two sessions that swap at every switch. Small (5 of 8 GiB): the workload checks its
    # memory's pattern at each new grant, CPU time inside its quantum; at 50 GiB that was
    # a tenth of the light session's 0.17 s quantum, and its steps fell short of 1:3.
    node = node_factory(*sim("8GiB", mode="exclusive", tq="0.5", policy="weighted"))
    with all_start_together(node, waiting=2):
        procs = [
            node.workload(
                "batch", "--memory", "5GiB", "--seconds", "10", "--name", f"w{w}",
                "--weight", str(w), "--seed", str(w),
            )
            for w in (1, 3)
        ]  # fmt: skip
    light, heavy = finish(procs)
    # the promise is the GPU's time: quanta of TQ x weight / largest, each from its grant
    # (its swap-in done) to the revoke that ends it, as the node ran them while both were
    # there. Steps are work done in a window, which a busy machine skews (the light one
    # pays a grant's check three times as often); a lease's seconds add a switch to both
    ev = node.event_list()
    ids = {e["session"]: e["name"] for e in ev if e["event"] == "attach"}
    ours = [e for e in ev if ids.get(e.get("session")) in ("w1", "w3")]
    first_gone = min(e["ts"] for e in ours if e["event"] == "detach")
    quanta: dict[str, list[float]] = {"w1": [], "w3": []}
    began: dict[str, float] = {}
    for e in (e for e in ours if e["ts"] < first_gone):
        name = ids[e["session"]]
        starts = e["event"] == "grant" and not e.get("continued")
        if starts or (e["event"] == "swap_in" and name in began):  # once it is back
            began[name] = e["ts"]
        elif e["event"] == "revoke" and name in began:
            quanta[name].append(e["ts"] - began.pop(name))
    assert len(quanta["w1"]) >= 5 and len(quanta["w3"]) >= 5, quanta  # both ran, in turns
    ratio = sum(quanta["w3"]) / len(quanta["w3"]) / (sum(quanta["w1"]) / len(quanta["w1"]))
    assert ratio == pytest.approx(3.0, rel=0.25), quanta
    assert heavy["steps"] > 1.5 * light["steps"], (light, heavy)

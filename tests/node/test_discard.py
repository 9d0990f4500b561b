"""Discardable memory through a real node: a session's cache is dropped, not copied to
host memory, when the node takes memory back, and is made again (empty) at its grant,
which its workload sees and rebuilds; discarded bytes are counted apart from swapped."""

from __future__ import annotations

import json

from tests.support import sim, wait_until

G = 2**30


def test_a_cache_is_dropped_not_swapped_and_rebuilt_at_the_next_grant(node_factory):
    node = node_factory(*sim("8GiB", mode="exclusive", tq="0.5", sim_bandwidth="1e12"))
    args = ("--memory", "6GiB", "--allocate", "2GiB", "--discardable", "4GiB", "--seconds", "5")
    procs = [node.workload("batch", *args, "--name", f"srv{i}", "--seed", str(i)) for i in (1, 2)]
    shown = wait_until(
        lambda: [
            r
            for r in node.status()["gpus"][0]["sessions"]
            if r["discarded_bytes_total"] > 0 and r["swap_out_bytes_total"] == 0
        ],
        timeout=60,
        what="discarded bytes in status, apart from swapped ones",
    )
    assert shown[0]["discarded_bytes_total"] % (256 * 2**20) == 0
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert all(o["failures"] == 0 for o in outs), outs  # the weights' bytes all came back
    assert sum(o["rebuilds"] for o in outs) >= 1, outs
    ev = node.event_list()
    outs_ev = [e for e in ev if e["event"] == "swap_out" and "error" not in e]
    dropped = sum(e.get("discarded_bytes", 0) for e in outs_ev)
    copied = sum(e["bytes"] for e in outs_ev)
    assert dropped >= 4 * G and copied == 0, (dropped, copied)  # the cache covered it all

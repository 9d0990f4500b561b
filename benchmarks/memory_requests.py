"""Memory request and limit on a simulated GPU: packing by request against limit-only
packing, side by side in one run (docs/scheduling.md 6, docs/benchmarks.md). A
benchmark, not a test.

A real node (one simulated GPU of 80 GiB, mode auto, a modelled link of 55 GB/s) and
four real workload processes (``gpushare.tools.workloads batch``), each sitting at
16 GiB and bursting to 32 GiB once for a few seconds at a time chosen at random (the
same seeds in both arms). Two arms, alternated round by round:

* **request**: ``--memory 16GiB --memory-limit 32GiB``: packed by the 16 GiB requests
  (64 GiB of 80): one burst at a time fits in what is free and is lent, a second one at
  the same time is given back or waits;
* **limit**: ``--memory 32GiB`` (allocating 16 GiB, bursting to 32): the only figure is
  the limit, which one-figure packing must size at the peak, so two hold at a time.

Figures per arm: the time-weighted mean of holders (from the node's events), goodput
(workload steps of 10 ms per second, all sessions), the mean wait per grant, bytes
swapped out, escalations and sessions ended, reclaims, and **would-be kills**: the
moments KAI NvFractions would have ended a workload for memory above its request,
counted here as every burst given back (a ``reclaim`` event) plus every growth that found
no room and waited for it (a ``release`` with reason ``grow`` not answered by a grant
within 50 ms): under NvFractions each is an out-of-memory error or an eviction of the
workload using memory between its request and its limit; here each is a pause.

    python benchmarks/memory_requests.py [--quick] [--rounds N] [--seconds S] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpushare.tools.demo import wait_for_socket
from handoff import start_node, workload_results

GIB = 2**30
SESSIONS = 4


def burst_plan(seed: int, seconds: float) -> tuple[float, float]:
    """When the session bursts and for how long: the same in both arms."""
    import random

    rng = random.Random(seed)
    at = rng.uniform(0.1, 0.6) * seconds
    return at, rng.uniform(0.1, 0.25) * seconds


def run_arm(tmp: Path, arm: str, seconds: float, tq: float, seed0: int) -> dict[str, Any]:
    sock, admin, events = str(tmp / f"{arm}.sock"), str(tmp / f"{arm}.admin"), tmp / f"{arm}.ev"
    node = start_node(sock, admin, "--mode", "auto", "--tq", str(tq), "--event-log", str(events))
    try:
        wait_for_socket(admin, node)
        if arm == "request":
            memory = ["--memory", "16GiB", "--memory-limit", "32GiB"]
        else:
            memory = ["--memory", "32GiB", "--allocate", "16GiB"]
        procs = []
        for i in range(SESSIONS):
            at, length = burst_plan(seed0 + i, seconds)
            cmd = [sys.executable, "-m", "gpushare.tools.workloads", "batch", "--socket", sock]
            cmd += [*memory, "--seconds", str(seconds), "--name", f"{arm}{i}"]
            cmd += ["--seed", str(seed0 + i), "--grow", "16GiB"]
            cmd += ["--grow-at", f"{at:.3f}", "--grow-for", f"{length:.3f}"]
            procs.append(
                subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            )
        outs = workload_results(procs, seconds * 20 + 120, "benchmarks/memory_requests.py")
    finally:
        node.terminate()
        node.wait(timeout=30)
    ev = [json.loads(x) for x in events.read_text().splitlines() if x.strip()]
    return figures(arm, outs, ev)


@dataclass
class Holders:
    """The node's events seen in order: the time-weighted sum of holders, the first grant
    and the last detach, and the growths that waited for room (a ``release`` with reason
    ``grow`` not answered by a grant within 50 ms)."""

    area: float = 0.0  # holders x seconds
    first_grant: float | None = None
    last_detach: float | None = None
    waited_grows: int = 0
    holding: set[int] = field(default_factory=set)
    grow_at: dict[int, float] = field(default_factory=dict)  # released to grow, by session
    last: float | None = None

    @classmethod
    def walk(cls, ev: list[dict[str, Any]]) -> Holders:
        h = cls()
        for e in ev:
            h.see(e)
        return h

    def see(self, e: dict[str, Any]) -> None:
        t = e["ts"]
        if self.last is not None:
            self.area += len(self.holding) * (t - self.last)
        self.last = t
        if e["event"] == "grant":
            self.granted(e["session"], t)
        elif e["event"] in ("release", "detach") and "session" in e:
            self.holding.discard(e["session"])
            if e.get("reason") == "grow":
                self.grow_at[e["session"]] = t
        if e["event"] == "detach":
            self.last_detach = t

    def granted(self, session: int, t: float) -> None:
        self.first_grant = t if self.first_grant is None else self.first_grant
        self.holding.add(session)
        g = self.grow_at.pop(session, None)
        if g is not None and t - g > 0.05:
            self.waited_grows += 1

    def span(self) -> float:
        return (self.last_detach or 0) - (self.first_grant or 0)


def count(ev: list[dict[str, Any]], event: str, **fields: Any) -> int:
    """The events of this kind (with these fields' values)."""
    return sum(1 for e in ev if e["event"] == event and all(e[k] == v for k, v in fields.items()))


def figures(arm: str, outs: list[dict[str, Any]], ev: list[dict[str, Any]]) -> dict[str, Any]:
    h = Holders.walk(ev)
    span = h.span()
    reclaims = count(ev, "reclaim")
    steps = sum(o["steps"] for o in outs)
    waits = [o["wait_mean_s"] for o in outs]
    return {
        "arm": arm,
        "span_s": span,
        "holders_mean": h.area / span if span > 0 else 0.0,
        "goodput_steps_per_s": steps / span if span > 0 else 0.0,
        "wait_mean_s": sum(waits) / len(waits),
        "swapped_out_gib": sum(e.get("bytes", 0) for e in ev if e["event"] == "swap_out") / GIB,
        "escalations": count(ev, "escalate"),
        "ended": count(ev, "detach", reason="ended"),
        "failures": sum(o["failures"] for o in outs),
        "reclaims": reclaims,
        "would_be_kills": reclaims + h.waited_grows,
        "grows": sum(o.get("grows", 0) for o in outs),
    }


def mean(rows: list[dict[str, Any]], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/memory_requests.py")
    ap.add_argument("--quick", action="store_true", help="one round of 20 s per arm")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=40.0, help="each arm's run")
    ap.add_argument("--tq", type=float, default=2.0)
    ap.add_argument("--json", help="write the rows here too")
    a = ap.parse_args(argv)
    if a.quick:
        a.rounds, a.seconds = 1, 20.0
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="gs-req-") as d:
        for r in range(a.rounds):
            for arm in ("request", "limit") if r % 2 == 0 else ("limit", "request"):
                print(f"round {r + 1}/{a.rounds}: {arm} ({a.seconds:g} s) ...", flush=True)
                rows.append(run_arm(Path(d), arm, a.seconds, a.tq, seed0=100 * r))
    load = os.getloadavg()[0]
    print(
        f"\n4 sessions of 16 GiB bursting to 32 GiB, limit 32 GiB, on a simulated 80 GiB GPU,"
        f" mode auto, TQ {a.tq:g} s, {a.rounds} round(s) of {a.seconds:g} s; load {load:.1f}"
    )
    cols = ("holders_mean", "goodput_steps_per_s", "wait_mean_s", "swapped_out_gib",
            "reclaims", "would_be_kills", "escalations", "ended", "failures")  # fmt: skip
    print(f"{'arm':<8} " + " ".join(f"{c:>20}" for c in cols))
    by = {arm: [x for x in rows if x["arm"] == arm] for arm in ("request", "limit")}
    for arm, rs in by.items():
        print(f"{arm:<8} " + " ".join(f"{mean(rs, c):>20.2f}" for c in cols))
    req, lim = by["request"], by["limit"]

    def ratio(key: str) -> float:
        return mean(req, key) / max(mean(lim, key), 1e-9)

    print(
        f"request / limit-only packing: holders {ratio('holders_mean'):.2f}x,"
        f" goodput {ratio('goodput_steps_per_s'):.2f}x, wait {ratio('wait_mean_s'):.2f}x;"
        f" would-be NvFractions kills {sum(x['would_be_kills'] for x in req)}, ended here"
        f" {sum(x['ended'] + x['escalations'] for x in req)}"
    )
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

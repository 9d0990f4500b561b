"""The arbiter's running totals (counted memory, the largest weight) and its deadline
structures (holders' deadlines, the swap-retry heap) equal scans of every session after
any sequence of inputs, valid or refused."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpushare.core.actions import SwapOutAction
from gpushare.core.arbiter import Arbiter, ArbiterError
from gpushare.core.attach import AttachRecord
from gpushare.core.clock import ManualClock
from gpushare.settings import GpuSettings
from tests.profiles import examples

G = 2**30
CAPACITY = 16 * G
SIDS = st.integers(0, 9)  # an attached session (by rank), or (9) one that is not there
BYTES = st.integers(0, 8).map(lambda k: k * G)

ATTACH = st.tuples(
    st.just("attach"),
    SIDS,
    st.integers(1, 10).map(lambda k: k * G),
    st.sampled_from([0.25, 0.5, 1.0, 2.0]),
    st.booleans(),  # fills
    # after a node restart; "verified": the node matched its record and lease token
    st.sampled_from(["new", "resumed", "resumed holding", "resumed holding verified"]),
)
inputs = st.one_of(
    ATTACH,
    st.tuples(st.just("detach"), SIDS),
    st.tuples(st.just("acquire"), SIDS),
    st.tuples(st.just("acquire"), SIDS),
    st.tuples(st.just("release"), SIDS, BYTES, BYTES, st.booleans(), BYTES),
    st.tuples(st.just("release"), SIDS, BYTES, BYTES, st.booleans(), BYTES),
    st.tuples(
        st.just("swap_done"),
        SIDS,
        st.sampled_from(["in", "out"]),
        BYTES,
        BYTES,
        st.sampled_from(["", "copy failed"]),
    ),
    st.tuples(st.just("report"), SIDS, BYTES, BYTES),
    st.tuples(st.just("over_limit"), SIDS, BYTES),
    st.tuples(
        st.just("set_config"),
        st.sampled_from(["auto", "exclusive"]),
        st.sampled_from(["equal", "weighted"]),
        st.sampled_from([0.5, 1.0, 5.0]),
    ),
    st.tuples(st.just("tick"), st.sampled_from([0.0, 0.1, 0.6, 1.1, 5.0, 30.0])),
    st.tuples(st.just("tick"), st.sampled_from([0.1, 0.6, 1.1])),
    st.tuples(st.just("recovery"), st.booleans()),  # a window opens (True) or ends
)


def attach(a: Arbiter, clock: ManualClock, args: list[Any]) -> None:
    sid, limit, weight, fills, how = args
    half = limit // 2 if how != "new" else 0
    a.attach(
        sid + 1,
        AttachRecord(
            name=f"s{sid}",
            memory_limit=limit,
            weight=weight,
            fills=fills,
            resident=half,
            swapped=half,
            holding=how.startswith("resumed holding"),
            lease=7 if how.startswith("resumed holding") else 0,
            verified=how.endswith("verified"),
        ),
    )


def release(a: Arbiter, clock: ManualClock, args: list[Any]) -> None:
    sid, resident, swapped, again, swapping_out = args
    a.release(sid, resident=resident, swapped=swapped, again=again, swapping_out=swapping_out)


def swap_done(a: Arbiter, clock: ManualClock, args: list[Any]) -> None:
    sid, direction, resident, swapped, error = args
    a.swap_done(
        sid,
        direction=direction,
        nbytes=G,
        seconds=0.1,
        resident=resident,
        swapped=swapped,
        error=error,
    )


def recovery(a: Arbiter, clock: ManualClock, args: list[Any]) -> None:
    if args[0]:
        a.begin_recovery()
    else:
        a.end_recovery()


def tick(a: Arbiter, clock: ManualClock, args: list[Any]) -> None:
    clock.advance(args[0])
    a.tick()


# each input of ``inputs`` by its kind: what it does to the arbiter
OPS: dict[str, Callable[[Arbiter, ManualClock, list[Any]], object]] = {
    "attach": attach,
    "detach": lambda a, clock, args: a.detach(args[0]),
    "acquire": lambda a, clock, args: a.acquire(args[0]),
    "release": release,
    "swap_done": swap_done,
    "report": lambda a, clock, args: a.report(args[0], resident=args[1], swapped=args[2]),
    "over_limit": lambda a, clock, args: a.over_limit(args[0], used=args[1]),
    "set_config": lambda a, clock, args: a.set_config(
        {"mode": args[0], "policy": args[1], "tq_s": args[2]}
    ),
    "recovery": recovery,
    "tick": tick,
}


def apply(a: Arbiter, clock: ManualClock, op: tuple[Any, ...]) -> None:
    kind, *args = op
    # mostly those there
    if kind not in ("attach", "set_config", "tick", "recovery") and a.sessions:
        ids = sorted(a.sessions)
        args[0] = ids[args[0] % len(ids)] if args[0] < 9 else max(ids) + 1
    OPS[kind](a, clock, args)


def scanned_deadline(a: Arbiter) -> float | None:
    """next_deadline as a scan of every session (the arbiter's code before the heap)."""
    times = []
    for sid in a.holders:
        s = a.sessions[sid]
        if s.state == "holding":
            if s.lease.quantum_end != float("inf"):
                times.append(s.lease.quantum_end)
        elif not s.esc.escalated:
            times.append(s.lease.revoke_deadline)
    for s in a.sessions.values():  # non-holders: a swap-out asked, a claim told to yield
        if s.esc.swap_out_deadline != float("inf"):
            times.append(s.esc.swap_out_deadline)
        if s.esc.yield_due and not s.esc.escalated:
            times.append(s.lease.revoke_deadline)
    # a quantum waiting for its holder to ask again, while someone waits (scheduling.md)
    times += [s.share.window_until for s in a.sessions.values() if s.share.window and a.queue]
    if a.queue or any(a.sessions[h].memory.room for h in a.holders):
        now = a.clock.monotonic()
        times += [
            s.esc.swap_failed_until for s in a.sessions.values() if s.esc.swap_failed_until > now
        ]
    return min(times, default=None)


@settings(max_examples=examples(400), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    first=st.lists(ATTACH, min_size=2, max_size=6),
    ops=st.lists(inputs, min_size=20, max_size=100),
    escalation=st.sampled_from(["log", "freeze", "kill"]),
)
def test_running_totals_and_deadlines_equal_the_scans(first, ops, escalation):
    clock = ManualClock()
    a = Arbiter(0, CAPACITY, clock, GpuSettings(tq_s=1.0, grace_s=0.5, escalation=escalation))
    for op in [*first, *ops]:
        with contextlib.suppress(ArbiterError):  # refused: the totals still hold
            apply(a, clock, op)
        a.verify()
        assert a.used_bytes() == sum(s.used for s in a.sessions.values())
        assert a.next_deadline() == scanned_deadline(a)
        if a.sessions and a.settings.policy == "weighted":
            top = max(s.weight for s in a.sessions.values())
            for s in a.sessions.values():
                assert a.quantum(s) == a.settings.tq_s * s.weight / top


def test_a_failed_swap_retry_is_a_deadline_until_it_passes():
    clock = ManualClock()
    a = Arbiter(0, 4 * G, clock, GpuSettings(mode="exclusive", tq_s=10))
    a.attach(1, AttachRecord(name="victim", memory_limit=3 * G))
    a.attach(2, AttachRecord(name="next", memory_limit=3 * G))
    a.acquire(1)
    a.report(1, resident=3 * G, swapped=0)
    a.release(1, resident=3 * G, swapped=0)
    clock.advance(1.0)
    a.tick()  # the rest of 1's quantum waited for it to ask again; no more
    a.acquire(2)  # 1 is asked to swap out; its swap fails
    a.swap_done(1, direction="out", nbytes=0, seconds=0.1, resident=3 * G, swapped=0, error="x")
    assert a.next_deadline() == clock.monotonic() + 1.0
    clock.advance(1.0)
    a.tick()  # the plan is made again, the same victim asked again
    a.verify()
    # no retry left: the one deadline is the victim's to move a byte (a grace period)
    assert a.next_deadline() == clock.monotonic() + a.settings.grace_s
    assert len(a.st.deadlines._retries) <= 1  # what has passed is dropped


def test_a_retry_whose_time_passed_without_a_tick_is_still_due():
    # The node's timer fires at or after the retry time; next_deadline must still say it
    # is due then (not drop it as passed), or nothing plans again and the queue waits.
    clock = ManualClock()
    a = Arbiter(0, 10 * G, clock, GpuSettings(mode="exclusive", tq_s=5))
    a.attach(1, AttachRecord(name="waits", memory_limit=6 * G))
    a.attach(2, AttachRecord(name="victim", memory_limit=6 * G))
    a.acquire(2)
    a.acquire(1)
    clock.advance(5.0)
    a.tick()  # 2's quantum ends; it yields, and is asked for 2 GiB after its release
    a.release(2, resident=6 * G, swapped=0, swapping_out=2 * G)
    a.swap_done(2, direction="out", nbytes=0, seconds=0.0, resident=6 * G, swapped=0, error="x")
    due = clock.monotonic() + 1.0
    assert a.next_deadline() == due
    clock.advance(1.5)  # the timer fires late, as timers do
    assert a.next_deadline() == due  # passed, and still due: the rules have not run since
    assert any(isinstance(x, SwapOutAction) and x.session == 2 for x in a.tick())
    assert a.next_deadline() != due

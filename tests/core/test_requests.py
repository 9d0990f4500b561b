"""Memory request and limit (docs/scheduling.md, "Memory request and limit"): sessions
packed by what they request, bursts lent while memory is free and given back, never a
session ended for memory between its request and its limit."""

from __future__ import annotations

import pytest

from gpushare.core.actions import EscalateAction, GrantAction, RevokeAction, SwapOutAction
from gpushare.core.arbiter import Arbiter
from gpushare.core.attach import AttachRecord
from gpushare.core.checks import FieldError
from gpushare.core.sessions import State
from gpushare.settings import GpuSettings
from tests.core.model import GiB, actions_of, events_of


def arb(clock, mode="auto", capacity=80 * GiB, tq_s=10.0, **kw):
    return Arbiter(0, capacity, clock, GpuSettings(mode=mode, tq_s=tq_s, **kw))


def three_at_request(a):
    """Three sessions requesting 20 GiB with a 60 GiB limit, each holding 20 GiB."""
    for i in (1, 2, 3):
        a.attach(
            i,
            AttachRecord(name=f"s{i}", memory_limit=60 * GiB, memory_request=20 * GiB, grows=True),
        )
        a.acquire(i)
        a.report(i, resident=20 * GiB, swapped=0)


def test_sessions_hold_together_while_their_requests_fit(clock):
    a = arb(clock)
    three_at_request(a)
    assert list(a.holders) == [1, 2, 3]  # limits 180 GiB on 80: held together by requests
    assert a.used_bytes() == 60 * GiB  # each counted at its bound: its request
    assert all(a.sessions[i].memory.bound == 20 * GiB for i in (1, 2, 3))


def test_limit_only_packing_is_unchanged_without_a_request(clock):
    a = arb(clock)
    for i in (1, 2, 3):
        a.attach(i, AttachRecord(name=f"s{i}", memory_limit=60 * GiB, grows=True))
        a.acquire(i)
    assert list(a.holders) == [1] and list(a.queue) == [2, 3]
    assert a.used_bytes() == 60 * GiB


def test_exclusive_mode_counts_a_holder_at_its_limit(clock):
    a = arb(clock, mode="exclusive")
    a.attach(1, AttachRecord(name="a", memory_limit=60 * GiB, memory_request=20 * GiB, grows=True))
    a.acquire(1)
    assert a.sessions[1].memory.bound == 0 and a.used_bytes() == 60 * GiB


def test_a_client_that_cannot_ask_holds_at_its_limit(clock):
    a = arb(clock)
    a.attach(
        1, AttachRecord(name="a", memory_limit=60 * GiB, memory_request=20 * GiB)
    )  # grows=False
    a.acquire(1)
    assert a.used_bytes() == 60 * GiB


def test_a_burst_is_lent_from_free_memory_at_once(clock):
    a = arb(clock)
    for i in (1, 2):
        a.attach(
            i,
            AttachRecord(name=f"s{i}", memory_limit=60 * GiB, memory_request=20 * GiB, grows=True),
        )
        a.acquire(i)
        a.report(i, resident=15 * GiB, swapped=0)
    out = a.release(1, resident=15 * GiB, swapped=0, again=True, need=50 * GiB)
    (g,) = actions_of(out, GrantAction)
    assert (g.session, g.bound, g.swap_in) == (1, 50 * GiB, 0)
    assert events_of(out, "release")[0]["reason"] == "grow"
    assert events_of(out, "grant")[0]["resumed"] is True  # the rest of its quantum
    assert a.sessions[1].memory.lent and a.used_bytes() == 70 * GiB


def test_a_lent_burst_is_given_back_when_a_request_needs_it(clock):
    a = arb(clock)
    for i in (1, 2, 3):
        a.attach(
            i,
            AttachRecord(name=f"s{i}", memory_limit=60 * GiB, memory_request=20 * GiB, grows=True),
        )
    for i in (1, 2):
        a.acquire(i)
        a.report(i, resident=15 * GiB, swapped=0)
    a.release(1, resident=15 * GiB, swapped=0, again=True, need=50 * GiB)
    a.report(1, resident=50 * GiB, swapped=0)  # it grew into what was lent
    out = a.acquire(3)  # 50 + 20 + 20 > 80, but the requests (60) fit
    assert actions_of(out, GrantAction) == []
    (rv,) = actions_of(out, RevokeAction)
    assert rv.session == 1
    (ev,) = events_of(out, "reclaim")
    assert (ev["session"], ev["lent_bytes"], ev["waiting_session"]) == (1, 30 * GiB, 3)
    assert a.sessions[2].state is State.HOLDING  # at its request: untouched
    # it yields at its next safe point; the planner asks for its bytes above its request
    out = a.release(1, resident=50 * GiB, swapped=0, again=True)
    asks = actions_of(out, SwapOutAction)
    assert asks == [SwapOutAction(1, 10 * GiB)]
    out = a.swap_done(
        1, direction="out", nbytes=10 * GiB, seconds=0.1, resident=40 * GiB, swapped=10 * GiB
    )
    assert [g.session for g in actions_of(out, GrantAction)] == [3]
    assert actions_of(out, EscalateAction) == []
    assert a.sessions[1].memory.reclaims == 1 and a.sessions[1].memory.reclaimed == 30 * GiB


def test_a_burst_that_does_not_fit_waits_for_the_quanta_and_nobody_is_ended(clock):
    """The issue's case: three at 20 GiB of their 60 on 80 GiB; one grows to 50 GiB."""
    a = arb(clock)
    three_at_request(a)
    out = a.release(1, resident=20 * GiB, swapped=0, again=True, need=50 * GiB)
    assert actions_of(out, GrantAction) == []  # no room: it waits, it is not refused
    assert list(a.queue) == [1] and list(a.holders) == [2, 3]
    # the holders at their request are not swapped out for the burst: rotated by quanta
    assert actions_of(out, SwapOutAction) == [] and actions_of(out, RevokeAction) == []
    clock.advance(10)
    out = a.tick()
    revoked = sorted(r.session for r in actions_of(out, RevokeAction))
    assert revoked == [2, 3]
    out = a.release(2, resident=20 * GiB, swapped=0, again=True)
    assert actions_of(out, SwapOutAction) == [SwapOutAction(2, 10 * GiB)]
    out = a.swap_done(
        2, direction="out", nbytes=10 * GiB, seconds=0.1, resident=10 * GiB, swapped=10 * GiB
    )
    assert [g.session for g in actions_of(out, GrantAction)] == [1]
    assert a.sessions[1].memory.bound == 50 * GiB
    assert not a.sessions[1].memory.lent  # won by the rotation: it keeps its quantum
    assert a.used_bytes() <= a.capacity
    a.report(1, resident=50 * GiB, swapped=0)
    a.release(3, resident=20 * GiB, swapped=0, again=True)
    # session 3 waiting does not take session 1's burst back before its quantum ends
    out = a.tick()
    assert actions_of(out, RevokeAction) == []
    assert not any(isinstance(x, EscalateAction) for x in out)


def test_request_checks(clock):
    a = arb(clock)
    with pytest.raises(FieldError, match="more than the memory limit"):
        a.attach(1, AttachRecord(name="a", memory_limit=20 * GiB, memory_request=30 * GiB))
    with pytest.raises(FieldError, match="positive"):
        a.attach(1, AttachRecord(name="a", memory_limit=20 * GiB, memory_request=0))
    a.attach(1, AttachRecord(name="a", memory_limit=20 * GiB, memory_request=10 * GiB))
    a.acquire(1)
    with pytest.raises(FieldError, match="need"):  # its client did not say it grows
        a.release(1, resident=0, swapped=0, again=True, need=15 * GiB)
    a.attach(2, AttachRecord(name="b", memory_limit=20 * GiB, memory_request=10 * GiB, grows=True))
    with pytest.raises(FieldError, match="need"):  # more than its limit
        a.acquire(2)
        a.release(2, resident=0, swapped=0, again=True, need=25 * GiB)


def test_a_pods_compute_sharing_mode_is_its_sessions_mode(clock):
    """KAI's gpu-compute-sharing-mode per pod: time-slicing takes exclusive quanta on a
    GPU in mode auto; sm-sharing holds beside others on a GPU in mode exclusive."""
    a = arb(clock)  # mode auto
    a.attach(1, AttachRecord(name="a", memory_limit=10 * GiB))
    a.attach(2, AttachRecord(name="ts", memory_limit=10 * GiB, sharing="time-slicing"))
    a.attach(3, AttachRecord(name="c", memory_limit=10 * GiB))
    a.acquire(1)
    a.acquire(2)
    assert list(a.holders) == [1] and list(a.queue) == [2]  # it waits for a quantum of its own
    a.acquire(3)
    assert list(a.holders) == [1]  # and nobody passes it
    clock.advance(10)
    a.tick()
    a.release(1, resident=0, swapped=0, again=False)
    assert list(a.holders) == [2]
    a.release(2, resident=0, swapped=0, again=False)
    clock.advance(1)  # its quantum's window for it to ask again (rule 1) passes
    a.tick()
    assert list(a.holders) == [3]
    b = arb(clock, mode="exclusive")
    for i in (1, 2):
        b.attach(i, AttachRecord(name=f"sm{i}", memory_limit=10 * GiB, sharing="sm-sharing"))
        b.acquire(i)
    assert list(b.holders) == [1, 2]
    with pytest.raises(FieldError, match="sharing must be one of"):
        b.attach(3, AttachRecord(name="x", memory_limit=GiB, sharing="mps"))


def test_a_compute_limit_caps_the_share_even_when_the_gpu_would_idle(clock):
    from gpushare.core.caps import WINDOW_S

    a = arb(clock, tq_s=1)
    a.attach(1, AttachRecord(name="capped", memory_limit=GiB, compute_limit=0.25))
    a.acquire(1)
    held, t, revokes = 0.0, 0.0, 0
    while t < 120:  # alone on the GPU, always wanting it, yielding at once when revoked
        step = 0.05
        clock.advance(step)
        t += step
        if a.sessions[1].state is State.HOLDING:
            held += step
        for _ in actions_of(a.tick(), RevokeAction):
            revokes += 1
            a.release(1, resident=0, swapped=0, again=True)
    assert revokes >= 5
    assert 0.25 * 120 - 0.5 <= held <= 0.25 * 120 + 0.25 * WINDOW_S, held


def test_a_resting_capped_session_lets_the_others_go_first(clock):
    a = arb(clock, tq_s=1, mode="exclusive")
    a.attach(1, AttachRecord(name="capped", memory_limit=GiB, compute_limit=0.1))  # a 1 s bucket
    a.attach(2, AttachRecord(name="free", memory_limit=GiB))
    a.acquire(1)
    clock.advance(1.2)
    (rv,) = actions_of(a.tick(), RevokeAction)
    assert rv.session == 1 and events_of(a.tick(), "revoke") == []
    a.release(1, resident=0, swapped=0, again=True)  # it waits, resting
    out = a.acquire(2)
    assert [g.session for g in actions_of(out, GrantAction)] == [2]
    assert list(a.queue) == [1]
    # the other is not revoked for a session that rests
    clock.advance(2)
    assert actions_of(a.tick(), RevokeAction) == []
    with pytest.raises(FieldError, match="compute_limit"):
        a.attach(3, AttachRecord(name="x", memory_limit=GiB, compute_limit=1.5))


def test_a_holder_past_its_bound_without_asking_is_counted_or_revoked(clock):
    """The node believes only what it can check: more than the grant lent, not asked
    for, is counted where it fits, and where it does not the holder gives the GPU back at
    its next safe point (never over capacity); memory within the limit is never a reason
    to escalate or end it (docs/scheduling.md 6), not even under escalation kill."""
    a = arb(clock, escalation="kill")
    for i in (1, 2):
        a.attach(
            i,
            AttachRecord(name=f"s{i}", memory_limit=60 * GiB, memory_request=20 * GiB, grows=True),
        )
        a.acquire(i)
        a.report(i, resident=20 * GiB, swapped=0)
    out = a.report(1, resident=40 * GiB, swapped=0)  # fits: 40 + 20 <= 80
    assert actions_of(out, EscalateAction) == [] and a.sessions[1].memory.bound == 40 * GiB
    out = a.report(2, resident=50 * GiB, swapped=0)  # 40 + 50 > 80: not believed
    assert actions_of(out, EscalateAction) == [] and events_of(out, "escalate") == []
    (rv,) = events_of(out, "revoke")
    assert rv["reason"] == "over_memory_bound" and rv["session"] == 2
    assert a.sessions[2].memory.bound == 20 * GiB and a.used_bytes() <= a.capacity
    assert events_of(a.report(2, resident=51 * GiB, swapped=0), "revoke") == []  # once
    a.release(2, resident=0, swapped=50 * GiB)  # it yields: nothing more said of it
    assert a.sessions[2].totals.escalations == 0


def _held_by_reattaching(a, clock, workload: str, seconds: float, cap: float) -> float:
    """GPU seconds a workload holds in ``seconds`` alone on the GPU, ending each session
    at its revoke and attaching a new one at once (a bucket per session would be full)."""
    sid, held, t = 1, 0.0, 0.0
    a.attach(sid, AttachRecord(name="w", memory_limit=GiB, compute_limit=cap, workload=workload))
    a.acquire(sid)
    while t < seconds:
        clock.advance(0.05)
        t += 0.05
        if a.sessions[sid].state is State.HOLDING:
            held += 0.05
        if actions_of(a.tick(), RevokeAction):
            a.detach(sid)
            sid += 1
            a.attach(
                sid, AttachRecord(name="w", memory_limit=GiB, compute_limit=cap, workload=workload)
            )
            a.acquire(sid)
    return held


def test_a_compute_limit_is_the_workloads_not_reset_by_attaching_again(clock):
    from gpushare.core.caps import WINDOW_S

    held = _held_by_reattaching(arb(clock, tq_s=1), clock, "uid:1000/w", 40.0, 0.25)
    assert held <= 0.25 * 40 + 0.25 * WINDOW_S + 0.5, held  # 10 s + one bucket
    # where each session is its own workload (no key), each starts with a full bucket
    fresh = _held_by_reattaching(arb(clock, tq_s=1), clock, "", 40.0, 0.25)
    assert fresh > 2 * held, (fresh, held)


def test_sessions_of_one_workload_spend_one_bucket(clock):
    from gpushare.core.caps import WINDOW_S

    a = arb(clock, tq_s=1, mode="exclusive")
    for i in (1, 2):  # two at once, taking turns: together no more than the one limit
        a.attach(i, AttachRecord(name="w", memory_limit=GiB, compute_limit=0.25, workload="pod:x"))
        a.acquire(i)
    held, t = 0.0, 0.0
    while t < 40:
        clock.advance(0.05)
        t += 0.05
        held += 0.05 * len(a.holders)
        for rv in actions_of(a.tick(), RevokeAction):
            a.release(rv.session, resident=0, swapped=0, again=True)
    assert held <= 0.25 * 40 + 0.25 * WINDOW_S + 0.5, held
    assert a.compute_left(a.sessions[1]) == a.compute_left(a.sessions[2])
    # a session of the workload asking no limit spends from its bucket too
    a.attach(3, AttachRecord(name="w", memory_limit=GiB, workload="pod:x"))
    assert a.sessions[3].share.cap == 0.25


def test_the_request_is_one_figure_filled_in_whether_asked_or_not(clock):
    """Issue 37: the attach event's `request_bytes` is there for a session that asked no
    request (it was left out: "none" read as the limit), and the core keeps the
    request in bytes, never 0 for "the limit"."""
    a = arb(clock)
    none_asked = a.attach(1, AttachRecord(name="a", memory_limit=20 * GiB))
    same = a.attach(2, AttachRecord(name="b", memory_limit=20 * GiB, memory_request=20 * GiB))
    less = a.attach(3, AttachRecord(name="c", memory_limit=20 * GiB, memory_request=5 * GiB))
    got = [events_of(out, "attach")[0]["request_bytes"] for out in (none_asked, same, less)]
    assert got == [20 * GiB, 20 * GiB, 5 * GiB]
    assert [a.sessions[i].memory.request for i in (1, 2, 3)] == [20 * GiB, 20 * GiB, 5 * GiB]


def test_a_grant_event_says_its_bound_whether_lent_or_not(clock):
    """Issue 37: `bound_bytes` is in every grant event, the limit where nothing was
    lent (it was left out then), as `request_bytes` is in every attach event."""
    a = arb(clock)
    a.attach(1, AttachRecord(name="a", memory_limit=20 * GiB))
    a.attach(2, AttachRecord(name="b", memory_limit=60 * GiB, memory_request=5 * GiB, grows=True))
    bounds = {s: events_of(a.acquire(s), "grant")[0]["bound_bytes"] for s in (1, 2)}
    assert bounds == {1: 20 * GiB, 2: 5 * GiB}

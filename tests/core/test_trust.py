"""The arbiter believes only what it can check: every figure bounded by what it knows, a
refused input changes nothing (byte for byte), a claimed lease is given back only when
verified and the rules allow, non-holders that ignore a swap-out are escalated, and after
a node restart nothing is granted until the recovery window ends."""

from __future__ import annotations

import math
import pickle
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpushare.core.actions import (
    EscalateAction,
    GrantAction,
    RevokeAction,
    SwapOutAction,
    ThawAction,
)
from gpushare.core.arbiter import Arbiter
from gpushare.core.attach import AttachRecord
from gpushare.core.checks import MAX_WEIGHT, MIN_WEIGHT, ArbiterError, FieldError
from gpushare.core.clock import ManualClock
from gpushare.core.ledger import bound_for
from gpushare.core.sessions import State
from gpushare.settings import GpuSettings
from tests.profiles import examples

GiB = 2**30


def of(actions, kind):
    return [a for a in actions if isinstance(a, kind)]


def arb(capacity=80 * GiB, clock=None, **kw):
    return Arbiter(0, capacity, clock or ManualClock(), GpuSettings(**kw))


def state_of(a: Arbiter) -> bytes:
    """Everything the arbiter keeps, byte for byte (its clock apart)."""
    return pickle.dumps({k: v for k, v in vars(a).items() if k != "clock"})


def holding(a: Arbiter, sid: int, limit: int, **kw) -> None:
    a.attach(sid, AttachRecord(name=f"s{sid}", memory_limit=limit, **kw))
    a.acquire(sid)
    a.report(sid, resident=limit, swapped=0)


def done(a: Arbiter, sid: int, **kw):
    """The holder ends its burst as a session that stays away between bursts does: its
    quantum does not wait for it (docs/scheduling.md), the GPU moves on at once."""
    a.sessions[sid].share.gap_ewma = a.sessions[sid].share.gap_last = 3600.0
    return a.release(sid, **kw)


# --- issue 11, items 1-4, each as it was seen ----------------------------------------


def test_a_holding_claim_without_a_verified_record_is_told_to_yield():
    a = arb(mode="exclusive")
    holding(a, 1, 60 * GiB)
    out = a.attach(2, AttachRecord(name="liar", memory_limit=60 * GiB, holding=True, lease=99))
    assert of(out, GrantAction) == [] and a.holders == [1]
    assert of(out, RevokeAction) == [RevokeAction(2, 99, 0, a.settings.grace_s)]
    assert a.used_bytes() <= a.capacity
    assert a.sessions[2].state is State.WAITING and a.sessions[2].esc.yield_due
    # verified or not, a claim never makes a second exclusive holder
    out = a.attach(
        3, AttachRecord(name="stale", memory_limit=10 * GiB, holding=True, lease=5, verified=True)
    )
    assert of(out, GrantAction) == [] and a.holders == [1]


def test_a_refused_release_leaves_no_ghost_holder():
    a = arb(mode="exclusive")
    holding(a, 1, 10 * GiB)
    a.attach(2, AttachRecord(name="b", memory_limit=10 * GiB))
    a.acquire(2)
    before = state_of(a)
    with pytest.raises(FieldError, match="release: resident"):
        a.release(1, resident=-1, swapped=0)
    assert state_of(a) == before
    assert a.holders == [1] and a.sessions[1].state is State.HOLDING
    out = a.detach(1)  # the disconnect that follows works, and the waiter gets the GPU
    assert [g.session for g in of(out, GrantAction)] == [2]


def test_swapped_bytes_beyond_the_limit_are_refused_and_the_quantum_stays_bounded():
    clock = ManualClock()
    a = arb(clock=clock, tq_s=5, mode="exclusive")
    a.attach(1, AttachRecord(name="a", memory_limit=GiB))
    with pytest.raises(FieldError, match="swapped"):
        a.report(1, resident=0, swapped=2**62)
    assert len(of(a.acquire(1), GrantAction)) == 1
    assert a.next_deadline() is not None and a.next_deadline() < clock.monotonic() + 10


@pytest.mark.parametrize("weight", [1e308, math.inf, math.nan, 0.0, -1.0, MIN_WEIGHT / 2])
def test_weights_are_bounded_and_finite(weight):
    a = arb(policy="weighted")
    with pytest.raises(FieldError, match="weight"):
        a.attach(1, AttachRecord(name="w", memory_limit=GiB, weight=weight))
    assert not a.sessions
    a.attach(1, AttachRecord(name="w", memory_limit=GiB, weight=MAX_WEIGHT))
    a.attach(2, AttachRecord(name="v", memory_limit=GiB, weight=MIN_WEIGHT))
    assert all(math.isfinite(a.quantum(s)) for s in a.sessions.values())


def test_figures_that_do_not_fit_are_refused():
    a = arb(capacity=20 * GiB, mode="exclusive")
    holding(a, 1, 15 * GiB)
    with pytest.raises(FieldError, match="do not fit"):
        a.attach(2, AttachRecord(name="b", memory_limit=10 * GiB, resident=10 * GiB))
    a.attach(2, AttachRecord(name="b", memory_limit=10 * GiB, swapped=10 * GiB))
    with pytest.raises(FieldError, match="without a lease"):  # it cannot allocate idle
        a.report(2, resident=10 * GiB, swapped=0)
    with pytest.raises(FieldError, match="seconds"):
        a.swap_done(2, direction="out", nbytes=0, seconds=math.nan, resident=0, swapped=GiB)
    with pytest.raises(FieldError, match="bytes"):
        a.swap_done(2, direction="out", nbytes=11 * GiB, seconds=0.1, resident=0, swapped=GiB)
    with pytest.raises(FieldError, match="direction"):
        a.swap_done(2, direction="up", nbytes=0, seconds=0.1, resident=0, swapped=GiB)  # type: ignore[arg-type]


def test_resident_over_the_limit_escalates_and_keeps_the_figures():
    a = arb(escalation="kill")
    a.attach(1, AttachRecord(name="greedy", memory_limit=GiB))
    a.report(1, resident=GiB // 2, swapped=0)
    out = a.report(1, resident=2**62, swapped=0)
    assert of(out, EscalateAction) == [EscalateAction(1, "kill", "over_memory_limit")]
    assert a.sessions[1].memory.resident == GiB // 2


# --- a refused input changes nothing --------------------------------------------------

big = st.integers(min_value=-(2**64), max_value=2**64)
hostile_floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([-1.0, 1e308, math.nan])
)
sizes = st.one_of(big, st.integers(0, 40 * GiB), st.sampled_from([0, GiB, 10 * GiB]))
sids = st.integers(0, 6)
inputs = st.one_of(
    st.tuples(
        st.just("attach"),
        sids,
        st.fixed_dictionaries(
            {
                "name": st.just("x"),
                "memory_limit": st.one_of(sizes, st.sampled_from([GiB, 10 * GiB, 30 * GiB])),
                "weight": st.one_of(hostile_floats, st.just(1.0)),
                "resident": sizes,
                "swapped": sizes,
                "discarded": sizes,
                "holding": st.booleans(),
                "lease": st.one_of(big, st.integers(0, 20)),
                "verified": st.booleans(),
                # memory request and limit, compute (docs/scheduling.md 6)
                "memory_request": st.one_of(st.none(), sizes),
                "grows": st.booleans(),
                "sharing": st.sampled_from(["", "time-slicing", "sm-sharing", "mps"]),
                "compute_limit": st.one_of(st.none(), hostile_floats, st.just(0.25)),
            }
        ),
    ),
    st.tuples(st.just("acquire"), sids, st.just({})),
    st.tuples(
        st.just("release"),
        sids,
        st.fixed_dictionaries(
            {
                "resident": sizes,
                "swapped": sizes,
                "again": st.booleans(),
                "swapped_out": sizes,
                "seconds": hostile_floats,
                "swapping_out": sizes,
                "need": sizes,
                "discarded": sizes,
            }
        ),
    ),
    st.tuples(
        st.just("swap_done"),
        sids,
        st.fixed_dictionaries(
            {
                "direction": st.sampled_from(["in", "out", "sideways"]),
                "nbytes": sizes,
                "seconds": hostile_floats,
                "resident": sizes,
                "swapped": sizes,
                "error": st.sampled_from(["", "failed"]),
                "discarded": sizes,
            }
        ),
    ),
    st.tuples(
        st.just("report"),
        sids,
        st.fixed_dictionaries({"resident": sizes, "swapped": sizes, "discarded": sizes}),
    ),
    st.tuples(st.just("over_limit"), sids, st.fixed_dictionaries({"used": sizes})),
    st.tuples(st.just("detach"), sids, st.just({})),
    st.tuples(st.just("tick"), st.floats(0, 3), st.just({})),
    st.tuples(st.just("end_recovery"), st.just(0), st.just({})),
)


@settings(max_examples=examples(400), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    steps=st.lists(inputs, max_size=40),
    mode=st.sampled_from(["auto", "exclusive"]),
    escalation=st.sampled_from(["log", "freeze", "kill"]),
    recovering=st.booleans(),
)
def test_any_refused_input_leaves_the_arbiter_byte_for_byte_unchanged(
    steps, mode, escalation, recovering
):
    clock = ManualClock()
    a = arb(
        capacity=40 * GiB,
        clock=clock,
        tq_s=1.0,
        grace_s=0.5,
        mode=mode,
        policy="weighted",
        escalation=escalation,
    )
    if recovering:
        a.begin_recovery()
    for kind, sid, kw in steps:
        if kind == "tick":
            clock.advance(sid)
            a.tick()
            continue
        before = state_of(a)
        try:
            if kind == "end_recovery":
                a.end_recovery()
            elif kind in ("acquire", "detach"):
                getattr(a, kind)(sid)
            elif kind == "attach":
                a.attach(sid, AttachRecord(**kw))
            else:
                getattr(a, kind)(sid, **kw)
        except ArbiterError as e:
            assert str(e)
            assert state_of(a) == before, f"{kind}{kw} was refused ({e}) but changed state"
        # whatever was accepted, the invariants hold
        if mode == "exclusive":
            assert len(a.holders) <= 1
        assert a.used_bytes() <= a.capacity
        for s in a.sessions.values():
            assert math.isfinite(a.quantum(s))
            assert (
                min(s.memory.resident, s.memory.swapped) >= 0
                and s.memory.resident + s.memory.swapped <= s.memory.limit
            )
        assert set(a.holders) == {i for i, s in a.sessions.items() if s.holding}
        assert set(a.queue) == {i for i, s in a.sessions.items() if s.state is State.WAITING}


# --- claims after a restart -----------------------------------------------------------


def test_nothing_is_granted_in_the_recovery_window_then_the_latest_lease_comes_back():
    clock = ManualClock()
    a = Arbiter(0, 80 * GiB, clock, GpuSettings(mode="exclusive", grace_s=1), lease_base=100)
    a.begin_recovery()
    back = AttachRecord(name="old", memory_limit=30 * GiB, resident=30 * GiB, holding=True,
                        lease=90, verified=True)  # fmt: skip
    out = a.attach(1, back)
    out += a.attach(2, replace(back, name="new", lease=95))
    a.attach(3, AttachRecord(name="waits", memory_limit=10 * GiB))
    out += a.acquire(3)
    assert of(out, GrantAction) == [] and of(out, RevokeAction) == [] and not a.holders
    assert a.next_deadline() is None
    out = a.end_recovery()
    (g,) = of(out, GrantAction)
    assert g.session == 2 and g.lease == 101  # numbered on from the last node's
    assert of(out, RevokeAction) == [RevokeAction(1, 90, 0, 1)]
    # the told one answers: it waits its turn; 3 is not granted beside the holder
    out = a.release(1, resident=30 * GiB, swapped=0, again=True)
    assert of(out, GrantAction) == [] and not a.sessions[1].esc.yield_due
    assert list(a.queue) == [3, 1]


def test_a_claim_not_yielded_within_grace_is_escalated():
    clock = ManualClock()
    a = arb(clock=clock, mode="exclusive", grace_s=1, escalation="freeze")
    holding(a, 3, 10 * GiB)
    # a lease a node did grant (verified), but another holds the GPU now: told to yield
    out = a.attach(
        1, AttachRecord(name="stale", memory_limit=10 * GiB, holding=True, lease=3, verified=True)
    )
    assert of(out, RevokeAction) == [RevokeAction(1, 3, 0, 1)]
    a.attach(2, AttachRecord(name="b", memory_limit=10 * GiB))
    a.acquire(2)
    out = done(a, 3, resident=0, swapped=0)
    assert of(out, GrantAction) == []  # nothing granted while it may still run
    assert a.next_deadline() == pytest.approx(clock.monotonic() + 1)
    clock.advance(1)
    out = a.tick()
    assert of(out, EscalateAction) == [EscalateAction(1, "freeze", "no_yield_within_grace")]
    assert [g.session for g in of(out, GrantAction)] == [2]  # stopped: off the GPU
    out = done(a, 2, resident=0, swapped=0)
    (g,) = of(out, GrantAction)
    assert g.session == 1 and g.thaw


def test_an_unverified_claim_blocks_no_one():
    clock = ManualClock()
    a = arb(clock=clock, mode="exclusive", grace_s=1, escalation="log")
    holding(a, 3, 10 * GiB)
    a.attach(2, AttachRecord(name="b", memory_limit=10 * GiB))
    a.acquire(2)
    out = a.attach(1, AttachRecord(name="liar", memory_limit=10 * GiB, holding=True, lease=3))
    assert of(out, RevokeAction) == [RevokeAction(1, 3, 0, 1)]
    out = done(a, 3, resident=0, swapped=0)
    assert [g.session for g in of(out, GrantAction)] == [2]  # in its turn, not blocked
    clock.advance(1)
    assert of(a.tick(), EscalateAction) == [EscalateAction(1, "log", "no_yield_within_grace")]


# --- non-holders that ignore a swap-out ----------------------------------------------


def parked(escalation: str):
    """Session 1 idle with 15 GiB resident; 2 needs the room: 1 is asked to swap out."""
    clock = ManualClock()
    a = arb(capacity=20 * GiB, clock=clock, mode="exclusive", grace_s=2, escalation=escalation)
    holding(a, 1, 15 * GiB)
    done(a, 1, resident=15 * GiB, swapped=0)
    a.attach(2, AttachRecord(name="b", memory_limit=10 * GiB))
    out = a.acquire(2)
    assert of(out, SwapOutAction) == [SwapOutAction(1, 5 * GiB)]
    return a, clock


@pytest.mark.parametrize("escalation", ["log", "freeze", "kill"])
def test_a_non_holder_that_ignores_a_swap_out_is_escalated(escalation):
    a, clock = parked(escalation)
    assert a.next_deadline() == pytest.approx(clock.monotonic() + 2)
    clock.advance(2)
    out = a.tick()
    assert of(out, EscalateAction)[0] == EscalateAction(1, escalation, "no_swap_out_within_grace")
    assert a.sessions[1].esc.frozen == (escalation == "freeze")
    if escalation != "freeze":  # asked again later: escalated once per stretch
        clock.advance(10)
        out = a.tick()
        assert of(out, SwapOutAction) and of(out, EscalateAction) == []


def test_progress_moves_the_swap_out_deadline_on():
    a, clock = parked("kill")
    clock.advance(1.5)
    a.report(1, resident=14 * GiB, swapped=GiB)  # a chunk left
    clock.advance(1.5)
    assert of(a.tick(), EscalateAction) == []
    out = a.report(1, resident=10 * GiB, swapped=5 * GiB)
    assert [g.session for g in of(out, GrantAction)] == [2]
    assert a.next_deadline() != pytest.approx(clock.monotonic() + 0.5)


def test_a_frozen_idle_session_is_killed_when_needed_and_else_thawed_at_a_grant():
    a, clock = parked("freeze")
    clock.advance(2)
    out = a.tick()  # frozen; its memory is what 2 needs, and no one else has it
    assert of(out, EscalateAction)[-1] == EscalateAction(1, "kill", "frozen_memory_needed")
    clock = ManualClock()
    b = arb(capacity=30 * GiB, clock=clock, mode="exclusive", grace_s=2, escalation="freeze")
    holding(b, 1, 15 * GiB)
    done(b, 1, resident=15 * GiB, swapped=0)
    clock.advance(1)
    holding(b, 3, 10 * GiB)  # served later: asked second, another way out
    done(b, 3, resident=10 * GiB, swapped=0)
    b.attach(2, AttachRecord(name="b", memory_limit=10 * GiB))
    assert of(b.acquire(2), SwapOutAction) == [SwapOutAction(1, 5 * GiB)]
    clock.advance(2)
    out = b.tick()
    assert of(out, SwapOutAction) == [SwapOutAction(3, 5 * GiB)] and b.sessions[1].esc.frozen
    out = b.report(3, resident=5 * GiB, swapped=5 * GiB)
    assert [g.session for g in of(out, GrantAction)] == [2]
    assert of(out, ThawAction) == [ThawAction(1)] and not b.sessions[1].esc.frozen


def test_a_revoked_holder_swapping_out_is_not_escalated_as_a_non_holder():
    clock = ManualClock()
    a = arb(capacity=20 * GiB, clock=clock, tq_s=1, grace_s=2, mode="exclusive")
    holding(a, 1, 15 * GiB)
    a.attach(2, AttachRecord(name="b", memory_limit=10 * GiB))
    a.acquire(2)
    clock.advance(1)
    (rev,) = of(a.tick(), RevokeAction)
    assert rev.swap_out > 0
    a.report(1, resident=14 * GiB, swapped=GiB)  # its share goes as it winds down
    assert not a.st.deadlines.asked  # a holder's swap-out has the revoke's deadline, not this one


def test_a_refused_release_does_not_book_discarded_bytes():
    """A release from a session that holds nothing is refused whole: the discarded bytes
    it names are not taken (nor counted) either."""
    clock = ManualClock()
    a = arb(capacity=40 * GiB, clock=clock)
    a.attach(1, AttachRecord(name="idle", memory_limit=10 * GiB))
    before = state_of(a)
    with pytest.raises(ArbiterError, match="holds no lease"):
        a.release(1, resident=0, swapped=0, discarded=4 * GiB)
    assert state_of(a) == before
    assert a.sessions[1].memory.discarded == 0 and a.sessions[1].totals.discarded_bytes == 0


def test_memory_a_session_dropped_before_a_restart_is_in_its_bound_and_its_limit():
    """Seen: a reconnecting hello's discarded bytes were not used at attach, so the
    session's bound left out memory it makes again (empty) at its grant."""
    a = arb(capacity=40 * GiB, clock=ManualClock())
    a.attach(1, AttachRecord(name="back", memory_limit=20 * GiB, memory_request=8 * GiB,
                             grows=True, swapped=4 * GiB, discarded=6 * GiB))  # fmt: skip
    m = a.sessions[1].memory
    assert (m.swapped, m.discarded) == (4 * GiB, 6 * GiB)
    assert a.sessions[1].totals.discarded_bytes == 0  # dropped under the node before
    assert bound_for(a.sessions[1], "auto") == 10 * GiB  # all of it comes back
    before = state_of(a)
    with pytest.raises(FieldError, match="exceed the memory limit"):
        a.attach(
            2, AttachRecord(name="liar", memory_limit=10 * GiB, swapped=4 * GiB, discarded=7 * GiB)
        )
    with pytest.raises(FieldError, match="discarded"):
        a.attach(2, AttachRecord(name="liar", memory_limit=10 * GiB, discarded=-1))
    assert state_of(a) == before


def test_a_swap_outs_event_counts_the_drops_reported_while_it_ran():
    """Seen: the event log counted each discardable drop 256 MiB short (2.75 GiB where
    status and metrics said 3 GiB): a progress report mid-swap-out took the first chunk
    dropped, and the swap_out event counted only the drops since that report."""
    from gpushare.core.actions import EventAction

    clock = ManualClock()
    a = arb(capacity=40 * GiB, clock=clock)
    a.attach(1, AttachRecord(name="server", memory_limit=10 * GiB))
    a.report(1, resident=4 * GiB, swapped=0)
    a.report(1, resident=int(3.75 * GiB), swapped=0, discarded=GiB // 4)  # a progress report
    out = a.swap_done(1, direction="out", nbytes=GiB, seconds=0.1, resident=0,
                      swapped=GiB, discarded=3 * GiB)  # fmt: skip
    (ev,) = [x.record for x in of(out, EventAction) if x.record["event"] == "swap_out"]
    assert ev["discarded_bytes"] == 3 * GiB == a.sessions[1].totals.discarded_bytes
    out = a.swap_done(1, direction="out", nbytes=0, seconds=0.0, resident=0,
                      swapped=GiB, discarded=3 * GiB)  # fmt: skip
    (ev,) = [x.record for x in of(out, EventAction) if x.record["event"] == "swap_out"]
    assert ev.get("discarded_bytes") is None  # nothing dropped since: not counted twice

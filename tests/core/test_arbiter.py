"""The arbiter's rules, deterministic (ManualClock) and as properties (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpushare.core.actions import (
    EscalateAction,
    GrantAction,
    RevokeAction,
    RoomAction,
    SwapOutAction,
)
from gpushare.core.arbiter import Arbiter, ArbiterError
from gpushare.core.attach import AttachRecord
from gpushare.core.deadlines import SWAP_RETRY_S
from gpushare.core.sessions import State
from gpushare.core.window import ANTICIPATE_FLOOR_S
from gpushare.settings import GpuSettings
from tests.core.model import Client, GiB, Model, actions_of, events_of
from tests.profiles import examples


def arb(clock, capacity=80 * GiB, **kw):
    return Arbiter(0, capacity, clock, GpuSettings(**kw))


def quantum_over(a, clock, limit, swapped=0, fills=(False, False)):
    """Session 1 holds ``limit`` bytes resident, session 2 (``swapped`` of its bytes in
    host memory) waits, and the quantum ends: what the tick did (the revoke)."""
    a.attach(1, AttachRecord(name="a", memory_limit=limit, fills=fills[0]))
    a.attach(2, AttachRecord(name="b", memory_limit=limit, swapped=swapped, fills=fills[1]))
    a.acquire(1)
    a.report(1, resident=limit, swapped=0)
    a.acquire(2)
    clock.advance(a.settings.tq_s)
    return a.tick()


def test_fifo_exclusive_grant_and_revoke_at_quantum_end(clock):
    a = arb(clock, tq_s=10, mode="exclusive")
    for i in (1, 2, 3):
        a.attach(i, AttachRecord(name=f"s{i}", memory_limit=10 * GiB))
    g = actions_of(a.acquire(1), GrantAction)
    assert [x.session for x in g] == [1]
    assert actions_of(a.acquire(2), GrantAction) == []
    assert actions_of(a.acquire(3), GrantAction) == []
    assert list(a.queue) == [2, 3]
    assert a.next_deadline() == clock.monotonic() + 10
    clock.advance(9.9)
    assert actions_of(a.tick(), RevokeAction) == []
    clock.advance(0.1)
    r = actions_of(a.tick(), RevokeAction)
    assert [x.session for x in r] == [1]
    assert a.sessions[1].state is State.YIELDING
    # the holder yields and wants more: it goes to the back of the queue
    g = actions_of(a.release(1, resident=0, swapped=0, again=True), GrantAction)
    assert [x.session for x in g] == [2]
    assert list(a.queue) == [3, 1]


def test_renewal_when_nobody_waits(clock):
    a = arb(clock, tq_s=5, mode="exclusive")
    a.attach(1, AttachRecord(name="a", memory_limit=GiB))
    a.acquire(1)
    lease = a.sessions[1].lease.number
    clock.advance(12)
    out = a.tick()
    assert actions_of(out, RevokeAction) == [] and events_of(out, "grant") == []
    assert a.sessions[1].lease.number == lease and a.sessions[1].state is State.HOLDING
    assert a.sessions[1].lease.quantum_end == pytest.approx(clock.monotonic() + 5)


def test_release_at_burst_end_grants_next_after_the_anticipation_window(clock):
    a = arb(clock, tq_s=30, mode="exclusive")
    a.attach(1, AttachRecord(name="a", memory_limit=GiB))
    a.attach(2, AttachRecord(name="b", memory_limit=GiB))
    a.acquire(1)
    a.acquire(2)
    clock.advance(1)
    out = a.release(1, resident=GiB, swapped=0)
    # no history of gaps: the rest of the quantum waits the shortest window for it
    assert actions_of(out, GrantAction) == []
    assert events_of(out, "release")[0]["anticipate_s"] == ANTICIPATE_FLOOR_S
    assert a.sessions[1].state is State.IDLE and a.window.holder == 1
    assert a.next_deadline() == pytest.approx(clock.monotonic() + ANTICIPATE_FLOOR_S)
    clock.advance(ANTICIPATE_FLOOR_S)
    g = actions_of(a.tick(), GrantAction)
    assert [x.session for x in g] == [2]
    assert a.window.holder is None
    assert a.lease_seconds(a.sessions[1]) == pytest.approx(1)
    assert a.sessions[2].totals.wait_s == pytest.approx(1 + ANTICIPATE_FLOOR_S)


def test_detach_of_holder_frees_lease_and_memory(clock):
    a = arb(clock, capacity=10 * GiB, tq_s=30, mode="exclusive")
    a.attach(1, AttachRecord(name="a", memory_limit=8 * GiB))
    a.attach(2, AttachRecord(name="b", memory_limit=8 * GiB))
    a.acquire(1)
    a.report(1, resident=8 * GiB, swapped=0)
    assert actions_of(a.acquire(2), GrantAction) == []
    out = a.detach(1, reason="killed")
    assert [x.session for x in actions_of(out, GrantAction)] == [2]
    assert events_of(out, "detach")[0]["freed_bytes"] == 8 * GiB
    assert 1 not in a.sessions


def test_planner_swaps_least_recently_served_only_what_is_needed(clock):
    a = arb(clock, tq_s=1, mode="exclusive")
    for i in (1, 2, 3):
        a.attach(i, AttachRecord(name=f"s{i}", memory_limit=30 * GiB))
    # 1 and 2 run in turn and fill their memory; 2 is served last
    for i in (1, 2):
        a.acquire(i)
        a.report(i, resident=30 * GiB, swapped=0)
        clock.advance(1)
        a.release(i, resident=30 * GiB, swapped=0)
    out = a.acquire(3)  # needs 30, has 80 - 60 = 20: 10 must go, from 1 (served first)
    assert actions_of(out, GrantAction) == []
    assert actions_of(out, SwapOutAction) == [SwapOutAction(1, 10 * GiB)]
    # nothing more is asked while that swap is under way
    assert actions_of(a.tick(), SwapOutAction) == []
    out = a.swap_done(
        1, direction="out", nbytes=10 * GiB, seconds=0.2, resident=20 * GiB, swapped=10 * GiB
    )
    assert [x.session for x in actions_of(out, GrantAction)] == [3]


def test_revoke_carries_the_holders_share_of_swap_out(clock):
    a = arb(clock, capacity=50 * GiB, tq_s=1, mode="exclusive")
    (r,) = actions_of(quantum_over(a, clock, 30 * GiB), RevokeAction)
    assert r.session == 1 and r.swap_out == 10 * GiB
    g = actions_of(
        a.release(1, resident=20 * GiB, swapped=10 * GiB, again=True, swapped_out=10 * GiB),
        GrantAction,
    )
    assert [x.session for x in g] == [2]


def test_grace_expiry_escalates_once(clock):
    a = arb(clock, tq_s=1, grace_s=2, mode="exclusive", escalation="kill")
    a.attach(1, AttachRecord(name="a", memory_limit=GiB))
    a.attach(2, AttachRecord(name="b", memory_limit=GiB))
    a.acquire(1)
    a.acquire(2)
    clock.advance(1)
    a.tick()
    clock.advance(2)
    out = a.tick()
    assert actions_of(out, EscalateAction) == [EscalateAction(1, "kill", "no_yield_within_grace")]
    assert events_of(out, "escalate")[0]["action"] == "kill"
    clock.advance(10)
    assert actions_of(a.tick(), EscalateAction) == []
    assert a.next_deadline() is None


def test_a_longer_tq_applies_at_the_next_quantum(clock):
    a = arb(clock, tq_s=10, mode="exclusive")
    a.attach(1, AttachRecord(name="a", memory_limit=GiB))
    a.attach(2, AttachRecord(name="b", memory_limit=GiB))
    a.acquire(1)
    a.acquire(2)
    clock.advance(1)
    out = a.set_config({"tq_s": 20})
    assert events_of(out, "config")[0]["tq_s"] == 20
    assert a.sessions[1].lease.quantum_end == pytest.approx(clock.monotonic() + 9)  # unchanged
    clock.advance(8.99)
    assert actions_of(a.tick(), RevokeAction) == []
    clock.advance(0.01)
    assert actions_of(a.tick(), RevokeAction)
    (g,) = actions_of(a.release(1, resident=0, swapped=0, again=True), GrantAction)
    assert g.session == 2 and g.quantum_s == 20


def test_a_shorter_tq_cuts_the_running_quantum(clock):
    # `ctl tq 1d` then `ctl tq 1`: the day-long quantum ends at its start plus 1 s, not
    # a day later (issue 16).
    a = arb(clock, tq_s=10, mode="exclusive")
    a.set_config({"tq_s": 86400})
    a.attach(1, AttachRecord(name="a", memory_limit=GiB))
    a.attach(2, AttachRecord(name="b", memory_limit=GiB))
    a.acquire(1)
    a.acquire(2)
    start = clock.monotonic()
    clock.advance(0.5)
    assert actions_of(a.set_config({"tq_s": 2}), RevokeAction) == []
    assert a.sessions[1].lease.quantum_end == pytest.approx(start + 2)
    assert a.next_deadline() == pytest.approx(start + 2)
    clock.advance(1.5)
    assert actions_of(a.tick(), RevokeAction)
    # Past its new end already: revoked at once.
    (g,) = actions_of(a.release(1, resident=0, swapped=0, again=True), GrantAction)
    assert g.session == 2
    a.set_config({"tq_s": 86400})
    clock.advance(5)
    assert actions_of(a.set_config({"tq_s": 1}), RevokeAction)


def test_auto_mode_shares_while_memory_fits_then_goes_exclusive(clock):
    a = arb(clock, capacity=80 * GiB, tq_s=5, mode="auto")
    for i in (1, 2, 3):
        a.attach(i, AttachRecord(name=f"s{i}", memory_limit=30 * GiB))
    assert actions_of(a.acquire(1), GrantAction)
    (g,) = actions_of(a.acquire(2), GrantAction)
    assert g.shared and sorted(a.holders) == [1, 2]
    assert actions_of(a.acquire(3), GrantAction) == []  # 90 GiB wanted > 80: exclusive now
    clock.advance(5)
    revoked = {x.session for x in actions_of(a.tick(), RevokeAction)}
    assert revoked == {1, 2}


def test_weighted_policy_scales_quantum(clock):
    a = arb(clock, tq_s=10, policy="weighted", mode="exclusive")
    a.attach(1, AttachRecord(name="half", memory_limit=GiB, weight=0.5))
    a.attach(2, AttachRecord(name="quarter", memory_limit=GiB, weight=0.25))
    assert a.quantum(a.sessions[1]) == 10
    assert a.quantum(a.sessions[2]) == 5


@pytest.mark.parametrize(
    "call",
    [
        lambda a: a.attach(9, AttachRecord(name="big", memory_limit=81 * GiB)),
        lambda a: a.attach(9, AttachRecord(name="zero", memory_limit=0)),
        lambda a: a.attach(9, AttachRecord(name="w", memory_limit=GiB, weight=0)),
        lambda a: a.acquire(42),
        lambda a: a.release(1, resident=0, swapped=0),
        lambda a: a.set_config({"tq_s": 0}),
        lambda a: a.set_config({"mode": "bogus"}),
        lambda a: a.report(1, resident=-1, swapped=0),
    ],
)
def test_bad_inputs_are_refused_with_a_reason(clock, call):
    a = arb(clock)
    a.attach(1, AttachRecord(name="a", memory_limit=GiB))
    with pytest.raises(ArbiterError) as e:
        call(a)
    assert str(e.value)


@pytest.mark.parametrize(
    "change",
    [
        {"tq_s": 5.0, "mode": "bogus"},
        {"mode": "exclusive", "tq_s": float("nan")},
        {"policy": "weighted", "escalation": "shout"},
        {"tq_s": 0.0, "policy": "weighted", "mode": "exclusive", "escalation": "kill"},
        {"tq_s": 5.0, "overlap": "yes"},  # the keys only the config file changes, too
        {"anticipate_s": 0.0, "prefetch": False},
        {"turn_s": 1.0, "turn_share": 2.0},
    ],
)
def test_a_bad_value_in_set_config_changes_nothing(clock, change):
    a = arb(clock, tq_s=10)
    before = vars(a.settings).copy()
    with pytest.raises(ArbiterError):
        a.set_config(change)
    assert vars(a.settings) == before
    out = a.set_config({"tq_s": 5.0, "mode": "exclusive"})  # a good change applies whole
    assert (a.settings.tq_s, a.settings.mode) == (5.0, "exclusive")
    assert events_of(out, "config") == [events_of(out, "config")[0]]


def test_inputs_beyond_the_session_are_keyword_only(clock):
    a = arb(clock)
    with pytest.raises(TypeError):
        a.attach(1, "a", GiB)  # type: ignore[misc]
    a.attach(1, AttachRecord(name="a", memory_limit=GiB))
    with pytest.raises(TypeError):
        a.report(1, GiB, 0)  # type: ignore[misc]
    with pytest.raises(TypeError):
        a.set_config(tq_s=5.0)  # type: ignore[call-arg]


def test_double_acquire_is_refused(clock):
    a = arb(clock)
    a.attach(1, AttachRecord(name="a", memory_limit=GiB))
    a.acquire(1)
    with pytest.raises(ArbiterError, match="already has a burst"):
        a.acquire(1)


# --- the model: many sessions over simulated time -----------------------------------


def test_round_robin_order_and_equal_shares():
    m = Model(80 * GiB, GpuSettings(tq_s=1.0, mode="exclusive"))
    for i in range(1, 4):
        m.add(Client(i, 30 * GiB))
    m.run(300)
    assert m.max_holders == 1
    # after the first grants, the order cycles 1, 2, 3
    assert m.grants[:9] == [1, 2, 3] * 3
    shares = m.lease_seconds()
    mean = sum(shares.values()) / 3
    assert all(abs(v - mean) / mean < 0.05 for v in shares.values()), shares
    # and memory really moved
    assert sum(s.totals.swap_out_bytes for s in m.arb.sessions.values()) > 0


def test_weighted_shares_follow_weights():
    m = Model(80 * GiB, GpuSettings(tq_s=2.0, mode="exclusive", policy="weighted"))
    m.add(Client(1, 30 * GiB, weight=0.5))
    m.add(Client(2, 30 * GiB, weight=0.25))
    m.add(Client(3, 30 * GiB, weight=0.25))
    m.run(400)
    # GPU time: the lease less the swap-in at its start (the quantum starts after it)
    sh = {i: v - m.arb.sessions[i].totals.swap_in_s for i, v in m.lease_seconds().items()}
    assert sh[1] / sh[2] == pytest.approx(2.0, rel=0.05)
    assert sh[2] / sh[3] == pytest.approx(1.0, rel=0.05)


def test_killed_holder_lease_goes_to_next_waiter():
    m = Model(80 * GiB, GpuSettings(tq_s=10.0, mode="exclusive"))
    m.add(Client(1, 30 * GiB))
    m.add(Client(2, 30 * GiB), start=0.1)
    m.run(1)
    assert m.clients[1].holding
    m.kill(1)
    assert m.clients[2].holding
    assert m.arb.holders == [2]


sessions_st = st.lists(
    st.tuples(
        st.integers(1, 60),  # limit GiB
        st.sampled_from(["batch", "bursty"]),
        st.floats(0.05, 3.0),  # burst
        st.floats(0.05, 3.0),  # think
        st.sampled_from([0.25, 0.5, 1.0]),  # weight
        st.floats(0.0, 0.3),  # yield delay
        st.booleans(),  # fills: a current client (overlapped switches) or an older one
        st.booleans(),  # prefetch: it swaps in ahead of its grant when told
    ),
    min_size=1,
    max_size=8,
)


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sessions=sessions_st,
    mode=st.sampled_from(["auto", "exclusive"]),
    policy=st.sampled_from(["equal", "weighted"]),
    tq=st.floats(0.2, 5.0),
    kills=st.lists(st.tuples(st.floats(0, 60), st.integers(0, 7)), max_size=3),
    stuck=st.sets(st.integers(1, 8), max_size=2),
    escalation=st.sampled_from(["freeze", "kill"]),
)
def test_invariants_hold_for_any_workload_mix(sessions, mode, policy, tq, kills, stuck, escalation):
    """Never two exclusive holders, never over capacity, no starvation, even with
    holders that never yield (the escalation deals with them)."""
    cap = 64 * GiB
    m = Model(
        cap, GpuSettings(tq_s=tq, mode=mode, policy=policy, grace_s=1.0, escalation=escalation)
    )
    for i, (lim, kind, burst, think, w, yd, fills, pf) in enumerate(sessions, start=1):
        c = Client(
            i, lim * GiB, w, kind, burst, think, yd, stuck=i in stuck, fills=fills, prefetch=pf
        )
        m.add(c, start=0.01 * i)
    t = 0.0
    for when, idx in sorted(kills):
        m.run(when - t)
        t = when
        sid = idx % len(sessions) + 1
        if sid in m.clients:
            m.kill(sid)
    m.run(120 - t)
    if mode == "exclusive":
        assert m.max_holders <= 1
    assert m.max_on_gpu <= cap
    # No starvation: any wait is bounded by everyone else's quantum plus switch time,
    # and by the turns taken meanwhile: none once a waiter has waited a round (the
    # queue's length in quanta, docs/scheduling.md), and each lasts at most a turn.
    n = len(sessions)
    switch = 64 * GiB / 55e9 * 2 + 0.3 + 1.0  # swaps, a yield, a grace period
    turns = tq * (n + 1) + n * (m.arb.settings.turn_s + switch)
    bound = n * (tq + switch + 0.1) + 1.0 + turns
    for c in m.clients.values():
        if c.stuck:  # frozen by design; the others must not starve behind it
            continue
        waited = [*c.waits]
        if c.wants and not c.holding:
            waited.append(m.clock.monotonic() - c.want_since)
        assert max(waited, default=0) <= bound, (c.sid, max(waited), bound)


def test_freeze_escalation_hands_the_lease_on_and_thaws_at_its_turn(clock):
    a = arb(clock, tq_s=1, grace_s=1, mode="exclusive", escalation="freeze")
    quantum_over(a, clock, GiB)  # revoke
    clock.advance(1)
    out = a.tick()  # grace over: freeze
    assert actions_of(out, EscalateAction) == [EscalateAction(1, "freeze", "no_yield_within_grace")]
    (g,) = actions_of(out, GrantAction)
    assert g.session == 2 and not g.thaw
    assert a.sessions[1].esc.frozen and list(a.queue) == [1]
    a.release(2, resident=0, swapped=0)
    clock.advance(ANTICIPATE_FLOOR_S)  # 2 did not ask again within its window
    (g,) = actions_of(a.tick(), GrantAction)
    assert g.session == 1 and g.thaw and not a.sessions[1].esc.frozen


def test_frozen_memory_is_never_a_victim_and_cannot_deadlock(clock):
    a = arb(clock, capacity=10 * GiB, tq_s=1, grace_s=1, mode="exclusive", escalation="freeze")
    quantum_over(a, clock, 6 * GiB)
    clock.advance(1)
    out = a.tick()
    # 2 does not fit beside the frozen 6 GiB, which cannot swap and would not yield if
    # thawed: the escalation goes on to kill, once
    assert actions_of(out, SwapOutAction) == []
    assert actions_of(out, EscalateAction)[-1] == EscalateAction(1, "kill", "frozen_memory_needed")
    assert actions_of(a.tick(), EscalateAction) == []
    out = a.detach(1, reason="killed")
    assert [g.session for g in actions_of(out, GrantAction)] == [2]


def test_resumed_session_keeps_memory_and_lease(clock):
    a = arb(clock, tq_s=5, mode="exclusive")
    out = a.attach(
        1,
        AttachRecord(
            name="survivor",
            memory_limit=10 * GiB,
            resident=6 * GiB,
            swapped=4 * GiB,
            holding=True,
            lease=7,
            verified=True,
        ),
    )
    (g,) = actions_of(out, GrantAction)
    assert g.session == 1 and a.holders == [1]
    assert events_of(out, "attach")[0]["resumed"] is True
    assert (a.sessions[1].memory.resident, a.sessions[1].memory.swapped) == (6 * GiB, 4 * GiB)


def test_failed_swap_out_picks_another_victim_or_waits(clock):
    a = arb(clock, capacity=20 * GiB, tq_s=1, mode="exclusive")
    for i in (1, 2, 3):
        a.attach(i, AttachRecord(name=f"s{i}", memory_limit=10 * GiB))
    for i in (1, 2):
        a.acquire(i)
        a.report(i, resident=10 * GiB, swapped=0)
        clock.advance(1)
        a.release(i, resident=10 * GiB, swapped=0)
    out = a.acquire(3)
    assert actions_of(out, SwapOutAction) == [SwapOutAction(1, 10 * GiB)]
    out = a.swap_done(
        1,
        direction="out",
        nbytes=0,
        seconds=0.0,
        resident=10 * GiB,
        swapped=0,
        error="host memory exhausted",
    )
    assert events_of(out, "swap_out")[0]["error"] == "host memory exhausted"
    assert actions_of(out, SwapOutAction) == [SwapOutAction(2, 10 * GiB)]  # another way
    out = a.swap_done(
        2, direction="out", nbytes=0, seconds=0.0, resident=10 * GiB, swapped=0, error="copy failed"
    )
    assert actions_of(out, SwapOutAction) == []  # nobody left to ask: wait
    assert a.next_deadline() == pytest.approx(clock.monotonic() + 1.0)
    clock.advance(1.0)
    assert actions_of(a.tick(), SwapOutAction)  # then ask again


def test_over_limit_seen_by_the_gpu_escalates_once(clock):
    a = arb(clock, escalation="kill")
    a.attach(1, AttachRecord(name="greedy", memory_limit=GiB))
    out = a.over_limit(1, used=2 * GiB)
    assert actions_of(out, EscalateAction) == [EscalateAction(1, "kill", "over_memory_limit")]
    assert actions_of(a.over_limit(1, used=3 * GiB), EscalateAction) == []
    a.over_limit(1, used=GiB // 2)
    assert actions_of(a.over_limit(1, used=2 * GiB), EscalateAction)


def test_a_yield_that_crosses_the_freeze_is_taken_as_its_late_answer(clock):
    a = arb(clock, tq_s=1, grace_s=1, mode="exclusive", escalation="freeze")
    quantum_over(a, clock, 10 * GiB)
    clock.advance(1)
    a.tick()  # frozen while its yield was on the way
    out = a.release(
        1, resident=6 * GiB, swapped=4 * GiB, again=True, swapped_out=4 * GiB, seconds=0.1
    )
    assert events_of(out, "swap_out")[0]["bytes"] == 4 * GiB
    assert a.sessions[1].state is State.WAITING and list(a.queue) == [1]
    assert (a.sessions[1].memory.resident, a.sessions[1].memory.swapped) == (6 * GiB, 4 * GiB)


def _switch_setup(clock, **kw):
    """A holds 30 GiB of a 40 GiB GPU; B's 30 GiB are in host memory; A is revoked."""
    a = arb(clock, capacity=40 * GiB, tq_s=1, mode="exclusive", **kw)
    out = quantum_over(a, clock, 30 * GiB, swapped=30 * GiB, fills=(True, True))
    (r,) = actions_of(out, RevokeAction)
    assert r.session == 1 and r.swap_out == 20 * GiB
    return a


def test_overlapped_switch_swaps_in_as_the_swap_out_frees(clock):
    a = _switch_setup(clock)
    # A stops its GPU work and releases before swapping out: B is granted at once, with
    # room for what is free now (10 GiB), and swaps in while A swaps out.
    out = a.release(1, resident=30 * GiB, swapped=0, again=True, swapping_out=20 * GiB)
    (g,) = actions_of(out, GrantAction)
    assert (g.session, g.room, g.swap_in) == (2, 10 * GiB, 30 * GiB)
    rooms = []
    for done in range(1, 21):  # A reports each GiB it frees; B's room grows with it
        out = a.report(1, resident=(30 - done) * GiB, swapped=done * GiB)
        rooms += [x.room for x in actions_of(out, RoomAction)]
        assert a.used_bytes() <= a.capacity
        assert actions_of(out, SwapOutAction) == []  # nothing asked twice
    assert rooms == [(10 + i) * GiB for i in range(1, 20)] + [30 * GiB]
    assert a.next_deadline() is not None  # the quantum is bounded once the room is full
    a.swap_done(
        1, direction="out", nbytes=20 * GiB, seconds=0.4, resident=10 * GiB, swapped=20 * GiB
    )
    clock.advance(0.5)
    a.swap_done(2, direction="in", nbytes=30 * GiB, seconds=0.55, resident=30 * GiB, swapped=0)
    assert a.next_deadline() == pytest.approx(clock.monotonic() + 1)  # quantum from here


def test_without_overlap_the_next_holder_waits_for_the_whole_swap_out(clock):
    a = _switch_setup(clock, overlap=False)
    out = a.release(1, resident=30 * GiB, swapped=0, again=True, swapping_out=20 * GiB)
    assert actions_of(out, GrantAction) == []
    for done in range(1, 20):
        assert (
            actions_of(a.report(1, resident=(30 - done) * GiB, swapped=done * GiB), GrantAction)
            == []
        )
    (g,) = actions_of(a.report(1, resident=10 * GiB, swapped=20 * GiB), GrantAction)
    assert (g.session, g.room) == (2, 0)


def test_a_client_that_cannot_fill_gets_no_room(clock):
    a = arb(clock, capacity=40 * GiB, tq_s=1, mode="exclusive")
    quantum_over(a, clock, 30 * GiB, swapped=30 * GiB, fills=(True, False))  # 2: an older client
    assert (
        actions_of(
            a.release(1, resident=30 * GiB, swapped=0, again=True, swapping_out=20 * GiB),
            GrantAction,
        )
        == []
    )
    (g,) = actions_of(a.report(1, resident=10 * GiB, swapped=20 * GiB), GrantAction)
    assert g.room == 0


def test_a_failed_swap_out_under_a_filling_holder_is_asked_again(clock):
    a = _switch_setup(clock)
    a.release(1, resident=30 * GiB, swapped=0, again=True, swapping_out=20 * GiB)
    a.report(1, resident=25 * GiB, swapped=5 * GiB)
    out = a.swap_done(
        1,
        direction="out",
        nbytes=0,
        seconds=0.1,
        resident=25 * GiB,
        swapped=5 * GiB,
        error="host memory exhausted",
    )
    assert actions_of(out, SwapOutAction) == []  # not at once: it just failed
    clock.advance(SWAP_RETRY_S)
    assert actions_of(a.tick(), SwapOutAction) == [SwapOutAction(1, 15 * GiB)]


def test_overlap_shortens_switches_in_the_model():
    """Revoke-to-swapped-in time of a 30 GiB switch, overlapped vs one after the other."""

    def switch_times(overlap):
        m = Model(40 * GiB, GpuSettings(tq_s=1.0, mode="exclusive", overlap=overlap))
        for i in (1, 2):
            m.add(Client(i, 30 * GiB, fills=True, yield_delay=0.0))
        m.run(20)
        revokes = [e["ts"] for e in m.events if e["event"] == "revoke"]
        ins = [e["ts"] for e in m.events if e["event"] == "swap_in" and e["bytes"]]
        return [next(t for t in ins if t > r) - r for r in revokes[:-1]]

    over, seq = switch_times(True), switch_times(False)
    assert len(over) >= 5 and len(seq) >= 5
    ratio = (sum(over) / len(over)) / (sum(seq) / len(seq))
    assert ratio < 0.8, ratio  # the model's full-duplex link: about 0.5 + a chunk

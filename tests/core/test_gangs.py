"""Gangs: the ranks of one distributed job granted and revoked as one holder
(core/gangs.py, docs/scheduling.md "Gangs"), deterministic and as properties."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpushare.core.actions import EscalateAction, GrantAction, RevokeAction
from gpushare.core.arbiter import Arbiter, ArbiterError
from gpushare.core.attach import AttachRecord
from gpushare.core.gangs import REGROUP_S
from gpushare.core.sessions import State
from gpushare.settings import GpuSettings
from tests.core.model import Client, GiB, Model
from tests.profiles import examples


def of(actions, kind):
    return [a for a in actions if isinstance(a, kind)]


def granted(actions):
    return sorted(a.session for a in of(actions, GrantAction))


def revoked(actions):
    return sorted(a.session for a in of(actions, RevokeAction))


def two_jobs(clock, **kw):
    """Jobs A (sessions 1, 2) and B (3, 4), 10 GiB a rank on 80 GiB, exclusive, TQ 1:
    A holds, B waits."""
    a = Arbiter(0, 80 * GiB, clock, GpuSettings(mode="exclusive", tq_s=1, grace_s=2, **kw))
    for sid, job in ((1, "A"), (2, "A"), (3, "B"), (4, "B")):
        a.attach(sid, AttachRecord(name=f"s{sid}", memory_limit=10 * GiB, gang=job, gang_size=2))
    assert granted(a.acquire(1)) == [1]
    a.acquire(3)
    assert granted(a.acquire(2)) == [2]  # joins its gang's lease, ahead of B
    a.acquire(4)
    return a


def test_a_gang_is_granted_and_revoked_as_one_holder(clock):
    a = two_jobs(clock)
    assert a.holders == [1, 2] and list(a.queue) == [3, 4]
    clock.advance(1)
    out = a.tick()
    assert revoked(out) == [1, 2]  # together, at the quantum's end
    assert {r.grace_s for r in of(out, RevokeAction)} == {2}
    assert all(r.swap_out == 0 for r in of(out, RevokeAction))  # memory goes after all yield
    clock.advance(0.01)
    assert granted(a.release(1, resident=10 * GiB, swapped=0, again=True)) == []
    assert a.sessions[1].rank.parked  # the GPU is A's until rank 2 yields too
    out = a.release(2, resident=10 * GiB, swapped=0, again=True)
    assert granted(out) == [3, 4] and a.holders == [3, 4]
    assert not a.sessions[1].rank.parked and list(a.queue) == [1, 2]


def test_a_parked_member_goes_on_when_a_peer_is_blocked_waiting_for_it(clock):
    a = two_jobs(clock)
    clock.advance(1)
    a.tick()
    a.release(1, resident=10 * GiB, swapped=0, again=True)  # rank 1 yields; rank 2 is in
    assert a.next_deadline() == pytest.approx(clock.monotonic() + REGROUP_S)  # a collective
    clock.advance(REGROUP_S)
    out = a.tick()
    assert granted(out) == [1] and revoked(out) == [1]  # on to its next safe point
    grant = next(e.record for e in out if getattr(e, "record", {}).get("event") == "grant")
    assert grant["regroup"] and grant["gang"] == "A"
    # The gang's one deadline: the regrouped rank does not get a new grace period.
    assert a.sessions[1].lease.revoke_deadline == a.sessions[2].lease.revoke_deadline
    clock.advance(0.01)
    a.release(2, resident=10 * GiB, swapped=0, again=True)  # through the collective
    assert a.holders == [1]
    out = a.release(1, resident=10 * GiB, swapped=0, again=True)
    assert granted(out) == [3, 4]


def test_escalation_applies_to_the_gang_once_at_its_deadline(clock):
    a = two_jobs(clock)
    clock.advance(1)
    a.tick()
    a.release(1, resident=10 * GiB, swapped=0, again=True)
    escalated = []
    for _ in range(20):  # rank 2 never yields: regroups go on, within the gang's grace
        clock.set(a.next_deadline())
        out = a.tick()
        escalated += [e.session for e in of(out, EscalateAction)]
        if a.sessions[1].state is State.YIELDING:
            a.release(1, resident=10 * GiB, swapped=0, again=True)
    assert escalated == [2]  # the member still holding at the deadline, once
    assert clock.monotonic() > 1 + 2


def test_a_member_that_asks_while_its_gang_yields_is_granted_and_revoked(clock):
    a = Arbiter(0, 80 * GiB, clock, GpuSettings(mode="exclusive", tq_s=1))
    for sid, job in ((1, "A"), (2, "A"), (3, "B")):
        a.attach(sid, AttachRecord(name=f"s{sid}", memory_limit=10 * GiB, gang=job))
    a.acquire(1)
    a.acquire(3)
    clock.advance(1)
    assert revoked(a.tick()) == [1]
    # rank 1 may be blocked in a collective waiting for it: it goes on at the regroup (not
    # at once: ranks asking in turn would keep the revoked gang holding for ever)
    assert granted(a.acquire(2)) == [] and a.sessions[2].rank.parked
    clock.advance(REGROUP_S)
    out = a.tick()
    assert granted(out) == [2] and revoked(out) == [2]


def test_a_joining_member_gets_what_is_left_of_its_gangs_quantum(clock):
    a = Arbiter(0, 80 * GiB, clock, GpuSettings(mode="exclusive", tq_s=4))
    for sid in (1, 2):
        a.attach(sid, AttachRecord(name=f"s{sid}", memory_limit=10 * GiB, gang="A"))
    a.acquire(1)
    clock.advance(3)
    assert of(a.acquire(2), GrantAction)[0].quantum_s == pytest.approx(1)


def test_members_never_waited_for_do_not_hold_the_gpu(clock):
    """A gang whose client says it has 8 ranks, of which 2 come: the GPU goes round as
    usual (the members present are the gang; the size is shown, not waited for)."""
    a = Arbiter(0, 80 * GiB, clock, GpuSettings(mode="exclusive", tq_s=1))
    for sid in (1, 2):
        a.attach(sid, AttachRecord(name=f"s{sid}", memory_limit=10 * GiB, gang="A", gang_size=8))
    a.attach(3, AttachRecord(name="s3", memory_limit=10 * GiB))
    a.acquire(1)
    a.acquire(3)
    clock.advance(1)
    a.tick()
    assert granted(a.release(1, resident=0, swapped=0, again=True)) == [3]


def test_a_gang_whose_ranks_cannot_fit_together_is_refused(clock):
    a = Arbiter(0, 16 * GiB, clock)
    a.attach(1, AttachRecord(name="r0", memory_limit=10 * GiB, gang="A"))
    with pytest.raises(ArbiterError, match="give each less"):
        a.attach(2, AttachRecord(name="r1", memory_limit=10 * GiB, gang="A"))
    assert set(a.sessions) == {1} and a.gangs["A"].members == {1}  # nothing changed
    a.attach(2, AttachRecord(name="r1", memory_limit=6 * GiB, gang="A"))


def test_a_job_spanning_nodes_is_refused_in_exclusive_mode_only(clock):
    a = Arbiter(0, 16 * GiB, clock, GpuSettings(mode="exclusive"))
    with pytest.raises(ArbiterError, match=r"ranks on other nodes.*mode auto"):
        a.attach(
            1, AttachRecord(name="r0", memory_limit=GiB, gang="A", gang_size=2, spans_nodes=True)
        )
    assert not a.sessions and not a.gangs
    b = Arbiter(0, 16 * GiB, clock, GpuSettings(mode="auto"))
    b.attach(1, AttachRecord(name="r0", memory_limit=GiB, gang="A", gang_size=2, spans_nodes=True))
    assert b.gangs["A"].spans_nodes


def test_a_detached_member_completes_its_gangs_yield(clock):
    a = two_jobs(clock)
    clock.advance(1)
    a.tick()
    a.release(1, resident=10 * GiB, swapped=0, again=True)
    assert granted(a.detach(2)) == [3, 4]
    assert not a.sessions[1].rank.parked


def ddp_jobs(jobs: int, ranks: int, send_gang: bool, **kw) -> Model:
    m = Model(64 * GiB, GpuSettings(mode="exclusive", tq_s=1, grace_s=1, **kw))
    sid = 1
    for j in range(jobs):
        for r in range(ranks):
            c = Client(sid, 8 * GiB, kind="ddp", job=f"job{j}", send_gang=send_gang)
            c.yield_delay, c.step_s = 0.003 * (sid % 3), 0.02 + 0.01 * r
            m.add(c, start=0.01 * sid)
            sid += 1
    return m


def test_ddp_ranks_deadlock_without_gangs_and_progress_with_them():
    """Issue 14's finding in the model: a rank holds the GPU and waits in its collective
    for a rank waiting for the GPU. Told their job, both jobs go on, in turns."""
    stuck = ddp_jobs(2, 2, send_gang=False)
    stuck.run(20)
    assert max(c.steps for c in stuck.clients.values()) <= 1
    m = ddp_jobs(2, 2, send_gang=True)
    m.run(20)
    steps = {c.job: c.steps for c in m.clients.values()}
    assert min(steps.values()) > 100, steps  # each job works about half of the 20 s
    assert not [e for e in m.events if e["event"] == "escalate"]


ddp_st = st.lists(
    st.tuples(
        st.integers(1, 3),  # ranks
        st.integers(1, 12),  # GiB a rank
        st.floats(0.005, 0.2),  # step
        # How late its last rank sees the gang's revoke (the first at once): ranks stop
        # at different safe points, and regroups bring them together.
        st.floats(0.0, 0.2),
    ),
    min_size=1,
    max_size=3,
)


@settings(
    max_examples=examples(100, dev=10), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    jobs=ddp_st,
    solo=st.lists(st.integers(1, 30), max_size=3),
    mode=st.sampled_from(["auto", "exclusive"]),
    tq=st.floats(0.2, 3.0),
    kills=st.lists(st.tuples(st.floats(0, 30), st.integers(0, 11)), max_size=2),
)
def test_gang_invariants_hold_for_any_mix(jobs, solo, mode, tq, kills):
    """Never two jobs holding in mode exclusive, never over capacity, and every job
    (gangs beside solo batch sessions) goes on: no deadlock, no starvation."""
    cap = 64 * GiB
    m = Model(cap, GpuSettings(tq_s=tq, mode=mode, grace_s=2.0, escalation="kill"))
    sid = 1
    for j, (ranks, gib, step, yd) in enumerate(jobs):
        for r in range(ranks):
            c = Client(sid, gib * GiB, kind="ddp", job=f"job{j}", yield_delay=yd * r / 2)
            c.step_s = step
            m.add(c, start=0.01 * sid)
            sid += 1
    for gib in solo:
        m.add(Client(sid, gib * GiB, fills=True, prefetch=True), start=0.01 * sid)
        sid += 1
    t = 0.0
    for when, idx in sorted(kills):
        m.run(when - t)
        t = when
        if idx + 1 in m.clients:
            m.kill(idx + 1)
    before = {c.sid: (c.steps, len(c.grant_times)) for c in m.clients.values()}
    m.run(60 - t)
    if mode == "exclusive":
        assert m.max_holders <= 1
    assert m.max_on_gpu <= cap
    # No rank is taken for one that refuses to yield (and killed): within the gang's
    # grace period every rank reaches a safe point.
    assert not [e for e in m.events if e["event"] == "escalate"]
    # Every job still there goes on in the last 30 s: its ranks complete collectives,
    # a solo session is granted (a batch session holds until revoked: a grant a round).
    for c in m.clients.values():
        if c.kind == "ddp":
            assert c.steps > before[c.sid][0], (c.sid, c.steps, before[c.sid])
        else:
            waited = [*c.waits]
            if c.wants and not c.holding:
                waited.append(m.clock.monotonic() - c.want_since)
            n = len(jobs) + len(solo)
            assert max(waited, default=0) <= n * (tq + 2.0 + 2.5) + 5, (c.sid, waited)


def test_ranks_that_end_bursts_in_turn_do_not_keep_a_revoked_gang_holding(clock):
    # two processes of one GPUSHARE_GANG with bursts of their own: each ended its burst
    # (no `again`) and asked anew while the other held, and joined the revoked gang at
    # once: the gang held for ever (a solo session got 36 of ~120 steps in 14 s)
    a = two_jobs(clock)
    clock.advance(1)
    assert revoked(a.tick()) == [1, 2]
    for _ in range(3):
        clock.advance(0.01)
        a.release(1, resident=10 * GiB, swapped=0)  # a burst's end, then at once a new one
        assert granted(a.acquire(1)) == []  # it waits as a parked member does
        assert a.sessions[1].rank.parked
        if a.holders != [2]:
            break
    clock.advance(0.01)
    out = a.release(2, resident=10 * GiB, swapped=0)
    assert granted(out) == [3, 4]  # the gang has yielded: the next job holds


def test_a_ranks_grant_into_a_room_leaves_room_for_its_peers(clock):
    # Seen on a node of 16 GiB: a solo session's swap-out was in flight when the first
    # rank of a gang (6 GiB each) was granted into a room; the gang then held, its other
    # rank counted at its limit, and the node counted 16.75 GiB on 16.
    cap = 16 * GiB
    a = Arbiter(0, cap, clock, GpuSettings(mode="exclusive", tq_s=1, grace_s=2))
    a.attach(3, AttachRecord(name="solo", memory_limit=6 * GiB, fills=True))
    for sid in (1, 2):
        a.attach(
            sid,
            AttachRecord(
                name=f"r{sid}", memory_limit=6 * GiB, gang="job7", gang_size=2, fills=True
            ),
        )
    a.acquire(1)  # rank 1 holds and fills its 6 GiB, then yields to the solo session
    a.report(1, resident=5 * GiB, swapped=0)
    a.acquire(3)
    clock.advance(1)
    a.tick()
    a.release(1, resident=5 * GiB, swapped=0, again=True)
    assert a.holders == [3]
    a.report(3, resident=5 * GiB, swapped=0)
    assert a.used_bytes() <= cap
    # rank 1 swapped out for the solo session
    a.swap_done(1, direction="out", nbytes=5 * GiB, seconds=0.1, resident=0, swapped=5 * GiB)
    clock.advance(1)
    a.tick()  # the solo session is revoked: it swaps out as rank 1 swaps in
    a.acquire(2)
    a.release(3, resident=5 * GiB, swapped=0, again=True)
    assert a.used_bytes() <= cap, (
        a.used_bytes() / GiB,
        [a.sessions[h].memory.room for h in a.holders],
    )
    # Rank 1 swaps in into a room beside what the solo session has yet to swap out, and
    # its peer (which joins it) has its limit kept free.
    assert a.holders == [1, 2] and a.sessions[1].memory.room == cap - 5 * GiB - 6 * GiB
    a.verify()

"""The scheduling rules of docs/scheduling.md, deterministic (ManualClock): a quantum that
waits for its holder to ask again, interactive turns paid from a credit, prefetch during
the quantum, and quanta that pay back GPU time held past earlier ones."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpushare.core.actions import GrantAction, PrefetchAction, RevokeAction, SwapOutAction
from gpushare.core.arbiter import Arbiter, ArbiterError
from gpushare.core.attach import AttachRecord
from gpushare.core.clock import ManualClock
from gpushare.core.ledger import view
from gpushare.core.sessions import State
from gpushare.core.shares import PAYBACK
from gpushare.core.window import ANTICIPATE_FLOOR_S
from gpushare.settings import GpuSettings
from tests.core.model import Client, GiB, Model, actions_of, events_of
from tests.profiles import examples


def arb(clock, capacity=80 * GiB, **kw):
    kw.setdefault("mode", "exclusive")
    return Arbiter(0, capacity, clock, GpuSettings(**kw))


def burst(a, clock, sid, seconds, resident=GiB):
    """``sid`` (granted now) works ``seconds`` and ends its burst."""
    clock.advance(seconds)
    return a.release(sid, resident=resident, swapped=0)


# --- a quantum waits for its holder to ask again ------------------------------------------


def test_a_session_that_asks_again_within_its_window_keeps_its_quantum(clock):
    a = arb(clock, tq_s=5)
    a.attach(1, AttachRecord(name="short", memory_limit=GiB))
    a.attach(2, AttachRecord(name="other", memory_limit=GiB))
    a.acquire(1)
    a.acquire(2)
    end = a.sessions[1].lease.quantum_end
    for _ in range(20):  # 20 bursts of 0.1 s, 1 ms apart: one quantum, no switch
        out = burst(a, clock, 1, 0.1)
        assert actions_of(out, GrantAction) == []
        clock.advance(0.001)
        (g,) = actions_of(a.acquire(1), GrantAction)
        assert g.session == 1 and g.quantum_s == pytest.approx(end - clock.monotonic())
        assert events_of(a.tick(), "grant") == []
    assert a.sessions[1].lease.quantum_end == end  # the same quantum all along
    assert a.sessions[1].totals.continues == 20 and a.sessions[2].state is State.WAITING
    clock.set(end)
    assert [r.session for r in actions_of(a.tick(), RevokeAction)] == [1]  # and it ends


def test_the_window_follows_the_sessions_gaps_and_none_when_it_stays_away(clock):
    a = arb(clock, tq_s=30, anticipate_s=0.5)
    a.attach(1, AttachRecord(name="a", memory_limit=GiB))
    a.attach(2, AttachRecord(name="b", memory_limit=GiB))
    a.acquire(1)

    def windows(gap, n):
        out = []
        for _ in range(n):
            rel = burst(a, clock, 1, 0.5)
            out.append(events_of(rel, "release")[0].get("anticipate_s", 0.0))
            clock.advance(gap)
            a.tick()
            a.acquire(1)
        return out

    short = windows(0.02, 4)  # asks again 20 ms after each burst
    assert short[0] == ANTICIPATE_FLOOR_S  # no history yet: the floor
    assert short[-1] == pytest.approx(max(ANTICIPATE_FLOOR_S, 4 * a.sessions[1].share.gap_ewma))
    assert short[1:] == sorted(short[1:]) and all(w <= 0.5 for w in short)
    long = windows(2.0, 4)  # now it stays away 2 s each time: a session done for now
    assert long[-1] == 0.0 and a.sessions[1].share.gap_ewma > 0.25
    a.acquire(2)  # and at its burst's end the next gets the GPU at once
    out = burst(a, clock, 1, 0.5)
    assert [g.session for g in actions_of(out, GrantAction)] == [2]


def test_the_window_never_outlasts_the_quantum(clock):
    a = arb(clock, tq_s=1)
    a.attach(1, AttachRecord(name="a", memory_limit=GiB))
    a.attach(2, AttachRecord(name="b", memory_limit=GiB))
    a.acquire(1)
    a.acquire(2)
    out = burst(a, clock, 1, 0.99)  # 10 ms of its quantum left
    assert events_of(out, "release")[0]["anticipate_s"] == pytest.approx(0.01)
    clock.advance(0.01)
    assert [g.session for g in actions_of(a.tick(), GrantAction)] == [2]


def test_a_waiting_quantum_keeps_its_memory_and_ends_with_its_session(clock):
    a = arb(clock, capacity=40 * GiB, tq_s=5, turn_s=0)
    a.attach(1, AttachRecord(name="a", memory_limit=30 * GiB))
    a.attach(2, AttachRecord(name="b", memory_limit=30 * GiB))
    a.attach(3, AttachRecord(name="idle", memory_limit=10 * GiB, resident=10 * GiB))
    a.acquire(1)
    a.report(1, resident=20 * GiB, swapped=0)
    out = burst(a, clock, 1, 1.0, resident=20 * GiB)
    assert a.window.holder == 1 and a.used_bytes() == 40 * GiB  # counted at its limit
    out = a.acquire(2)  # 2 must wait: nothing of 1's is asked to go meanwhile
    assert actions_of(out, GrantAction) == [] and actions_of(out, SwapOutAction) == []
    out = a.detach(1)
    assert a.window.holder is None
    assert [g.session for g in actions_of(out, GrantAction)] == [2]


# --- interactive turns ----------------------------------------------------------------------


def had_a_burst(a, clock, sid, resident=GiB):
    """``sid`` ran one short burst alone (its first, which is never a turn)."""
    a.acquire(sid)
    clock.advance(0.1)
    a.release(sid, resident=resident, swapped=a.sessions[sid].memory.swapped)
    clock.advance(1.0)
    a.tick()  # its window passed
    assert a.window.holder is None


def notebook_beside_batch(clock, **kw):
    """Batch session 1 holds (TQ 30); 2 waits; notebook 3 ran a first burst and has idled
    4 s since (with the credit it attached with: a turn)."""
    a = arb(clock, tq_s=30, turn_s=1.0, turn_share=0.25, **kw)
    a.attach(1, AttachRecord(name="batch1", memory_limit=10 * GiB))
    a.attach(2, AttachRecord(name="batch2", memory_limit=10 * GiB))
    a.attach(3, AttachRecord(name="notebook", memory_limit=10 * GiB))
    had_a_burst(a, clock, 3)  # (a first burst is never a turn: nothing is known of it)
    a.acquire(1)
    a.acquire(2)
    clock.advance(4.0)
    return a


def test_a_notebook_cell_goes_ahead_of_the_queue_for_a_bounded_turn(clock):
    a = notebook_beside_batch(clock)
    left = a.sessions[1].lease.quantum_end - clock.monotonic()
    out = a.acquire(3)
    (r,) = actions_of(out, RevokeAction)
    assert r.session == 1 and events_of(out, "revoke")[0]["reason"] == "turn"
    assert list(a.queue) == [3, 2]
    clock.advance(0.005)  # the batch job's next safe point
    out = a.release(1, resident=GiB, swapped=0, again=True)
    (g,) = actions_of(out, GrantAction)
    assert g.session == 3 and g.quantum_s == pytest.approx(1.0)  # its credit, at most turn_s
    assert events_of(out, "grant")[0]["turn"] is True
    assert list(a.queue) == [1, 2]  # the batch job goes on next, before 2
    clock.advance(0.2)  # the cell's work
    out = a.release(3, resident=GiB, swapped=0)
    (g,) = actions_of(out, GrantAction)  # no window after a turn
    assert g.session == 1 and events_of(out, "grant")[0]["resumed"] is True
    assert g.quantum_s == pytest.approx(left - 0.005)  # the rest of its quantum
    assert a.sessions[3].share.credit == pytest.approx(0.8)  # paid for the turn
    assert a.sessions[3].totals.turns == 1


def test_a_cell_that_asks_between_holders_takes_its_turn(clock):
    # The GPU is between holders: the batch job whose quantum ended swaps out so that the
    # next can swap in. A cell that asks then goes first (issue 25: it waited behind the
    # next holder's whole quantum, 20 s at TQ 30, as an ordinary waiter).
    a = arb(clock, capacity=30 * GiB, tq_s=30, turn_s=1.0, turn_share=0.25, mode="exclusive")
    a.attach(1, AttachRecord(name="batch1", memory_limit=20 * GiB))
    a.attach(2, AttachRecord(name="batch2", memory_limit=20 * GiB))
    a.attach(3, AttachRecord(name="notebook", memory_limit=2 * GiB))
    had_a_burst(a, clock, 3)
    a.acquire(1)
    a.report(1, resident=20 * GiB, swapped=0)
    a.acquire(2)
    clock.advance(30.0)
    a.tick()  # 1's quantum is over: revoked, its memory asked for by the next holder
    a.release(1, resident=20 * GiB, swapped=0, again=True, swapping_out=10 * GiB)
    assert not a.holders and list(a.queue) == [2, 1]  # between holders
    out = a.acquire(3)
    (g,) = actions_of(out, GrantAction)
    assert g.session == 3 and events_of(out, "grant")[0]["turn"] is True
    assert g.quantum_s <= 1.0 and list(a.queue) == [2, 1]  # the queue goes on after it


def test_a_turn_is_cut_at_its_length_and_the_cell_waits_in_line(clock):
    a = notebook_beside_batch(clock)
    a.acquire(3)
    a.release(1, resident=GiB, swapped=0, again=True)
    clock.advance(1.0)
    (r,) = actions_of(a.tick(), RevokeAction)  # the turn is over: the queue goes on
    assert r.session == 3
    (g,) = actions_of(a.release(3, resident=GiB, swapped=0, again=True), GrantAction)
    assert g.session == 1 and list(a.queue) == [2, 3]
    assert a.sessions[3].share.credit == 0


@pytest.mark.parametrize(
    ("idle", "burst", "turn_s", "takes"),
    [
        (4.0, 0.1, 1.0, True),
        (0.1, 0.1, 1.0, False),  # asked again soon: not rarely
        (0.25, 0.05, 1.0, False),  # within half of idle_release: its quantum would wait
        (0.3, 0.05, 1.0, True),  # past it: a notebook that thinks half a second
        (4.0, 2.0, 1.0, False),  # its bursts are longer than its credit: not briefly
        (0.6, 0.1, 1.0, True),  # 0.15 s of credit covers its 0.1 s bursts
        (4.0, 0.1, 0.0, False),  # turns off
        (4.0, None, 1.0, False),  # no burst of its own yet: nothing known of it
    ],
)
def test_who_gets_a_turn(clock, idle, burst, turn_s, takes):
    a = arb(clock, tq_s=30, turn_s=turn_s, turn_share=0.25, anticipate_s=0.5)
    a.attach(1, AttachRecord(name="batch", memory_limit=GiB))
    a.attach(3, AttachRecord(name="cell", memory_limit=GiB))
    had_a_burst(a, clock, 3)
    a.sessions[3].share.credit = 0.0
    a.acquire(1)
    a.sessions[3].share.bursts.clear()
    if burst is not None:
        a.sessions[3].share.bursts.append(burst)
    a.sessions[3].share.windowless = False  # its quantum waited for it (a window): rule 1's
    a.sessions[3].lease.idle_since = clock.monotonic()
    clock.advance(idle)
    out = a.acquire(3)
    assert bool(actions_of(out, RevokeAction)) is takes
    assert a.sessions[3].share.turn is takes
    if takes:
        assert a.sessions[3].share.credit == pytest.approx(min(turn_s, 0.25 * idle))


def test_credit_follows_the_weights(clock):
    a = arb(clock, tq_s=30, policy="weighted", turn_s=1.0, turn_share=0.25)
    a.attach(1, AttachRecord(name="heavy", memory_limit=GiB, weight=1.0))
    a.attach(2, AttachRecord(name="light", memory_limit=GiB, weight=0.25))
    had_a_burst(a, clock, 2)
    a.sessions[2].share.credit = credit = 0.0
    a.acquire(1)
    clock.advance(2.0)
    a.acquire(2)
    assert a.sessions[2].share.credit == pytest.approx(credit + 0.25 * 0.25 * 3.0)  # idle 3 s


def test_no_turn_once_someone_waited_a_round(clock):
    a = notebook_beside_batch(clock)
    a.sessions[2].lease.wait_start -= 90.0  # 2 has waited a round (3 x 30 s: slow switches, say)
    out = a.acquire(3)
    assert actions_of(out, RevokeAction) == [] and list(a.queue) == [2, 3]


def test_a_turn_pauses_a_quantum_that_waits_for_its_holder(clock):
    a = notebook_beside_batch(clock)
    a.release(1, resident=GiB, swapped=0)  # 1 ends a burst: its quantum waits for it
    assert a.window.holder == 1
    left = a.sessions[1].lease.quantum_end - clock.monotonic()
    (g,) = actions_of(a.acquire(3), GrantAction)
    assert g.session == 3 and a.window.holder is None
    clock.advance(0.01)
    a.acquire(1)  # it asks again during the turn: next, with the rest of its quantum
    assert list(a.queue) == [1, 2]
    clock.advance(0.1)
    (g,) = actions_of(a.release(3, resident=GiB, swapped=0), GrantAction)
    assert g.session == 1 and g.quantum_s == pytest.approx(left)


def test_a_turn_plans_the_cells_memory_with_the_revoke(clock):
    """The notebook's swapped bytes come back while the batch job winds down: the revoke
    carries the batch job's share of the swap-out."""
    a = arb(clock, capacity=40 * GiB, tq_s=30, turn_s=1.0)
    a.attach(1, AttachRecord(name="batch", memory_limit=30 * GiB))
    a.attach(3, AttachRecord(name="cell", memory_limit=20 * GiB, swapped=20 * GiB))
    had_a_burst(a, clock, 3, resident=0)
    a.acquire(1)
    a.report(1, resident=30 * GiB, swapped=0)
    clock.advance(10)
    (r,) = actions_of(a.acquire(3), RevokeAction)
    assert r.swap_out == 10 * GiB


# --- a server's requests: turns that last ------------------------------------------------------


def requests(rng, rate, service, *, slow_at, until, slow_s=1.5):
    """Poisson arrivals (gap, GPU seconds), one of them slow (``slow_s``) at ``slow_at``."""
    t, slow = 0.0, False
    while t < until:
        gap = rng.expovariate(rate)
        t += gap
        s = service
        if not slow and t >= slow_at:
            s, slow = slow_s, True
        yield gap, s


def server_beside_batch(rate, capacity_gib, tail_s, *, seconds=600.0, seed=3, weight=1.0, **kw):
    """Batch job 1 (40 GiB, holding from the start) and server 2 (20 GiB, requests of
    0.17 s, one of 1.5 s at 200 s) at TQ 30, mode exclusive; ``tail_s``: the client's
    idle release after a request."""
    settings = GpuSettings(tq_s=30, mode="exclusive", turn_s=1.0, turn_share=0.25, **kw)
    m = Model(capacity_gib * GiB, settings)
    m.add(Client(1, 40 * GiB, fills=True, prefetch=True))
    arrivals = requests(random.Random(seed), rate, 0.17, slow_at=200.0, until=seconds)
    srv = Client(2, 20 * GiB, weight, "server", fills=True, prefetch=True, tail_s=tail_s)
    srv.arrivals = arrivals
    m.add(srv, 1.0)
    t0 = m.clock.monotonic()
    m.run(seconds)
    return m, srv, t0


@pytest.mark.parametrize(
    ("rate", "capacity_gib", "tail_s"),
    [
        (0.5, 80, 0.5),  # today's client: each request holds the lease 0.5 s after it
        (0.5, 50, 0.5),  # oversubscribed: every turn swaps the server's 20 GiB back in
        (2.0, 80, 0.05),  # busier, with the shorter release a server's history allows
    ],
)
def test_a_servers_requests_are_answered_within_a_second_beside_a_batch_holder(
    rate, capacity_gib, tail_s
):
    """Issue 28: a server's requests waited for the batch job's quantum (p50 18-23 s at
    TQ 30) once one backlog had lifted its usual burst above the turn cap. Here its first
    burst drains a backlog (it waits a quantum: nothing is known of it yet), one request
    takes 1.5 s, and every request after the backlog still starts within about a second
    (a turn: the batch job's safe point and the server's swap-in), past the slow one's
    own queue at most its 1.5 s; the server's GPU time stays within its weight's half."""
    m, srv, t0 = server_beside_batch(rate, capacity_gib, tail_s)
    first_end = srv.work[0][1]
    first = srv.work[0][1] - srv.work[0][0]
    assert 2.0 <= first <= 18.0 + tail_s  # the backlog, drained in one burst
    after = [(a, w) for a, w in srv.request_waits if a > first_end]
    assert len(after) >= 0.8 * rate * 500
    waits = sorted(w for _, w in after)
    assert waits[int(0.99 * len(waits))] <= 1.0, waits[-10:]
    assert waits[-1] <= 1.5 + 0.6, waits[-10:]  # behind the slow one, in the same turn
    slow = next(a for a, _ in srv.latencies if a - t0 >= 201.0)
    assert any(a > slow + 10 for a, _ in srv.request_waits)  # turns went on after it
    end = m.clock.monotonic()
    assert m.work(2, t0, end) <= 0.5 * (end - t0)
    assert m.work(1, t0, end) >= 0.45 * (end - t0)


@pytest.mark.parametrize(("weight", "share"), [(1.0, 0.5), (1.0 / 3, 0.25)])
def test_an_overloaded_server_gets_its_weights_share_and_no_more(weight, share):
    """Requests at 8 a second of 0.17 s each want 136% of the GPU: the server holds the
    GPU its weight's share of the time (round-robin then, as a batch job), turns or not."""
    m, _, t0 = server_beside_batch(8.0, 80, 0.05, seconds=300.0, weight=weight, policy="weighted")
    end = m.clock.monotonic()
    got = m.work(2, t0, end) / (end - t0)
    assert got <= share * 1.1, got


def test_a_backlog_or_a_slow_request_does_not_lift_the_usual_burst(clock):
    """A burst that waited for its lease (a backlog) counts at most at the turn cap; the
    usual burst is the lower median of the recent ones: one long burst changes nothing."""
    a = arb(clock, tq_s=30, turn_s=1.0)
    a.attach(1, AttachRecord(name="batch", memory_limit=GiB))
    a.attach(2, AttachRecord(name="server", memory_limit=GiB))
    a.acquire(1)
    a.acquire(2)  # its first burst: never a turn; it waits for the quantum
    clock.advance(30.0)
    a.tick()
    a.release(1, resident=GiB, swapped=0, again=True)
    clock.advance(5.0)  # the backlog
    a.release(2, resident=GiB, swapped=0)
    s = a.sessions[2].share
    assert list(s.bursts) == [1.0]  # 5 s of backlog counted at the cap
    clock.advance(3.0)
    a.tick()  # its window passed: the batch job holds

    def request(seconds):
        out = a.acquire(2)  # (a full credit covers the cap: a turn, even the first time)
        assert a.sessions[2].share.turn and actions_of(out, RevokeAction)
        a.release(1, resident=GiB, swapped=0, again=True)
        clock.advance(seconds)
        a.tick()
        a.release(2, resident=GiB, swapped=0)
        clock.advance(3.0)

    for _ in range(3):
        request(0.2)
    assert a.turns.usual_burst(a.sessions[2]) == pytest.approx(0.2)
    request(1.5)  # a slow request: its turn goes on while its credit does
    assert a.turns.usual_burst(a.sessions[2]) == pytest.approx(0.2)
    request(0.2)


def test_a_server_short_of_credit_takes_its_turn_once_its_wait_has_earned_it(clock):
    """A bunch of requests spent its credit and overdraft: its next request waits, but
    for what its credit needs (earned at its fraction u of each second waited), not for
    the batch job's quantum (30 s)."""
    a = arb(clock, tq_s=30, turn_s=1.0, turn_share=0.25)
    a.attach(1, AttachRecord(name="batch", memory_limit=GiB))
    a.attach(2, AttachRecord(name="server", memory_limit=GiB))
    had_a_burst(a, clock, 2)
    a.acquire(1)
    sh = a.sessions[2].share
    sh.use_s, sh.use_span, sh.use_at = 30.0, 60.0, clock.monotonic()  # half the time: u 0.5
    sh.bursts.extend([0.5] * 4)
    sh.credit = -0.6  # the overdraft (0.5) spent too
    sh.windowless, sh.gap_ewma = True, 1.0
    a.sessions[2].lease.idle_since = clock.monotonic()
    clock.advance(0.05)
    out = a.acquire(2)
    assert not actions_of(out, RevokeAction) and not sh.turn  # short: it waits
    due = a.next_deadline()
    assert due is not None and due - clock.monotonic() < 3.0  # 0.55 s of credit at 0.5/s
    clock.set(due)
    out = a.tick()
    (r,) = actions_of(out, RevokeAction)
    assert r.session == 1 and events_of(out, "revoke")[0]["reason"] == "turn"
    assert sh.turn and a.queue[0] == 2


def test_a_session_that_joins_the_holders_is_not_given_a_turn(clock):
    """Mode auto with memory that fits: the server joins the holders (issue 28: 9 such
    grants were marked turn: true)."""
    a = arb(clock, tq_s=30, turn_s=1.0, mode="auto")
    a.attach(1, AttachRecord(name="batch", memory_limit=10 * GiB))
    a.attach(2, AttachRecord(name="server", memory_limit=10 * GiB))
    had_a_burst(a, clock, 2)
    a.acquire(1)
    clock.advance(4.0)
    out = a.acquire(2)
    (g,) = actions_of(out, GrantAction)
    assert g.session == 2 and g.shared
    assert "turn" not in events_of(out, "grant")[0] and not actions_of(out, RevokeAction)


# --- prefetch during the quantum -------------------------------------------------------------


def three_of_30_on_80(clock, **kw):
    """A holds 30 GiB of 80; B (next) has 20 resident, 10 in host memory; C is idle with
    30 resident. All three prefetch; no turns here."""
    a = arb(clock, tq_s=5, turn_s=0, **kw)
    a.attach(1, AttachRecord(name="A", memory_limit=30 * GiB, prefetch=True))
    a.attach(
        2,
        AttachRecord(
            name="B", memory_limit=30 * GiB, resident=20 * GiB, swapped=10 * GiB, prefetch=True
        ),
    )
    a.attach(3, AttachRecord(name="C", memory_limit=30 * GiB, resident=30 * GiB, prefetch=True))
    a.acquire(1)
    a.report(1, resident=30 * GiB, swapped=0)
    return a


def test_the_next_holder_swaps_in_during_the_quantum(clock):
    a = three_of_30_on_80(clock)
    clock.advance(0.5)
    out = a.acquire(2)
    # nothing is free (30 + 20 + 30): idle C (not expected back: no history) gives 10 GiB
    assert actions_of(out, SwapOutAction) == [SwapOutAction(3, 10 * GiB)]
    assert actions_of(out, PrefetchAction) == []
    out = a.swap_done(
        3, direction="out", nbytes=10 * GiB, seconds=0.2, resident=20 * GiB, swapped=10 * GiB
    )
    (pf,) = actions_of(out, PrefetchAction)
    assert (pf.session, pf.room, pf.seq) == (2, 30 * GiB, 1)
    assert a.sessions[2].used == 30 * GiB and a.used_bytes() <= a.capacity
    # while it prefetches it is nobody's victim, and counts at its room
    assert view(a.sessions[2], clock.monotonic(), a.settings.mode).pinned
    out = a.swap_done(
        2,
        direction="in",
        nbytes=10 * GiB,
        seconds=0.2,
        resident=30 * GiB,
        swapped=0,
        prefetch=1,
    )
    assert events_of(out, "swap_in")[0]["prefetch"] is True
    assert not a.sessions[2].prefetch.active
    clock.set(a.sessions[1].lease.quantum_end)
    (r,) = actions_of(a.tick(), RevokeAction)
    assert r.swap_out == 0  # B fits beside A: a handoff, not a swap
    (g,) = actions_of(a.release(1, resident=30 * GiB, swapped=0, again=True), GrantAction)
    assert (g.session, g.swap_in, g.room) == (2, 0, 0)


def test_prefetch_grows_with_what_frees_and_acks_in_order(clock):
    a = arb(clock, capacity=40 * GiB, tq_s=5)
    a.attach(1, AttachRecord(name="A", memory_limit=20 * GiB))
    a.attach(
        2,
        AttachRecord(name="B", memory_limit=20 * GiB, resident=0, swapped=20 * GiB, prefetch=True),
    )
    a.attach(3, AttachRecord(name="idle", memory_limit=20 * GiB, resident=10 * GiB))
    a.acquire(1)
    out = a.acquire(2)
    (pf,) = actions_of(out, PrefetchAction)
    assert pf.room == 10 * GiB  # what is free now
    assert actions_of(out, SwapOutAction) == [SwapOutAction(3, 10 * GiB)]
    out = a.report(3, resident=5 * GiB, swapped=5 * GiB)  # half of it has gone
    (pf2,) = actions_of(out, PrefetchAction)
    assert (pf2.room, pf2.seq) == (15 * GiB, 2)
    # the client was done with the first ask only: still counted at the second's room
    a.swap_done(
        2, direction="in", nbytes=GiB, seconds=0.1, resident=10 * GiB, swapped=10 * GiB, prefetch=1
    )
    assert a.sessions[2].prefetch.active and a.sessions[2].used == 15 * GiB
    a.swap_done(
        2, direction="in", nbytes=GiB, seconds=0.1, resident=15 * GiB, swapped=5 * GiB, prefetch=2
    )
    assert not a.sessions[2].prefetch.active and a.sessions[2].used == 15 * GiB


def test_an_ack_of_a_prefetch_never_asked_is_refused_and_changes_nothing(clock):
    a = three_of_30_on_80(clock)
    before = (
        a.sessions[2].memory.resident,
        a.sessions[2].memory.swapped,
        a.sessions[2].totals.swap_ins,
    )
    with pytest.raises(ArbiterError, match="no prefetch 3"):
        a.swap_done(
            2, direction="in", nbytes=GiB, seconds=0.1, resident=30 * GiB, swapped=0, prefetch=3
        )
    assert (
        a.sessions[2].memory.resident,
        a.sessions[2].memory.swapped,
        a.sessions[2].totals.swap_ins,
    ) == before


def test_no_prefetch_for_clients_that_cannot_or_when_turned_off(clock):
    for kw, cap in (({}, False), ({"prefetch": False}, True)):
        c = ManualClock()
        a = arb(c, capacity=40 * GiB, tq_s=5, **kw)
        a.attach(1, AttachRecord(name="A", memory_limit=20 * GiB))
        a.attach(2, AttachRecord(name="B", memory_limit=20 * GiB, swapped=20 * GiB, prefetch=cap))
        a.acquire(1)
        assert actions_of(a.acquire(2), PrefetchAction) == []


def test_sessions_expected_back_soon_are_not_evicted_for_a_prefetch(clock):
    a = arb(clock, capacity=40 * GiB, tq_s=30)
    a.attach(1, AttachRecord(name="A", memory_limit=20 * GiB))
    a.attach(2, AttachRecord(name="B", memory_limit=20 * GiB, swapped=20 * GiB, prefetch=True))
    a.attach(3, AttachRecord(name="cells", memory_limit=20 * GiB))
    a.acquire(3)  # a notebook: asks about every second
    for _ in range(3):
        a.report(3, resident=20 * GiB, swapped=0)
        clock.advance(0.1)
        a.release(3, resident=20 * GiB, swapped=0)
        clock.advance(1.0)
        a.acquire(3)
    clock.advance(0.1)
    a.release(3, resident=20 * GiB, swapped=0)
    a.acquire(1)
    out = a.acquire(2)
    assert actions_of(out, SwapOutAction) == [] and actions_of(out, PrefetchAction) == []
    clock.advance(3.0)  # it stayed away twice its usual gap: now it may go
    assert actions_of(a.tick(), SwapOutAction) == [SwapOutAction(3, 20 * GiB)]


# --- quanta pay back what was held past them -------------------------------------------------


def test_gpu_time_held_past_a_quantum_comes_off_the_next(clock):
    a = arb(clock, tq_s=1)
    a.attach(1, AttachRecord(name="a", memory_limit=GiB))
    a.attach(2, AttachRecord(name="b", memory_limit=GiB))
    a.acquire(1)
    a.acquire(2)
    clock.advance(1.0)
    a.tick()  # revoke; it reaches its safe point 0.2 s later
    clock.advance(0.2)
    a.release(1, resident=GiB, swapped=0, again=True)
    assert a.sessions[1].share.debt == pytest.approx(0.2)
    clock.advance(1.0)
    a.tick()
    (g,) = actions_of(a.release(2, resident=GiB, swapped=0, again=True), GrantAction)
    assert g.session == 1 and g.quantum_s == pytest.approx(0.8)
    assert a.sessions[1].share.debt == 0
    # a debt is paid at most three quarters of a quantum at a time
    a.sessions[2].share.debt = 0.9
    clock.advance(0.8)
    a.tick()
    (g,) = actions_of(a.release(1, resident=GiB, swapped=0, again=True), GrantAction)
    assert g.quantum_s == pytest.approx(1 - PAYBACK) and a.sessions[2].share.debt == pytest.approx(
        0.15
    )


def test_what_a_quantum_cannot_pay_back_is_owed_to_those_waiting(clock):
    """A holder late to its safe point by more than its next quantum can pay back (a
    lighter session's short quantum): the rest is credit to those who waited, by their
    weights, added to their next quanta (at most one quantum more each time)."""
    a = arb(clock, tq_s=0.9, policy="weighted")
    a.attach(1, AttachRecord(name="light", memory_limit=GiB, weight=1.0))
    a.attach(2, AttachRecord(name="heavy", memory_limit=GiB, weight=9.0))
    a.attach(3, AttachRecord(name="middle", memory_limit=GiB, weight=3.0))
    a.acquire(1)  # quanta: light 0.1, heavy 0.9, middle 0.3
    a.acquire(2)
    clock.advance(0.1)
    a.tick()
    clock.advance(0.2)  # 0.2 s past its quantum: 0.075 is its next quantum's to pay
    (g,) = actions_of(a.release(1, resident=GiB, swapped=0, again=True), GrantAction)
    assert a.sessions[1].share.debt == pytest.approx(0.1 * PAYBACK)
    # the rest, 0.125 of the light's GPU time, is owed nine times over to the heavy
    assert g.session == 2 and g.quantum_s == pytest.approx(0.9 + 0.9)  # one quantum more
    assert a.sessions[2].share.debt == pytest.approx(-(9 * 0.125 - 0.9))
    a.acquire(3)  # it was not waiting then: none of it is its
    clock.advance(1.8)
    a.tick()
    (g,) = actions_of(a.release(2, resident=GiB, swapped=0, again=True), GrantAction)
    assert g.session == 1 and g.quantum_s == pytest.approx(0.1 * (1 - PAYBACK))
    clock.advance(0.025)
    a.tick()
    (g,) = actions_of(a.release(1, resident=GiB, swapped=0, again=True), GrantAction)
    assert g.session == 3 and g.quantum_s == pytest.approx(0.3)
    # credit is not banked while idle; a debt stays
    a.release(3, resident=GiB, swapped=0)
    a.sessions[2].share.debt = -0.5
    clock.advance(0.9)
    a.tick()
    a.release(2, resident=GiB, swapped=0)
    assert a.sessions[2].share.debt == 0


@settings(
    max_examples=examples(30, dev=4), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    sessions=st.lists(
        st.tuples(
            st.sampled_from([1.0, 3.0, 9.0]),  # weight
            st.floats(0.0, 0.1),  # time to its safe point, in its shortest quantum
            st.booleans(),  # fills: a current client, or an older one (swaps, then releases)
            st.booleans(),  # prefetch
        ),
        min_size=2,
        max_size=4,
    ),
    limit_gib=st.sampled_from([20, 50]),  # all fit; or every switch swaps
    tq=st.floats(0.5, 2.0),
)
def test_shares_match_the_weights_over_windows_swapping_included(sessions, limit_gib, tq):
    """Policy weighted, batch jobs: over windows of many quanta, each session's GPU time
    (held, its memory back) is its weight's share of the GPU time given, within about one
    quantum of each session per window (the window's ends cut one). Holders reach their
    safe points within a tenth of the shortest quantum (docs/scheduling.md, 4)."""
    m = Model(80 * GiB, GpuSettings(tq_s=tq, mode="exclusive", policy="weighted"))
    top = max(w for w, *_ in sessions)
    for i, (w, late, fills, pf) in enumerate(sessions, start=1):
        delay = late * tq * min(w for w, *_ in sessions) / top
        m.add(Client(i, limit_gib * GiB, w, yield_delay=delay, fills=fills, prefetch=pf), 0.01 * i)
    # 5 windows of at least 60 rounds each (a round: every session's quantum and switch)
    switch = 2 * limit_gib * GiB / 55e9 + 0.01
    n, weights = len(sessions), [w for w, *_ in sessions]
    round_s = tq * sum(weights) / top + n * switch
    m.run(round_s)  # the first round is not measured
    t0 = m.clock.monotonic()
    m.run(5 * 60 * round_s)
    span = (m.clock.monotonic() - t0) / 5
    for k in range(6):
        a, b = (t0, t0 + 5 * span) if k == 5 else (t0 + k * span, t0 + (k + 1) * span)
        work = [m.work(i, a, b) for i in range(1, n + 1)]
        quanta = min(sum(1 for x, y in m.clients[i].work if a <= x < b) for i in range(1, n + 1))
        assert quanta >= 60
        for i in range(n):
            want = weights[i] / sum(weights)
            err = abs(work[i] / sum(work) / want - 1)
            assert err <= 2.5 / quanta, (k, i, err, quanta, work)


@pytest.mark.parametrize("weight", [1.0, 3.0, 9.0])
def test_shares_stay_within_their_window_bound_when_safe_points_are_late(weight):
    """Policy weighted, two batch jobs swapping at every switch, each late to its safe
    point by half to 1.2 times the lighter quantum (a step longer than a short quantum):
    over every window, the ratio of their GPU times is within the bound of
    docs/scheduling.md, 4: (1 + 2 L / q) / k, with L the most a holder is late, q the
    lighter quantum and k the lighter session's whole quanta in the window; and so is the
    whole run. (A debt paid back at most half a quantum at a time, and forgiven beyond one,
    left the ratio 26% under the weights at 1:3 and 1:9, the lighter session keeping what
    it could not pay back, and a window at 1:1 6% off.)"""
    tq, late = 0.5, (0.5, 1.2)
    q = tq / weight
    rng = random.Random(int(weight))
    m = Model(80 * GiB, GpuSettings(tq_s=tq, mode="exclusive", policy="weighted"))
    for sid, w in ((1, 1.0), (2, weight)):
        delays = iter(lambda: rng.uniform(*late) * q, None)
        m.add(Client(sid, 50 * GiB, w, fills=True, prefetch=True, delays=delays), 0.01 * sid)
    bound = 1 + 2 * late[1]
    m.run(5.0)
    t0 = m.clock.monotonic()
    while sum(1 for x, _ in m.clients[1].work if x >= t0) < 6 * 64:  # 6 windows of 60 rounds
        m.run(10.0)
    t1 = m.clock.monotonic()
    span = (t1 - t0) / 6
    windows = [(t0 + i * span / 10, t0 + i * span / 10 + span) for i in range(51)]
    for a, b in [*windows, (t0, t1)]:
        light, heavy = m.work(1, a, b), m.work(2, a, b)
        k = sum(1 for x, y in m.clients[1].work if a <= x and y <= b)
        assert k >= 60
        err = abs(heavy / light / weight - 1)
        assert err <= bound / k, (a - t0, err, bound / k, k)


# --- mode auto: a holder joining may not take a filling holder's room -------------------------


def test_a_joining_holder_leaves_a_filling_holder_its_room(clock):
    """Regression: in mode auto a session joined the holders into the memory a filling
    holder's room was to grow into; frozen, it could never give it back, the filling
    holder's quantum never started, and the queue waited forever."""
    a = Arbiter(0, 45 * GiB, clock, GpuSettings(tq_s=1, mode="auto", escalation="freeze"))
    a.attach(1, AttachRecord(name="idle", memory_limit=20 * GiB, resident=20 * GiB))
    a.attach(2, AttachRecord(name="filling", memory_limit=30 * GiB, swapped=30 * GiB, fills=True))
    a.attach(3, AttachRecord(name="joins", memory_limit=15 * GiB))
    (g,) = actions_of(a.acquire(2), GrantAction)
    assert g.room == 25 * GiB  # beside idle's 20; more as idle's memory goes
    out = a.acquire(3)  # 30 + 15 fit together by their limits
    assert actions_of(out, GrantAction) == []
    a.report(1, resident=5 * GiB, swapped=15 * GiB)  # 15 of idle's 20 have gone
    assert a.holders == [2]  # 3 may not take what the room grows into
    assert a.sessions[2].memory.room == 0  # the room grew to its limit instead
    out = a.report(1, resident=0, swapped=20 * GiB)
    assert [g.session for g in actions_of(out, GrantAction)] == [3]  # then 3 joins


def test_a_servers_grants_end_its_implicit_bursts_soon_after_a_request(clock):
    """A session that asks often and briefly after idle gaps is taken for a server once
    it has a history: its grants say a short idle release (its requests do not keep the
    GPU for the node's default after each); a batch job's never do."""
    from gpushare.core.turns import SERVER_BURSTS, SERVER_IDLE_S

    a = arb(clock, tq_s=30, mode="exclusive")
    a.attach(2, AttachRecord(name="server", memory_limit=10 * GiB))
    idles = []
    for _ in range(SERVER_BURSTS + 2):
        (g,) = actions_of(a.acquire(2), GrantAction)
        idles.append(g.idle_release_s)
        clock.advance(0.15)
        a.release(2, resident=0, swapped=0)
        clock.advance(1.5)  # the think time between requests
        a.tick()
    assert idles[0] == 0.0 and idles[SERVER_BURSTS - 1] == 0.0  # no history yet
    assert idles[-1] == SERVER_IDLE_S
    a.attach(1, AttachRecord(name="batch", memory_limit=10 * GiB))
    for _ in range(SERVER_BURSTS + 2):  # one long burst after another, no gaps: no server
        (g,) = actions_of(a.acquire(1), GrantAction)
        assert g.idle_release_s == 0.0
        clock.advance(20)
        a.release(1, resident=0, swapped=0)
        clock.advance(0.01)
        a.tick()

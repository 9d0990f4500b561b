"""Interactive turns for a server at a light load (docs/scheduling.md 3, issue 28): a
session taken for a server by its history is not sent behind a quantum when its credit
falls short, whatever its measured use says."""

from __future__ import annotations

import random

import pytest

from gpushare.core.actions import GrantAction, RevokeAction, SwapOutAction
from gpushare.core.arbiter import Arbiter, FieldError
from gpushare.core.attach import AttachRecord
from gpushare.core.turns import SERVER_BURSTS, SERVER_IDLE_S
from gpushare.settings import GpuSettings
from tests.core.model import Client, GiB, Model, actions_of


def light_server(clock, credit):
    """Batch job 1 holding at TQ 30; server 2 with SERVER_BURSTS bursts of 0.67 s (the
    client's idle release after 0.17 s of work) and gaps of about a second behind it, its
    measured use below the notebook's rate (so earned at that rate); ``credit`` left."""
    a = Arbiter(0, 80 * GiB, clock, GpuSettings(tq_s=30, mode="exclusive", turn_s=1.0))
    a.attach(1, AttachRecord(name="batch", memory_limit=GiB))
    a.attach(2, AttachRecord(name="server", memory_limit=GiB))
    a.acquire(1)
    s = a.sessions[2]
    sh = s.share
    sh.bursts.extend([0.67] * SERVER_BURSTS)
    sh.use_s, sh.use_span, sh.use_at = 7.8, 60.0, clock.monotonic()  # 0.13 of the time
    sh.credit, sh.windowless, sh.gap_ewma = credit, True, 1.0
    s.totals.bursts = SERVER_BURSTS
    s.lease.idle_since = clock.monotonic()
    assert a.turns.requests(s) and not a.turns.serves(s)  # a server by its history only
    return a, s


def test_a_server_below_the_notebook_rate_overdraws_as_any_server(clock):
    """Issue 28: at 0.5 requests a second its measured use put it a hair below the
    notebook's rate (no swap-in to count, its cache dropped); a request that found its
    credit short of its usual burst had no overdraft and waited for the batch job's
    whole quantum (p50 5.6 s, p99 9.4 s)."""
    a, s = light_server(clock, credit=0.33)
    clock.advance(0.95)
    out = a.acquire(2)  # 0.33 + 0.25 x 0.95 = 0.57 s of credit for a usual 0.67
    (r,) = actions_of(out, RevokeAction)
    assert r.session == 1 and s.share.turn
    (g,) = actions_of(a.release(1, resident=GiB, swapped=0, again=True), GrantAction)
    assert g.session == 2 and g.quantum_s == pytest.approx(1.0)  # 0.57 + 0.5, at most turn
    assert g.idle_release_s == SERVER_IDLE_S  # and its implicit burst ends soon after


def test_a_server_below_the_notebook_rate_short_of_credit_waits_seconds_not_a_quantum(clock):
    """Its overdraft spent too: it waits, earning the fraction its rate gives of each
    second waited, and takes its turn once that covers its usual burst."""
    a, s = light_server(clock, credit=-0.6)
    clock.advance(0.2)
    out = a.acquire(2)
    assert not actions_of(out, RevokeAction) and not s.share.turn  # short: it waits
    due = a.next_deadline()
    r = a.turns.rate(s)
    need = 0.67 - 0.5 - (-0.6 + r * 0.2)
    assert due == pytest.approx(clock.monotonic() + need / r)  # ~1 s, not 30
    clock.set(due)
    (rv,) = actions_of(a.tick(), RevokeAction)
    assert rv.session == 1 and s.share.turn and a.queue[0] == 2


def test_a_notebook_is_still_sent_to_the_queue_when_its_cell_outgrows_its_credit(clock):
    """A session not taken for a server (one burst known) gets no overdraft, and is not
    looked at again: its cell waits in line (the notebook's rule, unchanged)."""
    a, s = light_server(clock, credit=0.0)
    s.share.bursts.clear()
    s.share.bursts.append(0.67)
    assert not a.turns.requests(s)
    clock.advance(0.95)
    out = a.acquire(2)
    assert not actions_of(out, RevokeAction) and not s.share.turn
    assert a.turns.deadlines() == [] and list(a.queue) == [2]


class ImplicitModel(Model):
    """The model, its server's bursts implicit as under ``gpushare run``: the first (its
    memory made, ``with s.gpu()``) ends with its work; the others the client's idle
    release after the last request, 0.5 s, or what the grant says."""

    def _on_grant(self, c, a):
        if c.kind == "server":
            c.tail_s = (a.idle_release_s or 0.5) if c.grant_times else 0.0
        super()._on_grant(c, a)


@pytest.mark.parametrize("bandwidth", [55e9, 5e12])  # swapped, or (nearly) free: dropped
def test_a_light_servers_requests_beside_a_trainer_are_all_turns(bandwidth):
    """benchmarks/inference.py --implicit on the model: a server of 20 GiB (requests of
    0.17 s at 0.5 a second) beside a trainer of 64 GiB on 80 GiB, TQ 30. With a swap-in
    that costs (nearly) nothing, as a cache dropped rather than swapped, the server's
    measured use fell below the notebook's rate: from its third request it waited for
    the trainer's quantum. Every request is a turn, answered within half a second."""
    m = ImplicitModel(
        80 * GiB, GpuSettings(tq_s=30, mode="exclusive", turn_s=1.0), bandwidth=bandwidth
    )
    rng = random.Random(500)
    gaps = [(rng.expovariate(0.5), 0.17) for _ in range(60)]
    srv = Client(2, 20 * GiB, kind="server", fills=True, prefetch=True, tail_s=0.0)
    srv.arrivals = iter([(0.05, 0.05), (1.0 + gaps[0][0], 0.17), *gaps[1:]])
    m.add(srv)
    m.run(0.3)
    m.add(Client(1, 64 * GiB, fills=True, prefetch=True))
    m.run(60.0)
    waits = [lat for _, lat in srv.latencies[1:]]  # (the first: its memory, alone)
    assert len(waits) >= 20
    assert max(waits) <= 0.17 + 0.5, sorted(waits)[-5:]
    turns = [e for e in m.events if e["event"] == "grant" and e["session"] == 2]
    assert all(e.get("turn") for e in turns[1:]), [e for e in turns if not e.get("turn")]


def bursts_then_grant(a, clock, sid, bursts):
    """``sid`` alone works ``bursts`` (seconds each), idle 2 s after each: its next grant."""
    for seconds in bursts:
        a.acquire(sid)
        clock.advance(seconds)
        a.release(sid, resident=0, swapped=0)
        clock.advance(2.0)
        a.tick()
    (g,) = actions_of(a.acquire(sid), GrantAction)
    return g


@pytest.mark.parametrize(
    ("bursts", "short"),
    [
        ([0.05, 0.67], True),  # its memory made, one request (held 0.5 s idle after it)
        ([0.05], False),  # one burst: nothing says it asks briefly
        ([0.05, 20.0], False),  # a training loop's memory, then its loop
        ([0.05, 0.2, 20.0], True),  # two of three short
        ([0.05, 0.2, 20.0, 20.0], False),  # half: not a majority (a lower median: short)
    ],
)
def test_a_server_is_taken_for_one_from_its_second_short_burst(clock, bursts, short):
    """The short idle release from two bursts seen, when both are short: its second
    request's turn ends 0.05 s after the request, not 0.5 s (the trainer's time). A
    strict majority of short bursts, so a training loop's long burst after its short
    first is never taken for a request's."""
    a = Arbiter(0, 80 * GiB, clock, GpuSettings(tq_s=30, mode="exclusive", turn_s=1.0))
    a.attach(2, AttachRecord(name="s", memory_limit=GiB))
    g = bursts_then_grant(a, clock, 2, bursts)
    assert (g.idle_release_s == SERVER_IDLE_S) is short


@pytest.mark.parametrize("grows", [False, True])
def test_in_mode_auto_a_server_whose_bound_is_above_its_request_takes_its_turn(clock, grows):
    """Issue 38: mode auto, a batch job holding 40 GiB (request = limit) at TQ 30 and a
    server asking 1 GiB with a 79 GiB limit (counted at its limit, or at the 45 GiB it
    has: its bound). Admission.joins() counted it at its request (it 'would join'), so
    it took no turn, while the grant counted it at its bound (it did not fit): it waited
    the batch job's whole quantum. Now it takes its turn, as in mode exclusive."""
    a = Arbiter(0, 80 * GiB, clock, GpuSettings(tq_s=30, mode="auto", turn_s=1.0))
    a.attach(2, AttachRecord(name="server", memory_limit=79 * GiB, memory_request=GiB, grows=grows))
    if grows:  # what it has: 45 GiB, swapped out now
        a.sessions[2].memory.swapped = 45 * GiB
        a.st.ledger.recount(a.sessions[2])
    a.attach(1, AttachRecord(name="batch", memory_limit=40 * GiB))
    a.acquire(1)
    s = a.sessions[2]
    sh = s.share
    sh.bursts.extend([0.67] * SERVER_BURSTS)
    sh.use_s, sh.use_span, sh.use_at = 7.8, 60.0, clock.monotonic()
    sh.credit, sh.windowless, sh.gap_ewma = 1.0, True, 1.0
    s.totals.bursts = SERVER_BURSTS
    s.lease.idle_since = clock.monotonic()
    clock.advance(0.95)
    out = a.acquire(2)
    (r,) = actions_of(out, RevokeAction)
    assert r.session == 1 and s.share.turn  # its turn, not the rest of a 30 s quantum
    out = a.release(1, resident=40 * GiB, swapped=0, again=True)
    (so,) = actions_of(out, SwapOutAction)  # room for the server's bound, then its grant
    left = 40 * GiB - so.bytes
    out = a.swap_done(1, direction="out", nbytes=so.bytes, seconds=0.1, resident=left,
                      swapped=so.bytes)  # fmt: skip
    assert [g.session for g in actions_of(out, GrantAction)] == [2]
    a.verify()


FAMILY = "session:2@uid:1000"


def test_a_server_of_several_processes_takes_turns_as_one_process_does(clock):
    """Issue 40: a family (vLLM's engine and worker processes, one lease) was a gang, and
    gangs never took turns: each request waited the trainer's whole quantum. A family on
    one node is one holder, so it takes its turn as a single process does, paid from the
    session's credit, within its share."""
    a, s = light_server(clock, credit=0.8)
    a.attach(
        3,
        AttachRecord(
            name="worker", memory_limit=GiB // 2, gang=FAMILY, family=2, joins_family=True
        ),
    )
    assert s.rank.gang == FAMILY  # the server joined its family's gang
    clock.advance(0.95)
    out = a.acquire(2)
    (r,) = actions_of(out, RevokeAction)
    assert r.session == 1 and s.share.turn
    (g,) = actions_of(a.release(1, resident=GiB, swapped=0, again=True), GrantAction)
    assert g.session == 2 and g.quantum_s <= 1.0  # a turn, not a 30 s quantum
    (w,) = actions_of(a.acquire(3), GrantAction)  # its worker joins the turn, as one holder
    assert w.session == 3 and w.quantum_s == g.quantum_s
    clock.advance(g.quantum_s + 0.2)
    assert {r.session for r in actions_of(a.tick(), RevokeAction)} == {2, 3}  # both, at its end


@pytest.mark.parametrize("start_s", [0.05, 5.0])
def test_a_servers_first_request_after_a_long_start_is_a_turn(clock, start_s):
    """Issue 40: a server that loaded its model alone (a start burst of seconds, which
    did not wait) had that load for its usual burst: its first request, beside a batch
    job holding at TQ 30, was refused a turn (its credit short of 5 s, no history of a
    server's) and waited the whole quantum (19.6-25.9 s). Its start counts at most a
    turn: the request takes its first turn, bounded by the credit it attached with."""
    a = Arbiter(0, 80 * GiB, clock, GpuSettings(tq_s=30, mode="exclusive", turn_s=1.0))
    a.attach(2, AttachRecord(name="server", memory_limit=GiB))
    a.acquire(2)
    clock.advance(start_s)
    a.release(2, resident=GiB, swapped=0)
    a.attach(1, AttachRecord(name="batch", memory_limit=GiB))
    a.acquire(1)
    clock.advance(2.0)
    a.tick()  # (the server's window closed: the batch job holds)
    assert list(a.holders) == [1]
    (r,) = actions_of(a.acquire(2), RevokeAction)
    assert r.session == 1 and a.sessions[2].share.turn
    (g,) = actions_of(a.release(1, resident=GiB, swapped=0, again=True), GrantAction)
    assert g.session == 2 and g.quantum_s <= 1.0  # a turn, bounded: its credit
    clock.advance(g.quantum_s + 0.01)  # its request outlasts the turn: back to the batch job
    a.tick()
    a.release(2, resident=GiB, swapped=0, again=True)
    assert 1 in a.holders
    a.verify()


def test_an_implicit_bursts_idle_release_is_not_counted_in_its_burst(clock):
    """A server's implicit bursts (0.17 s of work, the client's 0.5 s idle release after)
    looked 0.67 s long; at 2 requests a second one often came within the release and its
    bursts merged past a turn: never taken for a server, each burst held the GPU idle
    0.5 s more. Its release says how long it idled; the node counts it up to the idle
    release its grant told, and no more than the lease held."""
    a = Arbiter(0, 80 * GiB, clock, GpuSettings(tq_s=30, mode="exclusive", turn_s=1.0))
    a.attach(2, AttachRecord(name="server", memory_limit=GiB))
    told = []
    for idle_s in (0.5, 0.5, 9.0):  # (the last: more than it was told, believed up to it)
        (g,) = actions_of(a.acquire(2), GrantAction)
        told.append(g.idle_release_s or 0.5)
        clock.advance(0.17 + told[-1])
        a.release(2, resident=GiB, swapped=0, idle_s=idle_s)
        clock.advance(2.0)
        a.tick()
    assert told == [0.5, 0.5, SERVER_IDLE_S]  # a server from its second short burst
    s = a.sessions[2]
    assert list(s.share.bursts) == pytest.approx([0.17, 0.17, 0.17])


@pytest.mark.parametrize("idle_s", [-0.1, float("nan")])
def test_a_release_with_a_bad_idle_is_refused_and_changes_nothing(clock, idle_s):
    a = Arbiter(0, 80 * GiB, clock, GpuSettings(tq_s=30, mode="exclusive", turn_s=1.0))
    a.attach(2, AttachRecord(name="server", memory_limit=GiB))
    a.acquire(2)
    clock.advance(0.3)
    with pytest.raises(FieldError, match="idle_s"):
        a.release(2, resident=GiB, swapped=0, idle_s=idle_s)
    with pytest.raises(FieldError, match="idle_s"):
        a.release(2, resident=GiB, swapped=0, again=True, idle_s=0.1)
    assert a.sessions[2].holding and not a.sessions[2].share.bursts
    a.verify()


def test_a_server_whose_turn_ends_with_a_backlog_waits_for_a_turn_not_a_quantum(clock):
    """Issue 40: past its share (a backlog), a server's turn ran out mid-burst and it was
    sent to the back of the queue: behind the batch job's whole quantum (at TQ 5, p99
    24.7 s). It waits as a refused server does, earning at its rate, until it has earned
    a whole turn (what queued meanwhile served together), then goes first."""
    a, s = light_server(clock, credit=0.5)
    clock.advance(1.0)
    (r,) = actions_of(a.acquire(2), RevokeAction)
    (g,) = actions_of(a.release(1, resident=GiB, swapped=0, again=True), GrantAction)
    assert g.session == 2
    rv = []
    while not rv:  # its turn (renewed while its credit lasts) is up, the batch job waits
        clock.advance(0.05)
        rv = actions_of(a.tick(), RevokeAction)
    assert [x.session for x in rv] == [2]
    out = a.release(2, resident=GiB, swapped=0, again=True)  # requests still queued
    assert [x.session for x in actions_of(out, GrantAction)] == [1]
    due = a.next_deadline()
    r = a.turns.rate(s)
    need = 1.0 - a.turns.overdraft(s) - s.share.credit  # a whole turn, earned at r
    assert due == pytest.approx(clock.monotonic() + need / r)
    assert due - clock.monotonic() < 5.0  # seconds, not the batch job's 30 s quantum
    clock.set(due)
    (rv,) = actions_of(a.tick(), RevokeAction)
    assert rv.session == 1 and s.share.turn and a.queue[0] == 2
    (g,) = actions_of(a.release(1, resident=GiB, swapped=0, again=True), GrantAction)
    assert g.session == 2 and g.quantum_s == pytest.approx(1.0)  # a whole turn
    a.verify()


@pytest.mark.parametrize("tq", [30, 5])
def test_a_session_that_ends_each_burst_at_its_revoke_gets_no_more_than_its_share(tq):
    """Found by an attack on issue 40's rules: two short bursts (taken for a server),
    then always busy, ending its burst at each revoke and asking again 60 ms later: turns
    inside the batch job's quantum, then its own whole quantum besides. A turn's GPU time
    is taken off its next quantum from the queue: its share, no more."""
    m = Model(80 * GiB, GpuSettings(tq_s=tq, mode="exclusive", turn_s=1.0))
    att = m.add(
        Client(2, 20 * GiB, kind="bursty", burst_s=0.1, think_s=1.0, fills=True, prefetch=True)
    )
    m.run(2.5)
    att.burst_s, att.think_s = 1e9, 0.06  # (the model's bursty client: again=False on a revoke)
    m.add(Client(1, 40 * GiB, fills=True, prefetch=True))
    t0 = m.clock.monotonic()
    m.run(300.0)
    t1 = m.clock.monotonic()
    # 0.645 (TQ 30) and 0.633 (TQ 5) before a turn's time came off its next quantum
    assert m.work(2, t0, t1) / (t1 - t0) <= 0.55


def test_a_training_loops_first_turn_does_not_chain_turns_through_the_batch_quantum():
    """Found by an attack on issue 40's rules: a trainer's start (5 s alone), 2 s on the
    CPU, then its loop. Its start counts at a turn, so its loop's first ask is a turn;
    by its measured use a server, each turn's end chained the next (53 turns in 300 s,
    each a 20 GiB switch each way, the batch job at 0.337). A training loop's burst
    never ends: one turn is chained at most before a burst has ended after its start."""
    m = Model(80 * GiB, GpuSettings(tq_s=30, mode="exclusive", turn_s=1.0))
    tr = m.add(
        Client(2, 50 * GiB, kind="bursty", burst_s=5.0, think_s=2.0, fills=True, prefetch=True)
    )
    m.run(5.5)
    tr.kind = "batch"  # its loop: one burst, yielding at each revoke
    m.add(Client(1, 50 * GiB, fills=True, prefetch=True))
    t0 = m.clock.monotonic()
    m.run(300.0)
    t1 = m.clock.monotonic()
    turns = [e for e in m.events if e["event"] == "grant" and e["session"] == 2 and e.get("turn")]
    assert len(turns) <= 2, len(turns)
    assert m.work(1, t0, t1) / (t1 - t0) >= 0.45


def test_a_refused_entry_does_not_outlive_its_wait(clock):
    """Found by an attack on issue 40's rules: a server refused (credit short), then
    granted from the queue, not as a turn, kept its refused entry (the grant comes after
    reconsider in the same decision); held 10 s, it yielded and asked again, and the old
    entry credited those 10 s held as waited. A grant drops the entry."""
    a, s = light_server(clock, credit=-0.6)
    clock.advance(0.2)
    a.acquire(2)  # refused: waits in the queue, an entry in turns.refused
    assert 2 in a.turns.refused
    a.release(1, resident=GiB, swapped=0)  # the batch job's burst ends (its window)
    clock.advance(0.6)
    out = a.tick()  # its window closed: the queue's head is granted (the entry not due)
    assert [g.session for g in actions_of(out, GrantAction)] == [2] and not s.share.turn
    credit = s.share.credit
    clock.advance(10.0)  # it holds 10 s: no credit is earned holding
    a.release(2, resident=GiB, swapped=0, again=True)  # a yield, asking again
    assert s.share.credit <= credit + 1e-9, (credit, s.share.credit)


def test_a_servers_turns_owe_its_quanta_at_most_one_quantum(clock):
    """A turn's time comes off its next quantum from the queue, up to one quantum: a
    server's many turns (here 150 of 0.3 s, 45 s at TQ 30) must not shorten its quanta
    for hours once it works as a batch job."""
    a, s = light_server(clock, credit=1.0)
    for _ in range(150):
        clock.advance(1.5)
        a.tick()
        out = a.acquire(2)
        if actions_of(out, RevokeAction):
            a.release(1, resident=GiB, swapped=0, again=True)
        assert s.holding and s.share.turn
        clock.advance(0.3)
        a.release(2, resident=GiB, swapped=0)
    assert s.totals.turns == 150
    assert 0 < s.share.debt <= a.shares.quantum(s)
    a.verify()

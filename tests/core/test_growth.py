"""Growth above a request takes only free memory or waits for the rotation of quanta,
never a neighbour's memory inside its quantum (issue 38 item 2, docs/scheduling.md 6)."""

from __future__ import annotations

from gpushare.core.actions import RevokeAction, SwapOutAction
from gpushare.core.arbiter import Arbiter
from gpushare.core.attach import AttachRecord
from gpushare.settings import GpuSettings
from tests.core.model import GiB, actions_of


def test_a_grower_does_not_take_a_neighbours_memory_inside_its_quantum(clock):
    a = Arbiter(0, 80 * GiB, clock, GpuSettings(mode="auto", tq_s=3.0))
    a.attach(1, AttachRecord(name="h", memory_limit=40 * GiB, memory_request=40 * GiB, grows=True))
    a.attach(2, AttachRecord(name="g", memory_limit=79 * GiB, memory_request=1 * GiB, grows=True))
    a.acquire(1)
    a.report(1, resident=38 * GiB, swapped=0)
    a.acquire(2)
    a.report(2, resident=1 * GiB, swapped=0)
    assert list(a.holders) == [1, 2]
    out = []
    for _ in range(9):  # H's 0.2 s bursts, G asking to grow at each boundary
        clock.advance(0.2)
        out += a.release(1, resident=38 * GiB, swapped=0)
        if 2 in a.holders:
            out += a.release(2, resident=1 * GiB, swapped=0, again=True, need=78 * GiB)
        clock.advance(0.1)  # past H's anticipation window
        out += a.tick()
        out += a.acquire(1)
        a.verify()
        # H (at its request) is never asked for its bytes inside its quantum (3 s), and
        # its next burst starts beside the waiting grower
        assert not [x for x in actions_of(out, SwapOutAction) if x.session == 1]
        assert 1 in a.holders and list(a.queue) == [2]
    # The rotation of quanta: H's quantum (3 s) is over; at its next burst end its bytes go.
    clock.advance(0.5)
    out = a.release(1, resident=38 * GiB, swapped=0)
    clock.advance(0.1)
    out += a.tick()
    assert [x.bytes for x in actions_of(out, SwapOutAction) if x.session == 1] == [36 * GiB]
    a.swap_done(
        1, direction="out", nbytes=36 * GiB, seconds=1.0, resident=2 * GiB, swapped=36 * GiB
    )
    assert 2 in a.holders and a.sessions[2].memory.held == 78 * GiB
    a.verify()


def _holder_and_grower(clock, **settings):
    """An 80 GiB GPU in mode auto."""
    a = Arbiter(0, 80 * GiB, clock, GpuSettings(mode="auto", **settings))
    return a


def _attach_pair(a, h_weight=1.0, g_weight=1.0):
    """H (request = limit = 40 GiB) and G (request 1 GiB, limit 79 GiB)."""
    a.attach(
        1,
        AttachRecord(
            name="h", memory_limit=40 * GiB, memory_request=40 * GiB, grows=True, weight=h_weight
        ),
    )
    a.attach(
        2,
        AttachRecord(
            name="g", memory_limit=79 * GiB, memory_request=1 * GiB, grows=True, weight=g_weight
        ),
    )


def _h_bursts_while_g_grows(a, clock, until):
    """H's 0.2 s bursts, G asking to grow at each boundary, until ``until``; the swap-outs
    of H asked meanwhile."""

    def g_asks():
        if 2 not in a.holders:
            return []
        return a.release(2, resident=1 * GiB, swapped=0, again=True, need=78 * GiB)

    return _h_bursts(a, clock, until, at_boundary=g_asks)


def test_a_grower_waits_for_a_shorter_quantum_of_its_neighbour_not_tq(clock):
    """Policy weighted: H's quantum is TQ/4 (weight 1 beside G's 4). G waits for the end
    of H's own quantum (0.75 s), not for TQ (3 s): before, each burst of H granted beside
    the waiting grower got a fresh quantum, and G waited a whole TQ."""
    a = _holder_and_grower(clock, tq_s=3.0, policy="weighted")
    _attach_pair(a, h_weight=1.0, g_weight=4.0)
    a.acquire(1)
    a.report(1, resident=38 * GiB, swapped=0)
    a.acquire(2)
    a.report(2, resident=1 * GiB, swapped=0)
    h_end = a.sessions[1].lease.quantum_end
    assert h_end == clock.monotonic() + 0.75
    # inside H's quantum: H keeps its bytes, its bursts continue its quantum
    assert _h_bursts_while_g_grows(a, clock, h_end) == []
    # H's quantum is over: at its next burst end its bytes go, long before G waited TQ
    clock.advance(h_end + 0.2 - clock.monotonic())
    out = a.release(1, resident=38 * GiB, swapped=0) if 1 in a.holders else []
    out += a.tick()
    assert [x.bytes for x in actions_of(out, SwapOutAction) if x.session == 1] == [36 * GiB]
    assert clock.monotonic() - a.sessions[2].lease.wait_start < 3.0
    a.verify()


def test_a_grower_waits_for_a_longer_quantum_of_its_neighbour_not_tq(clock):
    """H's quantum is longer than TQ (credit owed it while a late holder kept the GPU:
    docs/scheduling.md 4). G, growing, does not take H's bytes when it has waited TQ, but
    only once H's own quantum is over (before: at TQ, inside H's quantum)."""
    a = _holder_and_grower(clock, tq_s=3.0, grace_s=10.0)
    _attach_pair(a)
    a.attach(3, AttachRecord(name="x", memory_limit=42 * GiB, memory_request=42 * GiB))
    a.acquire(3)
    a.acquire(1)  # 42 + 40 GiB do not fit: H waits behind X
    assert list(a.holders) == [3] and list(a.queue) == [1]
    clock.advance(3.0)
    a.tick()  # X's quantum is over: revoked; it answers 6 s late
    clock.advance(6.0)
    a.release(3, resident=0, swapped=0, again=True)
    a.detach(3)
    assert 1 in a.holders
    h = a.sessions[1].lease
    assert h.quantum_len > 3.0  # what X owed it: H's quantum is longer than TQ
    a.report(1, resident=38 * GiB, swapped=0)
    a.acquire(2)
    a.report(2, resident=1 * GiB, swapped=0)
    assert list(a.holders) == [1, 2]
    assert _h_bursts_while_g_grows(a, clock, h.quantum_end) == []
    assert clock.monotonic() - a.sessions[2].lease.wait_start > 3.0  # G waited past TQ
    a.verify()


def test_a_grower_is_looked_at_again_when_an_idle_neighbours_quantum_ends(clock):
    """H ends a burst inside its quantum and sends nothing more: the node has no input to
    act on, so the end of H's quantum is a deadline, and G's plan is made then (before:
    no deadline, G waited for the next input, however late)."""
    a = Arbiter(0, 80 * GiB, clock, GpuSettings(mode="auto", tq_s=3.0))
    _attach_pair(a)
    a.acquire(1)
    a.report(1, resident=38 * GiB, swapped=0)
    a.acquire(2)
    a.report(2, resident=1 * GiB, swapped=0)
    h_end = a.sessions[1].lease.quantum_end
    clock.advance(0.2)
    a.release(1, resident=38 * GiB, swapped=0)
    out = a.release(2, resident=1 * GiB, swapped=0, again=True, need=78 * GiB)
    clock.advance(1.0)
    out += a.tick()
    assert not [x for x in actions_of(out, SwapOutAction) if x.session == 1]
    assert list(a.queue) == [2] and a.next_deadline() == h_end
    clock.advance(h_end - clock.monotonic())
    out = a.tick()
    # G's 78 GiB beside H's 2 GiB left
    assert [x.bytes for x in actions_of(out, SwapOutAction) if x.session == 1] == [36 * GiB]
    a.verify()


def _g_grown_then_h(clock, prefetch=False, turn_s=0.0):
    """G grew to 78 GiB alone (request 1 GiB); H (request = limit = 40 GiB) came, took
    38 GiB of G's (G above its request: its bytes go first), and holds at 38 GiB; G asks
    again, at what it has (40 GiB on the GPU, 38 GiB swapped): growth above its request
    again, with no ``need``."""
    a = Arbiter(0, 80 * GiB, clock, GpuSettings(mode="auto", tq_s=3.0, turn_s=turn_s))
    a.attach(2, AttachRecord(name="g", memory_limit=79 * GiB, memory_request=1 * GiB,
                             grows=True, prefetch=prefetch))  # fmt: skip
    a.acquire(2)
    a.report(2, resident=1 * GiB, swapped=0)
    a.release(2, resident=1 * GiB, swapped=0, again=True, need=78 * GiB)
    a.report(2, resident=78 * GiB, swapped=0)
    clock.advance(0.2)
    a.release(2, resident=78 * GiB, swapped=0)
    clock.advance(1.0)
    a.tick()
    a.attach(1, AttachRecord(name="h", memory_limit=40 * GiB, memory_request=40 * GiB, grows=True))
    a.acquire(1)
    a.swap_done(
        2, direction="out", nbytes=38 * GiB, seconds=1.0, resident=40 * GiB, swapped=38 * GiB
    )
    a.report(1, resident=38 * GiB, swapped=0)
    assert list(a.holders) == [1]
    a.acquire(2)
    return a


def _h_bursts(a, clock, until, at_boundary=list):
    """H's 0.2 s bursts until ``until``, ``at_boundary()``'s actions after each; the
    swap-outs of H asked meanwhile."""
    out = []
    while clock.monotonic() + 0.3 <= until:
        clock.advance(0.2)
        out += a.release(1, resident=38 * GiB, swapped=0)
        out += at_boundary()
        clock.advance(0.1)  # past H's anticipation window
        out += a.tick()
        if a.sessions[1].state.name == "IDLE":
            out += a.acquire(1)
        a.verify()
    return [x.bytes for x in actions_of(out, SwapOutAction) if x.session == 1]


def test_a_grower_back_at_what_it_has_waits_for_the_neighbours_quantum(clock):
    """Growth above a request without a ``need`` (G asks again at what it had grown to):
    the same rule, H keeps its bytes inside its quantum (before: swapped out at H's
    first burst end, G not taken for a grower)."""
    a = _g_grown_then_h(clock)
    h_end = a.sessions[1].lease.quantum_end
    assert list(a.queue) == [2]
    assert _h_bursts(a, clock, h_end) == []
    clock.advance(h_end + 0.2 - clock.monotonic())
    out = a.release(1, resident=38 * GiB, swapped=0) if 1 in a.holders else []
    out += a.tick()
    assert sum(x.bytes for x in actions_of(out, SwapOutAction) if x.session == 1) > 0
    a.verify()


def _x_holds_g_waits_h_idle(clock, prefetch, **settings):
    """While X holds, G (request 1 GiB, 35 GiB of what it had grown to swapped out)
    waits first in line, H (request = limit = 38 GiB) idle between bursts inside its
    quantum."""
    a = Arbiter(0, 80 * GiB, clock, GpuSettings(mode="auto", tq_s=3.0, turn_s=0.0, **settings))
    a.attach(2, AttachRecord(name="g", memory_limit=79 * GiB, memory_request=1 * GiB,
                             grows=True, prefetch=prefetch))  # fmt: skip
    a.attach(1, AttachRecord(name="h", memory_limit=38 * GiB, grows=True, weight=4.0))
    a.attach(3, AttachRecord(name="x", memory_limit=1 * GiB))  # weight 1
    a.acquire(2)
    a.release(2, resident=1 * GiB, swapped=0, again=True, need=76 * GiB)
    a.report(2, resident=76 * GiB, swapped=0)
    clock.advance(0.2)
    a.release(2, resident=76 * GiB, swapped=0)
    clock.advance(1.0)
    a.tick()
    a.acquire(1)  # G (idle, above its request) gives 34 GiB, then X's 1 GiB
    a.swap_done(2, direction="out", nbytes=34 * GiB, seconds=1.0, resident=42 * GiB,
                swapped=34 * GiB)  # fmt: skip
    a.report(1, resident=38 * GiB, swapped=0)
    a.acquire(3)
    a.swap_done(2, direction="out", nbytes=1 * GiB, seconds=0.1, resident=41 * GiB,
                swapped=35 * GiB)  # fmt: skip
    assert sorted(a.holders) == [1, 3]
    h_end = a.sessions[1].lease.quantum_end
    clock.advance(0.2)
    out = a.release(1, resident=38 * GiB, swapped=0)  # H's first burst ends
    clock.advance(0.1)  # past its window
    out += a.tick()
    out += a.acquire(2)  # G asks, at what it has: 76 GiB
    assert list(a.queue) == [2] and not a.sessions[1].expected_back(clock.monotonic())
    return a, h_end, out


def test_a_prefetch_for_a_grower_does_not_take_the_neighbours_memory(clock):
    """G's prefetch makes room only from what a grower may take, not from H inside its
    quantum (before: H was asked for 35 GiB for G's prefetch)."""
    a, h_end, out = _x_holds_g_waits_h_idle(clock, prefetch=True)
    clock.advance(0.1)
    out += a.tick()
    assert clock.monotonic() < h_end and a.sessions[2].prefetch.enabled
    assert not [x for x in actions_of(out, SwapOutAction) if x.session == 1]
    a.verify()


def test_a_revoke_planned_for_a_grower_does_not_take_the_neighbours_memory(clock):
    """Policy weighted: X's quantum (weight 1 of 4: 0.75 s) ends first; its revoke plans
    the swap-outs for G, first in line: not H's bytes, H inside its own quantum (before:
    H was asked for them with X's revoke)."""
    a, h_end, out = _x_holds_g_waits_h_idle(clock, prefetch=False, policy="weighted")
    x_end = a.sessions[3].lease.quantum_end
    assert x_end < h_end
    clock.advance(x_end - clock.monotonic())
    out += a.tick()
    assert [r.session for r in actions_of(out, RevokeAction)] == [3]
    assert not [x for x in actions_of(out, SwapOutAction) if x.session == 1]
    a.verify()


def test_many_small_growths_take_free_memory_at_once_and_the_rest_at_the_rotation(clock):
    """G grows 5 GiB at a time at each of H's burst ends, inside H's quantum: each step
    that fits in free memory is granted at once (no wait), H loses no byte inside its
    quantum, and the rest (to 78 GiB) comes at the rotation."""
    a = Arbiter(0, 80 * GiB, clock, GpuSettings(mode="auto", tq_s=3.0))
    _attach_pair(a)
    a.acquire(1)
    a.report(1, resident=38 * GiB, swapped=0)
    a.acquire(2)
    a.report(2, resident=1 * GiB, swapped=0)
    h_end = a.sessions[1].lease.quantum_end
    want, got, out = 1 * GiB, [], []
    while clock.monotonic() + 0.3 <= h_end:
        clock.advance(0.2)
        out += a.release(1, resident=38 * GiB, swapped=0)
        if 2 in a.holders:
            a.report(2, resident=want, swapped=0)
            want = min(want + 5 * GiB, 78 * GiB)
            out += a.release(2, resident=a.sessions[2].memory.resident, swapped=0,
                             again=True, need=want)  # fmt: skip
            if 2 in a.holders:  # granted at once
                got.append(a.sessions[2].memory.held)
        clock.advance(0.1)
        out += a.tick()
        if a.sessions[1].state.name == "IDLE":
            out += a.acquire(1)
        a.verify()
    assert not [x for x in actions_of(out, SwapOutAction) if x.session == 1]
    # every step that fitted beside H (40 GiB: 80 less H's limit) was granted at once
    assert got == [n * GiB for n in range(6, 40, 5)]
    # what came later came from free memory (H at 38 GiB between bursts); the ask that
    # does not fit waits
    assert 40 * GiB < a.sessions[2].memory.held <= 42 * GiB
    assert 2 not in a.holders and a.sessions[2].memory.need == want
    # the rotation: H's quantum (renewed at 0.3 s, when nobody waited) is over: its
    # bytes go to G then, without any input (a deadline)
    assert list(a.queue) == [2, 1]
    h_end = a.sessions[1].lease.quantum_end
    assert a.next_deadline() == h_end
    clock.advance(h_end - clock.monotonic())
    out = a.tick()
    asked = sum(x.bytes for x in actions_of(out, SwapOutAction) if x.session == 1)
    assert asked == want + 38 * GiB - 80 * GiB
    left = 38 * GiB - asked
    a.swap_done(1, direction="out", nbytes=asked, seconds=1.0, resident=left, swapped=asked)
    assert 2 in a.holders and a.sessions[2].memory.held == want
    a.verify()

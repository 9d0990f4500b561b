"""Families (core/families.py): the processes of one session granted as one holder, their
memory limits adding up to the one the session had."""

from __future__ import annotations

import pytest

from gpushare.core.actions import GrantAction, LimitsAction, RevokeAction
from gpushare.core.arbiter import Arbiter
from gpushare.core.attach import AttachRecord
from gpushare.core.checks import ArbiterError
from gpushare.core.families import Holding
from gpushare.settings import GpuSettings
from tests.core.model import GiB, actions_of, events_of

KEY = "session:1@uid:1000"


def arb(clock, mode="exclusive", capacity=80 * GiB, tq_s=10.0):
    return Arbiter(0, capacity, clock, GpuSettings(mode=mode, tq_s=tq_s))


def member(a, sid, head=1, asked=80 * GiB, **kw):
    return a.attach(
        sid,
        AttachRecord(
            name=f"m{sid}", memory_limit=asked, gang=KEY, family=head, joins_family=True, **kw
        ),
    )


def test_a_member_takes_what_its_session_does_not_have_and_the_session_is_told(clock):
    a = arb(clock)
    a.attach(1, AttachRecord(name="server", memory_limit=40 * GiB, memory_request=30 * GiB))
    a.acquire(1)
    a.release(1, resident=2 * GiB, swapped=0)
    out = member(a, 2)  # asks for the whole GPU: gets what session 1 does not have
    head, m = a.sessions[1].memory, a.sessions[2].memory
    # the request split too, adding up to the 30 GiB asked: the session keeps what it has
    assert (m.limit, m.guaranteed) == (38 * GiB, 28 * GiB)
    assert (head.limit, head.guaranteed) == (2 * GiB, 2 * GiB)
    # the request filled in, never 0 for "the limit" (issue 37)
    assert actions_of(out, LimitsAction) == [LimitsAction(1, 2 * GiB, 2 * GiB)]
    (ev,) = events_of(out, "attach")
    assert ev["family"] == 1 and ev["limit_bytes"] == 38 * GiB
    assert a.sessions[2].rank.family == 1 and a.sessions[1].rank.family == 0
    assert a.gangs[KEY].members == {1, 2}  # the session joined its family's gang
    a.detach(2)  # and both come back whole: no request grown by the split
    assert (head.limit, head.guaranteed, head.request) == (40 * GiB, 30 * GiB, 30 * GiB)


def test_a_member_of_a_session_with_more_than_its_request_is_guaranteed_a_byte(clock):
    a = arb(clock, mode="auto")
    a.attach(
        1, AttachRecord(name="server", memory_limit=40 * GiB, memory_request=4 * GiB, grows=True)
    )
    a.acquire(1)
    a.release(1, resident=6 * GiB, swapped=0)  # lent above its request, now idle
    member(a, 2)
    assert a.sessions[1].memory.guaranteed == 4 * GiB  # all of its request: it has more
    assert a.sessions[2].memory.guaranteed == 1  # nothing of it left: the least there is
    a.detach(2)
    assert a.sessions[1].memory.request == 4 * GiB  # the byte is not given back as request


def test_a_member_asking_less_leaves_the_rest_to_its_session(clock):
    a = arb(clock)
    a.attach(1, AttachRecord(name="server", memory_limit=40 * GiB))
    member(a, 2, asked=10 * GiB)
    assert a.sessions[2].memory.limit == 10 * GiB
    assert a.sessions[1].memory.limit == 30 * GiB
    assert a.sessions[1].memory.guaranteed == 30 * GiB  # request = limit on both sides


def test_what_a_member_took_goes_back_when_it_detaches(clock):
    a = arb(clock)
    a.attach(1, AttachRecord(name="server", memory_limit=40 * GiB, memory_request=30 * GiB))
    member(a, 2, asked=10 * GiB)
    assert (a.sessions[1].memory.limit, a.sessions[1].memory.guaranteed) == (30 * GiB, 20 * GiB)
    out = a.detach(2)
    assert actions_of(out, LimitsAction) == [LimitsAction(1, 40 * GiB, 30 * GiB)]
    assert (a.sessions[1].memory.limit, a.sessions[1].memory.guaranteed) == (40 * GiB, 30 * GiB)


def test_a_member_left_by_its_session_keeps_its_memory(clock):
    a = arb(clock)
    a.attach(1, AttachRecord(name="server", memory_limit=40 * GiB))
    member(a, 2)
    out = a.detach(1)
    assert not actions_of(out, LimitsAction) and a.sessions[2].memory.limit == 40 * GiB
    a.detach(2)  # and its own detach finds no session to give back to
    assert not a.sessions


def test_a_session_with_its_whole_limit_in_use_refuses_a_member_and_nothing_changes(clock):
    a = arb(clock)
    a.attach(1, AttachRecord(name="server", memory_limit=8 * GiB))
    a.acquire(1)
    a.release(1, resident=8 * GiB, swapped=0)
    with pytest.raises(ArbiterError, match=r"all of its memory limit .* in use"):
        member(a, 2)
    assert 2 not in a.sessions and a.sessions[1].memory.limit == 8 * GiB
    assert not a.gangs  # nor did session 1 join a gang


def test_a_family_is_granted_and_revoked_as_one_holder(clock):
    a = arb(clock, tq_s=1.0)
    a.attach(1, AttachRecord(name="server", memory_limit=30 * GiB))
    member(a, 2, asked=20 * GiB)  # the engine: 20 of the server's 30
    a.attach(3, AttachRecord(name="trainer", memory_limit=40 * GiB))
    a.acquire(2)
    assert list(a.holders) == [2]
    a.acquire(3)
    out = a.acquire(1)  # the server's own process asks while its family holds: at once
    assert actions_of(out, GrantAction) and set(a.holders) == {1, 2}
    clock.advance(1.5)
    out = a.tick()  # the quantum ends and the trainer waits: both members revoked
    assert {r.session for r in actions_of(out, RevokeAction)} == {1, 2}
    a.release(1, resident=0, swapped=0)
    assert 3 not in a.holders  # the GPU stays the family's until every member yielded
    a.release(2, resident=0, swapped=0)
    assert list(a.holders) == [3]


def test_the_gpu_total_never_grows_with_members(clock):
    a = arb(clock, mode="auto")
    a.attach(1, AttachRecord(name="server", memory_limit=40 * GiB))
    a.attach(9, AttachRecord(name="other", memory_limit=40 * GiB))
    member(a, 2, asked=25 * GiB)
    member(a, 3, asked=10 * GiB)
    assert [a.sessions[i].memory.limit for i in (1, 2, 3)] == [5 * GiB, 25 * GiB, 10 * GiB]
    total = sum(s.memory.limit for s in a.sessions.values())
    assert total == 80 * GiB  # the server's 40 split among its processes, the other's 40
    a.verify()  # the running totals agree with a scan (raises if not)


def test_a_member_of_a_member_is_refused_and_nothing_changes(clock):
    # A process names a member as its family: what it took would go back to the member,
    # which may have left (and given back only its own part): lost to the family.
    a = arb(clock)
    a.attach(1, AttachRecord(name="server", memory_limit=40 * GiB))
    member(a, 2, asked=20 * GiB)
    with pytest.raises(ArbiterError, match="is a process of session 1's"):
        member(a, 3, head=2, asked=10 * GiB)
    assert 3 not in a.sessions and a.gangs[KEY].members == {1, 2}
    assert [a.sessions[i].memory.limit for i in (1, 2)] == [20 * GiB, 20 * GiB]
    a.detach(2)
    assert a.sessions[1].memory.limit == 40 * GiB  # all of it back


def test_a_member_joins_its_sessions_gang_or_none_other(clock):
    a = arb(clock, mode="auto")
    a.attach(1, AttachRecord(name="rank0", memory_limit=20 * GiB, gang="job"))
    with pytest.raises(ArbiterError, match=r"joins its gang \(job\), not other"):
        a.attach(
            2, AttachRecord(name="m", memory_limit=GiB, gang="other", family=1, joins_family=True)
        )
    with pytest.raises(ArbiterError, match="not none"):
        a.attach(2, AttachRecord(name="m", memory_limit=GiB, family=1, joins_family=True))
    assert 2 not in a.sessions and a.sessions[1].memory.limit == 20 * GiB


def test_a_session_put_in_a_gang_by_its_member_is_checked_at_its_whole_limit(clock):
    # Were the session's limit not counted, the gang's limits together would be more
    # than the GPU, and the gang, granted as one, never granted at all.
    a = arb(clock, mode="auto")
    a.attach(3, AttachRecord(name="r0", memory_limit=30 * GiB, gang="J"))
    a.attach(4, AttachRecord(name="r1", memory_limit=30 * GiB, gang="J"))
    a.attach(1, AttachRecord(name="server", memory_limit=40 * GiB))
    with pytest.raises(ArbiterError, match="would need"):
        a.attach(
            2, AttachRecord(name="m", memory_limit=20 * GiB, gang="J", family=1, joins_family=True)
        )
    assert a.sessions[1].memory.limit == 40 * GiB and not a.sessions[1].rank.gang
    assert a.gangs["J"].members == {3, 4}


def test_a_member_asking_a_negative_limit_is_refused_and_nothing_changes(clock):
    a = arb(clock)
    a.attach(1, AttachRecord(name="server", memory_limit=40 * GiB))
    with pytest.raises(ArbiterError, match="memory_limit must be a positive number"):
        member(a, 2, asked=-5)
    assert a.sessions[1].memory.limit == 40 * GiB and not a.gangs


def test_members_joining_while_the_session_yields_with_a_swap_out_asked(clock):
    a = arb(clock, tq_s=1.0, capacity=40 * GiB)
    a.attach(1, AttachRecord(name="server", memory_limit=30 * GiB))
    a.attach(9, AttachRecord(name="other", memory_limit=30 * GiB))
    a.acquire(1)
    a.report(1, resident=20 * GiB, swapped=0)
    a.acquire(9)
    clock.advance(1.5)
    a.tick()  # revoked, 10 GiB asked out
    a.release(1, resident=20 * GiB, swapped=0)
    member(a, 2)  # takes what the session does not have: 10 of its 30
    assert [a.sessions[i].memory.limit for i in (1, 2)] == [20 * GiB, 10 * GiB]
    with pytest.raises(ArbiterError, match="all of its memory limit"):
        member(a, 3)  # none left
    a.swap_done(
        1, direction="out", nbytes=10 * GiB, seconds=0.1, resident=10 * GiB, swapped=10 * GiB
    )
    assert list(a.holders) == [9]
    a.detach(2)
    assert a.sessions[1].memory.limit == 30 * GiB


def test_a_member_waits_while_its_session_holds_all_its_grant_lets_it_have(clock):
    # A holder may have up to its bound (here its limit) since its last report: a member
    # given the "free" part would have memory the holder uses (the GPU over, uncounted;
    # the holder over its new limit, escalated for it). Busy: the member tries again.
    a = arb(clock)
    a.attach(1, AttachRecord(name="server", memory_limit=40 * GiB))
    a.acquire(1)
    a.report(1, resident=2 * GiB, swapped=0)  # and may have allocated 30 more since
    with pytest.raises(Holding, match="holds the GPU") as e:
        member(a, 2)
    assert e.value.code == "busy"
    assert 2 not in a.sessions and a.sessions[1].memory.limit == 40 * GiB and not a.gangs
    a.release(1, resident=32 * GiB, swapped=0)
    member(a, 2)  # once it has released: what it does not have
    assert [a.sessions[i].memory.limit for i in (1, 2)] == [32 * GiB, 8 * GiB]


def test_a_member_of_a_holder_with_a_bound_gets_only_what_is_past_the_bound(clock):
    a = arb(clock, mode="auto")
    a.attach(
        1, AttachRecord(name="server", memory_limit=40 * GiB, memory_request=10 * GiB, grows=True)
    )
    a.acquire(1)
    bound = a.sessions[1].memory.bound
    assert 0 < bound < 40 * GiB
    member(a, 2)
    assert a.sessions[2].memory.limit == 40 * GiB - bound
    assert a.sessions[1].memory.limit == bound == a.sessions[1].memory.bound  # as granted

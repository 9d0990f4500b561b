"""Families: the processes of one session, one lease and one memory limit among them.

An engine runs its model in processes its program starts (vLLM's ``EngineCore`` and
``Worker``, a multiprocessing server's workers, ``torch.multiprocessing`` children). Each
such process that does GPU work attaches as a *member* of the session that started it
(docs/scheduling.md "Families"); the node has checked that it descends from the
session's process. The rules, here beside no state of their own (a family is the
members' gang and each member's :attr:`~gpushare.core.sessions.Rank.family`):

* **one lease**: the family is a gang (core/gangs.py), granted and revoked as one
  holder, so that a process blocked on its sibling's answer never holds the GPU the
  sibling waits for. A session that is a rank of a distributed job keeps its job's
  gang: its members join it (they inherit the rank's environment, so their hellos name
  the job already);
* **one memory limit**: a member's limit comes out of its session's. It gets what it
  asks, at most the part of the session's limit that the session does not have now
  (on the GPU, in host memory or dropped; holding the GPU, all its grant lets it have:
  it may have that by now, unreported); the session keeps the rest, and its client
  is told (:class:`~gpushare.core.actions.LimitsAction`). The request is split the same
  way, the member's first (the session keeps what is left, at least what it has). When
  the member detaches, what it took goes back to its session, if that is still here.
  So a family never counts for more than the one limit its pod asked for, and the GPU's
  totals stay as they were.

:class:`Families` is what the arbiter's ``attach`` and ``detach`` call.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

from gpushare.core.actions import LimitsAction
from gpushare.core.attach import AttachRecord
from gpushare.core.checks import ArbiterError
from gpushare.core.sessions import Memory, SessionState
from gpushare.core.state import GpuState
from gpushare.units import format_size


@dataclass(frozen=True)
class Split:
    """A member's part of its session's memory, and what the session keeps."""

    limit: int
    request: int  # bytes, at most ``limit`` (filled in: never 0 for "the limit")
    parent_limit: int
    parent_request: int  # likewise, at most ``parent_limit``
    took: int  # of the session's request (0: none, or the request was the limit)


def key(parent: int, who: str) -> str:
    """The gang key of session ``parent``'s family (``who``: the pod or uid the node saw,
    as a job's key has it, so a family's key never matches another owner's)."""
    return f"session:{parent}@{who}"


def alone(gang: str) -> bool:
    """A family's gang (not a job's): its processes are on this node, one holder, so it
    takes turns as one process does (issue 40: else each request waited a quantum)."""
    return gang.startswith("session:")


def has(m: Memory) -> int:
    """What a session has now, wherever it is: what it must keep of its limit."""
    return m.resident + m.swapped + m.discarded


class Holding(ArbiterError):
    """The session holds the GPU, and may have all it is let have since its last report:
    a member joins once it has released (the node says busy: its client tries again)."""

    code = "busy"


def check_join(parent: SessionState, gang: str) -> None:
    """A member joins a session that is no member itself (what a member of a member
    took would go back to a session that may have left: lost to the family), in that
    session's gang (or a new one, the family's); else :class:`ArbiterError`."""
    if parent.rank.family:
        raise ArbiterError(
            f"session {parent.id} ({parent.name}) is a process of session {parent.rank.family}'s:"
            f" a process it starts joins session {parent.rank.family}"
        )
    if not gang or (parent.rank.gang and parent.rank.gang != gang):
        raise ArbiterError(
            f"a process of session {parent.id} joins its gang"
            f" ({parent.rank.gang or 'a new one, its family'}), not {gang or 'none'}"
        )


def split(parent: SessionState, asked: int) -> Split:
    """A member asking ``asked`` bytes joins ``parent``: the limits and requests after."""
    m = parent.memory
    keep = has(m)
    if parent.holding:  # it may have up to its grant's bound (or limit) by now, unreported
        keep = max(keep, m.held)
    free = m.limit - keep
    if free <= 0 and parent.holding:
        raise Holding(
            f"session {parent.id} ({parent.name}) holds the GPU, free to use all of its memory"
            " limit: a process it starts joins it once it releases (try again soon)"
        )
    if free <= 0:
        raise ArbiterError(
            f"session {parent.id} ({parent.name}) has all of its memory limit"
            f" ({format_size(m.limit)} left of it) in use: a process it starts has none"
            " to take; give the session a larger limit (gpushare run --memory-limit), or"
            " its processes less each (GPUSHARE_MEMBER_MEMORY)"
        )
    limit = min(asked, free)
    parent_limit = m.limit - limit
    if m.request >= m.limit:  # its request is its limit: so is each part's
        return Split(limit, limit, parent_limit, parent_limit, took=0)
    # The session keeps of its request what it has (its guarantee never falls below the
    # bytes it holds) and what the member's limit cannot take; the member the rest. The
    # two add up to the request, which comes back whole when the member leaves.
    r = m.request
    kept = min(r, max(keep, r - limit, 1)) if parent_limit else 0
    took = r - kept
    # (A request is a positive number of bytes: a member that took none is guaranteed
    # 1 byte while it is here, given back as none.)
    return Split(
        limit=limit,
        request=min(max(took, 1), limit),
        parent_limit=parent_limit,
        parent_request=min(kept, parent_limit),
        took=took,
    )


def give(m: Memory, limit: int, request: int) -> None:
    """Set a session's limit and request (after a member joined or left it); a bound
    of a grant under way is kept within the new limit."""
    m.limit, m.request = limit, request
    if m.bound > limit:
        m.bound = limit
    if m.room > limit:
        m.room = limit


def back(parent: SessionState, member: SessionState) -> tuple[int, int]:
    """A member leaves: the limit and request its session has again."""
    h = parent.memory
    limit = h.limit + member.memory.limit
    if h.request >= h.limit and not member.rank.took:  # the request was the limit: it still is
        return limit, limit
    return limit, min(h.request + member.rank.took, limit)


@dataclass(frozen=True)
class Joining:
    """A member joining session ``parent``: its record with its part of the session's
    limit and request, and the session's after."""

    parent: SessionState
    cut: Split
    rec: AttachRecord


class GangRules(Protocol):
    """What a family needs of core/gangs.py's :class:`~gpushare.core.gangs.Gangs` (a
    layer above this one: passed in, not imported)."""

    def check(self, key: str, limit: int, spans_nodes: bool) -> None: ...
    def join(self, s: SessionState, key: str, size: int, spans_nodes: bool) -> None: ...


class Families:
    """A member's limits taken out of its session's at attach, given back at detach."""

    def __init__(self, st: GpuState, gangs: GangRules) -> None:
        self.st, self.gangs = st, gangs

    def joining(self, rec: AttachRecord) -> Joining | None:
        """The member's part of its session's limit (None: ``rec`` joins no family now);
        :class:`ArbiterError` where the session has none to give."""
        if not rec.joins_family:
            return None
        parent = self.st.get(rec.family)
        cut = split(parent, rec.memory_limit)
        member = replace(rec, memory_limit=cut.limit, memory_request=cut.request or cut.limit)
        return Joining(parent, cut, member)

    def check_gang(self, j: Joining | None, rec: AttachRecord, limit: int) -> None:
        """The gang a session joins can hold the GPU with it. A family's limits add up to
        what its session had: checked as they were (the session's whole limit where the
        session is not in the gang yet)."""
        if j is None:
            self.gangs.check(rec.gang, limit, rec.spans_nodes)
            return
        check_join(j.parent, rec.gang)
        if j.parent.rank.gang != rec.gang:
            self.gangs.check(rec.gang, j.parent.memory.limit, rec.spans_nodes)

    def joined(self, j: Joining, s: SessionState) -> None:
        """The member ``s`` is attached: its session keeps the rest, in the family's gang."""
        s.rank.took = j.cut.took
        self._left_to(j.parent, j.cut.parent_limit, j.cut.parent_request)
        if not j.parent.rank.gang:
            self.gangs.join(j.parent, j.rec.gang, 0, False)

    def left(self, s: SessionState) -> None:
        """``s`` detached: what it took of its session's limit goes back (if the session
        is still here)."""
        parent = self.st.sessions.get(s.rank.family)
        if parent is not None:
            self._left_to(parent, *back(parent, s))

    def _left_to(self, parent: SessionState, limit: int, request: int) -> None:
        """A family's session has a new limit and request (a member joined or left)."""
        give(parent.memory, limit, request)
        self.st.ledger.recount(parent)
        self.st.out.act(LimitsAction(parent.id, limit, request))

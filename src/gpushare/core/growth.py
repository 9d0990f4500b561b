"""Growth above a request (docs/scheduling.md 6, issue 38 item 2): a grower takes only
free memory, or waits for the rotation of quanta; never a neighbour's memory inside its
quantum. A session at or below its request that ended a burst inside its quantum (not
revoked) keeps its bytes until the grower has waited a quantum (the rotation), and may
start its next burst beside the waiting grower meanwhile."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from gpushare.core.planner import MemoryView
from gpushare.core.sessions import SessionState


def grower(s: SessionState) -> bool:
    """``s`` waits for memory above its request (a release with a ``need``)."""
    return s.memory.need > s.memory.guaranteed


def rotating(head: SessionState, now: float, tq_s: float) -> bool:
    """The grower has waited a quantum: the others' quanta have rotated for it."""
    return now - head.lease.wait_start >= tq_s


def protected(s: SessionState, now: float) -> bool:
    """A non-holder at or below its request whose last quantum still runs (it ended a
    burst, nobody revoked it): its bytes are its own until that quantum ends."""
    ls = s.lease
    return (
        not s.holding
        and s.memory.guaranteed > 0
        and s.used <= s.memory.guaranteed
        and ls.quantum_end > now
        and ls.revoked_at < ls.start
    )


def shield(
    views: Sequence[MemoryView],
    head: SessionState,
    sessions: dict[int, SessionState],
    now: float,
    tq_s: float,
) -> list[MemoryView]:
    """``views`` for a grant to ``head``: where it grows and has not waited a quantum,
    the protected sessions pinned (never asked)."""
    if not grower(head) or rotating(head, now, tq_s):
        return list(views)
    return [
        dataclasses.replace(v, pinned=True)
        if v.id != head.id and protected(sessions[v.id], now)
        else v
        for v in views
    ]

"""Growth above a request (docs/scheduling.md 6, issue 38 item 2): a grower takes only
free memory, or waits for the rotation of quanta; never a neighbour's memory inside its
quantum. A session at or below its request that ended a burst inside its quantum (not
revoked) keeps its bytes until that quantum of its own is over (whatever set its length:
TQ, its weight, credit or debt, a turn), and may start its next bursts beside the
waiting grower meanwhile, each continuing that quantum, never a new one.

One rule for every plan that asks a non-holder for bytes on a grower's behalf: a grant
(core/admission.py), a filling holder's room (core/leases.py's ``fill_rooms``), a
revoke's swap-outs planned for the head, a prefetch's room (core/prefetch.py)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from gpushare.core.ledger import bound_for
from gpushare.core.planner import MemoryView
from gpushare.core.sessions import SessionState


def grower(s: SessionState, mode: str) -> bool:
    """``s`` asks for memory above its request: a release with a ``need``, or back at
    what it had grown to (its bound, core/ledger.bound_for, in mode auto)."""
    return s.mode_of(mode) == "auto" and bound_for(s, mode) > s.memory.guaranteed


def running_end(s: SessionState, now: float) -> float:
    """When the quantum of its own that still runs ends (nobody revoked it), else 0: its
    last grant's, or, its last grant a turn, the one it held before (a turn is extra GPU
    time from its credit: neither a new quantum nor the end of the one it has)."""
    ls = s.lease
    end = ls.own_end or ls.quantum_end
    return end if now < end < math.inf and ls.revoked_at < ls.start else 0.0


def granted(s: SessionState, now: float) -> None:
    """Before ``s``'s grant: a turn keeps the end of the quantum that still runs (-1:
    none), any other grant sets its own (``quantum_end``)."""
    turn = s.share.turn and not s.share.continued
    s.lease.own_end = (running_end(s, now) or -1.0) if turn else 0.0


def protected(s: SessionState, now: float) -> bool:
    """A non-holder at or below its request whose last quantum still runs (it ended a
    burst, nobody revoked it): its bytes are its own until that quantum ends."""
    return (
        not s.holding
        and s.memory.guaranteed > 0
        and s.used <= s.memory.guaranteed
        and running_end(s, now) > 0
    )


def shield(
    views: Sequence[MemoryView],
    head: SessionState,
    sessions: Mapping[int, SessionState],
    now: float,
    mode: str,
) -> tuple[list[MemoryView], float | None]:
    """``views`` for a plan on behalf of ``head``: where it grows, the protected
    sessions pinned (never asked) until their own quanta are over; and when the first of
    those quanta ends (the plan is looked at again then, even if no input comes: a
    neighbour that went idle inside its quantum sends none)."""
    if not grower(head, mode):
        return list(views), None
    out, until = [], None
    for v in views:
        s = sessions.get(v.id)
        if v.id != head.id and s is not None and protected(s, now):
            v = dataclasses.replace(v, pinned=True)
            end = running_end(s, now)
            until = end if until is None else min(until, end)
        out.append(v)
    return out, until

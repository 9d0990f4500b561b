"""Memory planning: who swaps out how much so that the next holder fits.

Pure functions over a snapshot of the sessions on one GPU. The accounting rule that
keeps a GPU from ever being over capacity, swaps in flight included:

* a holder (or a session just granted, whose swap-in is in flight) counts at its bound:
  its memory limit, or in mode auto what its grant lent it (its request, what it has,
  what it asked for), since it may grow to that while it holds the GPU without asking;
* every other session counts at its resident bytes, and bytes it is still swapping out
  count until it reports the swap done.

So a grant is made only when the grantee's bound plus everyone else's count fits.
Victims give what they have above their request first, and what is within it last.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class MemoryView:
    """What the planner needs to know of one session."""

    id: int
    # What it counts at while it holds: its bound (its limit, or what a grant lent it in
    # mode auto); a candidate's, once granted. Named ``limit`` before issue 37.
    bound: int
    resident: int
    holding: bool
    last_served: float
    pending_out: int = 0  # bytes asked to swap out, not yet reported done
    pinned: bool = False  # cannot be asked now (frozen, its last swap failed, prefetching)
    keep: bool = False  # expected back soon (an interactive session): asked last
    request: int = 0  # its guaranteed bytes: asked for only after every byte above requests


@dataclass(frozen=True)
class Plan:
    fits: bool  # the candidate can be granted now
    swap_outs: list[tuple[int, int]] = field(default_factory=list)  # (session, bytes) to ask now
    shortfall: int = 0  # bytes still missing after every possible swap-out


def used_bytes(s: MemoryView) -> int:
    return s.bound if s.holding else s.resident


def used_total(sessions: Sequence[MemoryView]) -> int:
    return sum(used_bytes(s) for s in sessions)


def plan_grant(capacity: int, sessions: Sequence[MemoryView], candidate: int) -> Plan:
    """Can ``candidate`` be granted now; if not, which swap-outs would make room?

    Victims are non-holders other than the candidate, least recently served first (those
    expected back soon last), and each is asked only for what is still missing after
    swap-outs already under way.
    """
    cand = next(s for s in sessions if s.id == candidate)
    others = [s for s in sessions if s.id != candidate]
    need = used_total(others) + cand.bound - capacity
    if need <= 0:
        return Plan(fits=True)
    need -= sum(s.pending_out for s in others)
    victims = sorted(others, key=lambda s: (s.keep, s.last_served, s.id))
    asks, short = take_from(victims, need)
    return Plan(fits=False, swap_outs=asks, shortfall=short)


def take_from(victims: Sequence[MemoryView], need: int) -> tuple[list[tuple[int, int]], int]:
    """Ask ``victims`` in order, each for what it can give (its resident bytes not already
    on their way out), until ``need`` bytes are asked; returns the asks and what is
    still missing. Holders and pinned sessions are passed over. Two passes: the bytes
    each has above its request first (a burst lent is given back before anyone's
    guarantee is touched), then the rest, in the same order."""
    taken: dict[int, int] = {}
    for above in (True, False):
        for v in victims:
            if need <= 0:
                break
            if v.holding or v.pinned:
                continue
            avail = v.resident - v.pending_out - taken.get(v.id, 0)
            if above:
                avail = min(avail, v.resident - v.request)
            if avail <= 0:
                continue
            take = min(avail, need)
            taken[v.id] = taken.get(v.id, 0) + take
            need -= take
    return list(taken.items()), max(need, 0)

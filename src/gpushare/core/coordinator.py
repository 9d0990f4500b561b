"""Gangs with ranks on several GPUs of a node: granted on all of them at once.

Each GPU's arbiter grants its own part of a gang. Parts on two GPUs granted on their
own could each wait for the other's GPU, held by another job (rank 0 of a job holds GPU
0 while rank 1 waits for GPU 1, held by another job: issue 14). So, for a gang whose
GPUs are all in mode exclusive (docs/scheduling.md "Gangs"):

* it starts on all its GPUs at once: the gangs waiting to start are taken in the order
  they began to wait (a ticket), one at a time; the next one's GPUs are kept for it
  (no other job is granted there, and their holders are revoked at the end of their
  quanta) until none is held, then each GPU grants its ranks there;
* while it holds one of its GPUs, it holds them all: another job is granted none of
  them; its ranks that ask on any of them join it;
* it is revoked on all of them together, and has yielded when no rank holds on any;
  parked ranks on one GPU regroup while a rank holds on another.

A gang waits for nothing but its own GPUs, and holds all or none of them, so two gangs
never each hold what the other waits for. Pure: the arbiters' state is read, nothing
else; the node ticks the arbiters that share such a gang after each of their decisions
(:meth:`Coordinator.linked`).
"""

from __future__ import annotations

from collections.abc import Sequence

from gpushare.core.arbiter import Arbiter
from gpushare.core.sessions import State


class Coordinator:
    def __init__(self, arbiters: Sequence[Arbiter]) -> None:
        self.arbiters = {a.gpu: a for a in arbiters}
        # Gangs on several GPUs waiting to start: when each began to wait (and a tie-break).
        self._tickets: dict[str, tuple[float, int]] = {}
        self._seq = 0
        for a in arbiters:
            a.gangs.peers = self

    def _parts(self, key: str) -> list[Arbiter]:
        return [a for a in self.arbiters.values() if key in a.gangs]

    def spread(self, key: str) -> bool:
        parts = self._parts(key)
        return len(parts) > 1 and all(a.settings.mode == "exclusive" for a in parts)

    def active(self, key: str) -> bool:
        return any(a.gang_here(key) for a in self._parts(key))

    def holding(self, key: str) -> bool:
        return any(a.sessions[m].holding for a in self._parts(key) for m in a.gangs[key].members)

    def revoked(self, key: str) -> bool:
        return any(a.gangs[key].revoked for a in self._parts(key))

    def free(self, key: str) -> bool:
        """None of the gang's GPUs is held, reserved, or kept by another such gang (one
        holding elsewhere: it holds all its GPUs or none)."""
        for a in self._parts(key):
            if a.holders or a.window.holder is not None:
                return False
            if any(k != key and self.spread(k) and self.active(k) for k in a.gangs):
                return False
        return True

    def others_wait(self, key: str) -> bool:
        return any(a.sessions[q].rank.gang != key for a in self._parts(key) for q in a.queue)

    def next(self) -> str | None:
        """The gang on several GPUs that starts next: of those with a rank waiting and
        none holding, the one that began to wait first."""
        waiting = set()
        for a in self.arbiters.values():
            for key, g in a.gangs.items():
                if any(a.sessions[m].state is State.WAITING for m in g.members):
                    waiting.add(key)
        waiting = {k for k in waiting if self.spread(k) and not self.active(k)}
        for key in list(self._tickets):
            if key not in waiting:
                del self._tickets[key]  # started, or no longer waiting: a new ticket later
        now = next(iter(self.arbiters.values())).clock.monotonic()
        for key in sorted(waiting - set(self._tickets)):
            self._seq += 1
            self._tickets[key] = (now, self._seq)
        return min(self._tickets, key=self._tickets.__getitem__, default=None)

    def may_start(self, key: str) -> bool:
        """The gang starts now, on all its GPUs: it is the next, each of its GPUs is kept
        for it (no one there waited longer), none is held, and its last turn is over
        on all of them."""
        if self.next() != key or not self.free(key) or self.revoked(key):
            return False
        return all(self.claimed(a.gpu) for a in self._parts(key))

    def claimed(self, gpu: int) -> bool:
        """GPU ``gpu`` is kept for a gang on several GPUs: one holding, or the next one
        unless the session first in line here began to wait before it did."""
        a = self.arbiters[gpu]
        spread = [k for k in a.gangs if self.spread(k)]
        if not spread:
            return False
        n = self.next()  # (first: a gang holding gives its ticket back)
        if any(self.active(k) for k in spread):
            return True
        if n not in spread:
            return False
        since = a.head_waiting_since()
        return since is None or since >= self._tickets[n][0]

    def linked(self, gpu: int) -> list[Arbiter]:
        """The other GPUs that share a gang with ``gpu``: to be ticked after its
        decisions, as theirs may follow from them."""
        keys = [k for k in self.arbiters[gpu].gangs if self.spread(k)]
        return [
            a for a in self.arbiters.values() if a.gpu != gpu and any(k in a.gangs for k in keys)
        ]

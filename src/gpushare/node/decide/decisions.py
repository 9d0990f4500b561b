"""Decisions: what the node does with an arbiter's actions, whoever asked for them.

Every input's actions (a workload's message, an administrator's change, the config file,
a sample, a timer) come here. They are delivered (:class:`~gpushare.node.decide.dispatch.Dispatch`
only delivers), then the GPUs whose decisions may follow from them are ticked: a gang on
several GPUs (core/coordinator.py) starts, yields and regroups on all of them, so one
GPU's grant or release can free or keep another's. Each GPU that decided something has
its linked GPUs ticked in turn, until a round of ticks decides nothing more. That always
comes (a tick after nothing changed decides nothing); should it ever not, the loop stops
after :data:`FOLLOW_LIMIT` ticks with an error in the log, and the GPUs' timers tick them
on from there.

After each GPU's actions its timer is checked against the arbiter's next deadline,
relative to the node's clock (so a virtual clock drives it as well). It is set again
only when that deadline is earlier than the one it is set for: a timer that fires
before anything is due (its deadline went, or moved later) does not tick the arbiter,
it is only set for the next deadline from there. So a message costs no timer work in
the common case (a grant's quantum ends after the timer already set), and the arbiter
is ticked exactly when something is due.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable

from gpushare.core.actions import Action
from gpushare.core.arbiter import Arbiter
from gpushare.core.clock import Clock
from gpushare.node.decide.dispatch import Dispatch

log = logging.getLogger("gpushare.node.decisions")

Linked = Callable[[int], list[Arbiter]]
"""The GPUs whose decisions may follow from GPU ``gpu``'s (:meth:`Coordinator.linked`)."""

# Ticks of linked GPUs after one input, at most: a gang's start or end settles within a
# tick or two of each of its GPUs, so this is only reached by a rule that never settles.
FOLLOW_LIMIT = 1000


class Decisions:
    def __init__(
        self,
        dispatch: Dispatch,
        clock: Clock,
        linked: Linked | None = None,
        follow_limit: int = FOLLOW_LIMIT,
    ) -> None:
        self.dispatch = dispatch
        self.clock = clock
        self.linked = linked
        self.follow_limit = follow_limit
        # per GPU: the deadline its timer is set for, and the timer
        self._timers: dict[int, tuple[float, asyncio.TimerHandle]] = {}
        self.timers_set = 0  # how many times a timer was set (the tests count them)
        self.limit_hit = 0  # how many times following stopped at the limit (never, sound)

    def act(self, arb: Arbiter, actions: list[Action]) -> None:
        """``arb``'s actions delivered, then its linked GPUs ticked until none decides
        anything more (each delivered likewise)."""
        self._deliver(arb, actions)
        if self.linked is None:
            return
        todo = deque(self.linked(arb.gpu))
        queued = {a.gpu for a in todo}
        ticks = 0
        while todo:
            if ticks == self.follow_limit:
                self.limit_hit += 1
                log.error(
                    "GPU %d: the GPUs sharing a gang with it still decided something after"
                    " %d ticks (GPUs %s left): stopped following; their timers tick them"
                    " on. This is a bug in the rules: please report it",
                    arb.gpu,
                    ticks,
                    sorted(queued),
                )
                return
            other = todo.popleft()
            queued.discard(other.gpu)
            ticks += 1
            follow = other.tick()
            self._deliver(other, follow)
            if follow:  # what it decided may in turn let its own linked GPUs decide
                for nxt in self.linked(other.gpu):
                    if nxt.gpu not in queued:
                        todo.append(nxt)
                        queued.add(nxt.gpu)

    def _deliver(self, arb: Arbiter, actions: list[Action]) -> None:
        self.dispatch.deliver(arb, actions)
        self._schedule(arb)

    def close(self) -> None:
        for _, t in self._timers.values():
            t.cancel()
        self._timers.clear()

    def _schedule(self, arb: Arbiter) -> None:
        when = arb.next_deadline()
        if when is None:
            return  # a timer already set fires, finds nothing due, and is not set again
        armed = self._timers.get(arb.gpu)
        if armed is not None:
            if armed[0] <= when:
                return  # it fires first; the next deadline is set from there
            armed[1].cancel()
        delay = max(0.0, when - self.clock.monotonic())
        self.timers_set += 1
        self._timers[arb.gpu] = (
            when,
            asyncio.get_running_loop().call_later(delay, self._on_timer, arb),
        )

    def _on_timer(self, arb: Arbiter) -> None:
        self._timers.pop(arb.gpu, None)
        when = arb.next_deadline()
        if when is not None and when <= self.clock.monotonic():
            self.act(arb, arb.tick())
        else:  # set for a deadline that went or moved later: nothing is due yet
            self._schedule(arb)

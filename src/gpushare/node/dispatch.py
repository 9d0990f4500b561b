"""Dispatch: the one place the arbiters' decisions leave the node.

Each action goes where it belongs: a grant, revoke, room or swap-out to its session's
connection, an event to the bus, an escalation to the log and (freeze, kill) to the
process as a signal. After every batch the GPU's timer is set again for the arbiter's
next deadline, relative to the node's clock, so a virtual clock drives it as well.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Callable

from gpushare import protocol as p
from gpushare.core.actions import (
    Action,
    EscalateAction,
    EventAction,
    GrantAction,
    PrefetchAction,
    RevokeAction,
    RoomAction,
    SwapOutAction,
)
from gpushare.core.arbiter import Arbiter
from gpushare.core.clock import Clock
from gpushare.node.events import EventBus
from gpushare.node.guard import Conn

log = logging.getLogger("gpushare.node.dispatch")

Signaller = Callable[[int, int], None]
"""Sends signal ``sig`` to process ``pid`` (tests inject one that only records)."""


def send_signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


class Dispatch:
    def __init__(
        self,
        clock: Clock,
        events: EventBus,
        conns: dict[int, Conn],
        signaller: Signaller = send_signal,
        linked: Callable[[int], list[Arbiter]] | None = None,
    ) -> None:
        self.clock = clock
        # The GPUs whose decisions may follow from a GPU's (a gang on several GPUs:
        # core/coordinator.py): ticked after its own.
        self.linked = linked
        self.events = events
        self.conns = conns
        self.signaller = signaller
        self._timers: dict[int, asyncio.TimerHandle] = {}

    def apply(self, arb: Arbiter, actions: list[Action], depth: int = 0) -> None:
        for a in actions:
            if isinstance(a, EventAction):
                self.events.publish(a.record)
                continue
            c = self.conns.get(a.session)
            if isinstance(a, EscalateAction):
                self._escalate(a, c)
            elif c is None:
                continue  # the session is gone: its actions have no one to go to
            elif isinstance(a, GrantAction):
                if a.thaw:
                    self._signal(c, signal.SIGCONT)
                    c.frozen = False
                c.send(
                    p.Grant(
                        lease=a.lease,
                        swap_in=a.swap_in,
                        quantum_s=a.quantum_s,
                        shared=a.shared,
                        room=a.room,
                    )
                )
            elif isinstance(a, RevokeAction):
                c.send(p.Revoke(lease=a.lease, swap_out=a.swap_out, grace_s=a.grace_s))
            elif isinstance(a, SwapOutAction):
                c.send(p.SwapOut(bytes=a.bytes))
            elif isinstance(a, RoomAction):
                c.send(p.Room(room=a.room))
            elif isinstance(a, PrefetchAction):
                c.send(p.Prefetch(room=a.room, seq=a.seq))
        self._schedule(arb)
        if self.linked is not None and depth < 4:
            for other in self.linked(arb.gpu):
                follow = other.tick()
                if follow:
                    self.apply(other, follow, depth + 1)
                else:
                    self._schedule(other)

    def end_session(self, c: Conn, reason: str) -> None:
        """An administrator ends a session: it is told, thawed if frozen, and its
        connection closed (its reader sees the end; the detach follows from there)."""
        c.send(p.Error(code="ended", message=f"session ended: {reason}"))
        if c.frozen:
            self._signal(c, signal.SIGCONT)
        c.writer.close()

    def close(self) -> None:
        for t in self._timers.values():
            t.cancel()
        self._timers.clear()

    def _escalate(self, a: EscalateAction, c: Conn | None) -> None:
        who = f"session {a.session}" + (f" (pid {c.pid})" if c else "")
        log.warning("escalation %s for %s: %s", a.escalation, who, a.reason)
        if c is None:
            return
        if a.escalation == "kill":
            if c.frozen:  # a stopped process dies only once continued
                self._signal(c, signal.SIGCONT)
            self._signal(c, signal.SIGKILL)
        elif a.escalation == "freeze" and a.reason == "no_yield_within_grace":
            c.frozen = True
            self._signal(c, signal.SIGSTOP)

    def _signal(self, c: Conn, sig: int) -> None:
        if c.pid > 1:  # never init, never "every process" (0, -1)
            self.signaller(c.pid, sig)

    def _schedule(self, arb: Arbiter) -> None:
        old = self._timers.pop(arb.gpu, None)
        if old:
            old.cancel()
        when = arb.next_deadline()
        if when is not None:
            delay = max(0.0, when - self.clock.monotonic())
            self._timers[arb.gpu] = asyncio.get_running_loop().call_later(
                delay, self._on_timer, arb
            )

    def _on_timer(self, arb: Arbiter) -> None:
        self._timers.pop(arb.gpu, None)
        self.apply(arb, arb.tick())

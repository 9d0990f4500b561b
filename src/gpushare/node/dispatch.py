"""Dispatch: the one place the arbiters' decisions leave the node.

Each action goes where it belongs: a grant (signed, so that it can be claimed back after a
restart), revoke, room or swap-out to its session's connection, an event to the bus, an
escalation to the log and (freeze, kill) as a signal to the whole workload: every process
of the session's uid holding its connection, each reached through a pidfd, never a
process that took a pid since. A batch's frames for one connection leave in one write; a
connection whose peer does not read is not let to hold more than ``write_limit`` bytes
of the node's memory: it is refused and closed, and the others go on.

After every batch the GPU's timer is checked against the arbiter's next deadline,
relative to the node's clock (so a virtual clock drives it as well). It is set again
only when that deadline is earlier than the one it is set for: a timer that fires
before anything is due (its deadline went, or moved later) does not tick the arbiter,
it is only set for the next deadline from there. So a message costs no timer work in
the common case (a grant's quantum ends after the timer already set), and the arbiter
is ticked exactly when something is due, as before.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable

import msgspec

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
    ThawAction,
)
from gpushare.core.arbiter import Arbiter
from gpushare.core.clock import Clock
from gpushare.node.events import EventBus
from gpushare.node.guard import Conn, Refused
from gpushare.node.procs import ProcRef, pidfd_signal
from gpushare.node.recovery import Recovery

log = logging.getLogger("gpushare.node.dispatch")

Signaller = Callable[[ProcRef, int], None]
"""Sends signal ``sig`` to the process ``ref`` names (tests inject one that only records)."""
Refuser = Callable[[Conn, str, Refused], None]
"""The node's one refusal path (:meth:`gpushare.node.guard.Guard.refuse`)."""

# Escalations for which "freeze" stops the workload (over its memory limit it is logged).
FREEZES = frozenset({"no_yield_within_grace", "no_swap_out_within_grace"})

# The most a connection may have waiting in the node, unread by its peer, beyond what
# the kernel's socket buffer holds (~200 KiB): a frame is ~50-100 bytes, and a client
# reads every one at once, so only a peer that stopped reading comes near it.
WRITE_LIMIT = 1 << 20


def send_signal(ref: ProcRef, sig: int) -> None:
    pidfd_signal(ref, sig)


class Dispatch:
    def __init__(
        self,
        clock: Clock,
        events: EventBus,
        conns: dict[int, Conn],
        signaller: Signaller = send_signal,
        proc_root: Callable[[], str] = lambda: "/proc",
        refuse: Refuser | None = None,
        linked: Callable[[int], list[Arbiter]] | None = None,
    ) -> None:
        self.clock = clock
        # The GPUs whose decisions may follow from a GPU's (a gang on several GPUs:
        # core/coordinator.py): ticked after its own.
        self.linked = linked
        self.events = events
        self.conns = conns
        self.signaller = signaller
        self.proc_root = proc_root
        self.recovery: Recovery | None = None  # signs leases, keeps their floor on disk
        self.refuse = refuse
        self.write_limit = WRITE_LIMIT
        # per GPU: the deadline its timer is set for, and the timer
        self._timers: dict[int, tuple[float, asyncio.TimerHandle]] = {}
        self.timers_set = 0  # how many times a timer was set (the tests count them)

    def apply(self, arb: Arbiter, actions: list[Action], depth: int = 0) -> None:
        frames: dict[int, tuple[Conn, list[bytes]]] = {}  # per session, in order

        def send(c: Conn, msg: p.Message) -> None:
            frames.setdefault(c.session, (c, []))[1].append(p.encode(msg))

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
                c.may_hold_memory = True
                if a.thaw:
                    self._thaw(c)
                token = ""
                if self.recovery is not None:  # the floor on disk first, then the lease
                    self.recovery.lease_granted(arb.gpu, a.lease)
                    token = self.recovery.token(arb.gpu, a.session, a.lease)
                    # on record soon: only the lease on record at a crash comes back
                    self.recovery.save_soon()
                send(
                    c,
                    p.Grant(
                        lease=a.lease,
                        swap_in=a.swap_in,
                        quantum_s=a.quantum_s,
                        shared=a.shared,
                        room=a.room,
                        token=token,
                        resume=a.resume,
                        ask=c.ask,
                    ),
                )
            elif isinstance(a, ThawAction):
                self._thaw(c)
            elif isinstance(a, RevokeAction):
                send(c, p.Revoke(lease=a.lease, swap_out=a.swap_out, grace_s=a.grace_s))
            elif isinstance(a, SwapOutAction):
                send(c, p.SwapOut(bytes=a.bytes))
            elif isinstance(a, RoomAction):
                send(c, p.Room(room=a.room))
            elif isinstance(a, PrefetchAction):
                c.may_hold_memory = True
                send(c, p.Prefetch(room=a.room, seq=a.seq))
        for c, out in frames.values():  # one write per connection
            self._write(c, out[0] if len(out) == 1 else b"".join(out))
        self._schedule(arb)
        if self.linked is not None and depth < 4:
            for other in self.linked(arb.gpu):
                follow = other.tick()
                if follow:
                    self.apply(other, follow, depth + 1)
                else:
                    self._schedule(other)

    def _write(self, c: Conn, data: bytes) -> None:
        c.write(data)
        unread = c.unread_bytes()
        if unread <= self.write_limit or c.writer.is_closing():
            return
        err = Refused(
            "slow",
            f"session {c.session} left {unread} bytes of the node's messages unread (the"
            f" most is {self.write_limit}): a workload must read its connection; closed",
        )
        if self.refuse is not None:
            self.refuse(c, "workload", err)
        else:
            log.warning("%s", err)
        c.writer.transport.abort()  # it reads nothing: closing would wait for it forever

    def end_session(self, c: Conn, reason: str) -> None:
        """An administrator ends a session: it is told, thawed if frozen, and its
        connection closed (its reader sees the end; the detach follows from there)."""
        c.ended = True  # its detach says so: reason "ended"
        c.send(p.Error(code="ended", message=f"session ended: {reason}"))
        if c.frozen:
            self._thaw(c)
        c.writer.close()

    def close(self) -> None:
        for _, t in self._timers.values():
            t.cancel()
        self._timers.clear()

    def _escalate(self, a: EscalateAction, c: Conn | None) -> None:
        who = f"session {a.session}" + (f" (pid {c.pid})" if c else "")
        log.warning("escalation %s for %s: %s", a.escalation, who, a.reason)
        if c is None:
            return
        if a.escalation == "kill":
            if c.frozen:  # a stopped process dies only once continued
                self._thaw(c)
            self._signal(c, signal.SIGKILL)
            # And the session ends here: a process of another uid may hold its socket
            # too, and it is never signalled; it sees the connection end.
            c.writer.close()
        elif a.escalation == "freeze" and a.reason in FREEZES:
            c.frozen = True
            c.stopped = self._signal(c, signal.SIGSTOP)
            self._note_stopped(c)

    def _thaw(self, c: Conn) -> None:
        """Continue what the freeze stopped, and whatever holds the connection now."""
        stopped, c.stopped, c.frozen = c.stopped, [], False
        sent = self._signal(c, signal.SIGCONT)
        for ref in stopped:
            if ref not in sent:
                self.signaller(ref, signal.SIGCONT)
        if stopped:
            self._note_stopped(c)

    def _note_stopped(self, c: Conn) -> None:
        """What a freeze stopped goes on record now: a node that restarts continues it."""
        if c.record is not None:
            c.record = msgspec.structs.replace(
                c.record, stopped=[(r.pid, r.start_time) for r in c.stopped]
            )
        if self.recovery is not None:
            self.recovery.save()

    def _signal(self, c: Conn, sig: int) -> list[ProcRef]:
        """``sig`` to the session's workload; the processes it went to."""
        refs = [r for r in c.workload(self.proc_root()) if r.pid > 1]  # never init, 0, -1
        for ref in refs:
            self.signaller(ref, sig)
        return refs

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
            self.apply(arb, arb.tick())
        else:  # set for a deadline that went or moved later: nothing is due yet
            self._schedule(arb)

"""Dispatch: the one place the arbiters' decisions leave the node.

Each action goes where it belongs: a grant (signed, so that it can be claimed back after a
restart), revoke, room, swap-out or new limits to its session's connection, an event to the bus, an
escalation to the log and (freeze, kill) as a signal to the whole workload: every process
of the session's uid holding its connection, each reached through a pidfd, never a
process that took a pid since. A batch's frames for one connection leave in one write; a
connection whose peer does not read is not let to hold more than ``write_limit`` bytes
of the node's memory: it is refused and closed, and the others go on.

What must be on disk before its session hears it (a family's new limits; what a freeze
stops, before it is stopped) is written on the records' thread, never on the loop: that
connection's frames from there on are held back, in order, until the write is done, and
the SIGSTOP sent from the write's callback (if the session is still to be frozen then);
every other connection's frames go at once.

It only delivers: what follows from a batch (the GPUs' timers, the GPUs linked through a
gang ticked in turn) is :mod:`gpushare.node.decide.decisions`'.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections import deque
from collections.abc import Callable

import msgspec

from gpushare import protocol as p
from gpushare.core.actions import (
    Action,
    EscalateAction,
    EventAction,
    GrantAction,
    LimitsAction,
    PrefetchAction,
    RevokeAction,
    RoomAction,
    SwapOutAction,
    ThawAction,
)
from gpushare.core.arbiter import Arbiter
from gpushare.core.clock import Clock
from gpushare.node.guard import Conn, Refused
from gpushare.node.host.procs import ProcRef, pidfd_signal
from gpushare.node.keep.events import EventBus
from gpushare.node.keep.recovery import Recovery

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


class _Part:
    """A run of a connection's frames, in order: sent once it is open (the records write
    it waits for is on disk; open at once when it waits for none)."""

    __slots__ = ("frames", "open")

    def __init__(self, is_open: bool) -> None:
        self.open = is_open
        self.frames: list[bytes] = []


class Dispatch:
    def __init__(
        self,
        clock: Clock,
        events: EventBus,
        conns: dict[int, Conn],
        signaller: Signaller = send_signal,
        proc_root: Callable[[], str] = lambda: "/proc",
        refuse: Refuser | None = None,
    ) -> None:
        self.clock = clock
        self.events = events
        self.conns = conns
        self.signaller = signaller
        self.proc_root = proc_root
        self.recovery: Recovery | None = None  # signs leases, keeps their floor on disk
        self.refuse = refuse
        self.write_limit = WRITE_LIMIT
        # Per session: its connection and the parts held back behind a records write.
        self._behind: dict[int, tuple[Conn, deque[_Part]]] = {}
        self._freezing: dict[int, object] = {}  # per session: the freeze still to send

    def deliver(self, arb: Arbiter, actions: list[Action]) -> None:
        """``arb``'s actions, each where it belongs (a batch's frames for a connection in
        one write)."""
        frames: dict[int, tuple[Conn, list[_Part]]] = {}  # per session, in order
        for a in actions:
            if isinstance(a, EventAction):
                self.events.publish(a.record)
                continue
            c = self.conns.get(a.session)
            if isinstance(a, EscalateAction):
                self._escalate(a, c)
                continue
            if c is None:
                continue  # the session is gone: its actions have no one to go to
            msg = (
                self._grant(arb, c, a) if isinstance(a, GrantAction) else self._frame(c, a, frames)
            )
            if msg is not None:
                parts = frames.setdefault(c.session, (c, [_Part(True)]))[1]
                parts[-1].frames.append(p.encode(msg))
        for c, parts in frames.values():  # one write per connection
            self._queue(c, parts)

    def _frame(
        self, c: Conn, a: Action, frames: dict[int, tuple[Conn, list[_Part]]]
    ) -> p.Message | None:
        """What an action but a grant does to its session's connection, and the frame it
        sends it (None: none). A family's new limits first open a part of ``c``'s
        ``frames``, held back until their record is on disk: that frame and those after
        it go there."""
        if isinstance(a, ThawAction):
            self._thaw(c)
            return None
        if isinstance(a, RevokeAction):
            return p.Revoke(lease=a.lease, swap_out=a.swap_out, grace_s=a.grace_s)
        if isinstance(a, SwapOutAction):
            return p.SwapOut(bytes=a.bytes)
        if isinstance(a, RoomAction):
            return p.Room(room=a.room)
        if isinstance(a, PrefetchAction):
            c.may_hold_memory = True
            return p.Prefetch(room=a.room, seq=a.seq)
        if isinstance(a, LimitsAction):
            part = self._limits(c, a)
            if part is not None:
                frames.setdefault(c.session, (c, []))[1].append(part)
            return p.Limits(memory_limit=a.memory_limit, memory_request=a.memory_request)
        return None

    def _grant(self, arb: Arbiter, c: Conn, a: GrantAction) -> p.Grant:
        """A grant's frame: its session thawed first where it was frozen, and its lease
        on disk (signed, so that it can be claimed back after a restart) before its
        holder hears of it."""
        c.may_hold_memory = True
        if a.thaw:
            self._thaw(c)
        token = ""
        if self.recovery is not None:  # on disk before its holder hears of it
            self.recovery.granted(arb.gpu, a.session, a.lease)
            token = self.recovery.token(arb.gpu, a.session, a.lease)
            self.recovery.save_soon()  # and the rest of its record soon
        return p.Grant(
            lease=a.lease,
            swap_in=a.swap_in,
            quantum_s=a.quantum_s,
            shared=a.shared,
            room=a.room,
            token=token,
            resume=a.resume,
            ask=c.ask,
            bound=a.bound,
            idle_release_s=a.idle_release_s,
        )

    def _limits(self, c: Conn, a: LimitsAction) -> _Part | None:
        """A family's session has new limits: on record at once, with the family, so
        that a restarted node matches the session (by its new limit) and rebuilds it.
        The part its frames from here on go to, held back until that record is on disk
        (None: no records are kept)."""
        if c.record is not None:
            c.record = msgspec.structs.replace(c.record, limit=a.memory_limit, family=c.session)
        if self.recovery is None:
            return None
        # On disk before the session hears it: a node killed once it has would find no
        # record with its new limit, and take it for a stranger (and its member's part,
        # never given back, lost). Written on the records' thread: others' frames go on.
        part = _Part(False)

        def written(ok: bool) -> None:  # failed: said in the log; the session is told
            part.open = True
            self._flush(c)

        self.recovery.then(written)
        return part

    def _queue(self, c: Conn, parts: list[_Part]) -> None:
        """A batch's parts for ``c``, behind any of its frames still held back."""
        held = self._behind.get(c.session)
        if held is None or held[0] is not c:
            held = self._behind[c.session] = (c, deque())
        held[1].extend(parts)
        self._flush(c)

    def _flush(self, c: Conn) -> None:
        """``c``'s parts that are open, up to the first still held back, in one write."""
        held = self._behind.get(c.session)
        if held is None or held[0] is not c:
            return
        queue = held[1]
        out: list[bytes] = []
        while queue and queue[0].open:
            out += queue.popleft().frames
        if not queue or c.writer.is_closing():
            del self._behind[c.session]  # nothing held back (or no one to hear it)
        if out and not c.writer.is_closing():
            self._write(c, out[0] if len(out) == 1 else b"".join(out))

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

    def end_session(self, c: Conn, reason: str, grace_s: float = 0.0) -> None:
        """An administrator ends a session: it is told, thawed if frozen, and its
        connection closed (its reader sees the end; the detach follows from there).
        Given a grace, it is told so first (its program may shut down, answering what
        is in flight) and keeps its turns until then; a second end without one ends it
        at once."""
        if grace_s > 0:
            if c.ending is None and not c.ended:
                c.send(p.Ending(reason=reason, grace_s=grace_s))
                loop = asyncio.get_running_loop()
                c.ending = loop.call_later(grace_s, self._end_now, c, reason)
                c.ending_at = self.clock.monotonic() + grace_s
            return
        self._end_now(c, reason)

    def _end_now(self, c: Conn, reason: str) -> None:
        if c.ending is not None:
            c.ending.cancel()
            c.ending = None
        if c.ended or c.writer.is_closing():
            return  # ended, or gone by itself (its detach is on its way)
        c.ended = True  # its detach says so: reason "ended"
        c.send(p.Error(code="ended", message=f"session ended: {reason}"))
        if c.frozen:
            self._thaw(c)
        c.writer.close()

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
            self._freeze(c)

    def _freeze(self, c: Conn) -> None:
        """Stop the session's workload, once what it stops is on disk: a node that
        restarts continues it (a process stopped and not on record would stay stopped).
        The write is on the records' thread; the SIGSTOP goes from its callback, only if
        the session is still to be frozen then (not thawed, killed or gone meanwhile).
        A write that fails (said in the log) still lets the freeze go: the escalation
        is the node's rule, and the record goes with the next write that succeeds."""
        refs = [r for r in c.workload(self.proc_root()) if r.pid > 1]  # never init, 0, -1
        c.frozen, c.stopped = True, refs
        self._note_stopped(c)
        mark = self._freezing[c.session] = object()

        def stop(ok: bool) -> None:
            if self._freezing.get(c.session) is not mark:
                return  # thawed (or frozen again) since: that one's own
            del self._freezing[c.session]
            if c.frozen and self.conns.get(c.session) is c and not c.writer.is_closing():
                for ref in refs:
                    self.signaller(ref, signal.SIGSTOP)

        if self.recovery is None:
            stop(True)
        else:
            self.recovery.then(stop)

    def _thaw(self, c: Conn) -> None:
        """Continue what the freeze stopped, and whatever holds the connection now."""
        self._freezing.pop(c.session, None)  # a SIGSTOP not sent yet is not sent
        stopped, c.stopped, c.frozen = c.stopped, [], False
        sent = self._signal(c, signal.SIGCONT)
        for ref in stopped:
            if ref not in sent:
                self.signaller(ref, signal.SIGCONT)
        if stopped:
            self._note_stopped(c)
            if self.recovery is not None:  # a process continued twice comes to no harm
                self.recovery.then(lambda ok: None)

    def _note_stopped(self, c: Conn) -> None:
        """What a freeze stopped, on the session's record (written by the caller)."""
        if c.record is not None:
            c.record = msgspec.structs.replace(
                c.record, stopped=[(r.pid, r.start_time) for r in c.stopped]
            )

    def _signal(self, c: Conn, sig: int) -> list[ProcRef]:
        """``sig`` to the session's workload; the processes it went to."""
        refs = [r for r in c.workload(self.proc_root()) if r.pid > 1]  # never init, 0, -1
        for ref in refs:
            self.signaller(ref, sig)
        return refs

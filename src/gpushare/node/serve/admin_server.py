"""The admin socket: status, live settings, ending a session, the DRA plugin's prepared
claims (serve/prepared_claims), the event stream. Each
request is decoded, checked (the peer may administer, at a bounded rate) and answered;
settings go to the arbiters and their actions to the node's decisions, like every
other input."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

from gpushare import protocol as p
from gpushare.core.arbiter import Arbiter, ArbiterError
from gpushare.core.clock import Clock
from gpushare.node.decide.decisions import Decisions
from gpushare.node.decide.dispatch import Dispatch
from gpushare.node.guard import Conn, Guard, Refused
from gpushare.node.host.sockets import Idle, Unfinished, read_frame_within
from gpushare.node.keep.events import EventBus
from gpushare.node.observe.snapshot import StatusFrames
from gpushare.node.serve.live_config import LiveConfig, NotPersisted
from gpushare.node.serve.prepared_claims import PreparedClaims, check
from gpushare.settings import SettingsError, check_end_grace, validate
from gpushare.status import NodeStatus

log = logging.getLogger("gpushare.node.admin_server")

# Every connection holds a task and a descriptor, so none is held for good: the first
# request must come within hello_timeout, each request be whole within hello_timeout of
# its first byte, and a connection between requests (a `gpushare top` polling) or a
# reader not reading what it asked for (a stalled `ctl events --follow`) waits at most
# IDLE_S. A follower reading its events is never timed out.
IDLE_S = 300.0
# Admin connections open at once (followers included); more are refused `busy`.
MAX_CONNECTIONS = 64


class AdminServer:
    def __init__(
        self,
        *,
        live: LiveConfig,
        arbiters: Sequence[Arbiter],
        conns: dict[int, Conn],
        guard: Guard,
        dispatch: Dispatch,
        decisions: Decisions,
        events: EventBus,
        status: Callable[[], NodeStatus],
        clock: Clock,
        claims: PreparedClaims | None = None,
    ) -> None:
        self.live, self.arbiters, self.conns = live, arbiters, conns
        self.guard, self.dispatch, self.events = guard, dispatch, events
        self.decisions = decisions
        self.status, self.clock = status, clock
        self.claims = claims if claims is not None else PreparedClaims()
        self.status_frames = StatusFrames(status, clock.monotonic)
        self.open = 0  # connections now
        self._files: ThreadPoolExecutor | None = None  # one write at a time, in order

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            conn = self.guard.accept(writer)
        except OSError:  # gone before the kernel could say who it was
            writer.close()
            return
        self.open += 1
        frame_s = self.live.config.hello_timeout
        idle = frame_s  # for the first request; IDLE_S between the next ones
        try:
            if self.open > MAX_CONNECTIONS:
                raise Refused(
                    "busy",
                    f"{MAX_CONNECTIONS} admin connections are open, the most allowed"
                    " (ctl events --follow readers and gpushare top count): close some",
                )
            self.guard.check_admin(conn)
            while True:
                try:
                    msg = await read_frame_within(reader, idle, frame_s)
                except Unfinished:
                    raise Refused(
                        "timeout",
                        f"a request not whole within {frame_s:g} s of its first byte"
                        " (hello_timeout): send each frame at once",
                    ) from None
                idle = IDLE_S
                await self.guard.spend(conn)
                if isinstance(msg, p.EventsRequest):  # the connection's last request
                    await self.serve_events(conn, msg, reader)
                    return
                await self.answer(conn, msg)
                await drained(writer)
        except (asyncio.IncompleteReadError, ConnectionError, Idle, TimeoutError, _Gone):
            pass  # gone, idle too long (it may connect again), or not reading its answers
        except (Refused, p.ProtocolError) as e:
            self.guard.refuse(conn, "admin", e)
        finally:
            self.open -= 1
            writer.close()

    async def answer(self, conn: Conn, msg: p.Message) -> None:
        if isinstance(msg, p.StatusRequest):  # bounded in cost (snapshot.py)
            conn.write(await self.status_frames.take())
        elif isinstance(msg, p.SetConfig):
            reply = self.set_config(msg)
            if msg.persist and isinstance(reply, p.ConfigReply):
                reply = await self.persist(msg, reply)
            conn.send(reply)
        elif isinstance(msg, p.EndSession):
            conn.send(self.end_session(msg))
        elif isinstance(msg, p.PrepareClaim):
            conn.send(self.prepare_claim(msg))
        elif isinstance(msg, p.UnprepareClaim):
            conn.send(self.unprepare_claim(msg))
        elif isinstance(msg, p.Hello):
            raise p.ProtocolError(
                f"{self.live.config.admin_socket} is this node's admin socket:"
                " workloads (gpushare run, gpushare.attach) attach at its workload"
                f" socket, {self.live.config.socket} (--socket, or GPUSHARE_SOCKET)"
            )
        else:
            raise p.ProtocolError(f"{type(msg).__name__} is not an admin request")

    def end_session(self, m: p.EndSession) -> p.Message:
        c = self.conns.get(m.session)
        if c is None:
            return p.Error(code="session", message=f"no session {m.session} on this node")
        try:
            grace = check_end_grace(m.grace_s)
        except SettingsError as e:
            return p.Error(code="value", message=f"{e} (ctl end --grace)")
        return p.Done(message=self._end(c, m.reason, grace))

    def _end(self, c: Conn, reason: str, grace: float) -> str:
        """End one session (``grace``: told first, its turns kept meanwhile): what
        became of it."""
        if grace > 0 and c.ending is not None:  # one grace: a second end shortens none
            left = max(0.0, c.ending_at - self.clock.monotonic())
            return f"session {c.session} ending already: ended in {left:.0f} s"
        if grace > 0 and not c.ended:
            log.warning("ending session %d (pid %d) in %g s: %s", c.session, c.pid, grace, reason)
            self.dispatch.end_session(c, reason, grace)
            return (
                f"session {c.session} ending: it keeps its turns for {grace:g} s, then it is ended"
            )
        log.warning("ending session %d (pid %d): %s", c.session, c.pid, reason)
        self.dispatch.end_session(c, reason)
        return f"session {c.session} ended"

    def prepare_claim(self, m: p.PrepareClaim) -> p.Message:
        """A claim the plugin prepared, kept once checked (:class:`p.ProtocolError` for
        a field out of bounds: nothing kept)."""
        c = check(m, len(self.arbiters))
        said = self.claims.prepare(c)
        if said != "prepared already":
            log.info("claim %s/%s (%s) %s on GPU %d", c.namespace, c.name, c.uid, said, c.gpu)
        return p.Done(message=f"claim {c.namespace}/{c.name} {said}")

    def unprepare_claim(self, m: p.UnprepareClaim) -> p.Message:
        """A claim done with: forgotten (no new session names it), its sessions ended."""
        try:
            grace = check_end_grace(m.grace_s)
        except SettingsError as e:
            return p.Error(code="value", message=f"{e} (unprepare_claim grace_s)")
        c = self.claims.unprepare(m.uid)
        ending = [x for x in self.conns.values() if m.uid and x.claim == m.uid and not x.ended]
        said = [self._end(x, m.reason, grace) for x in ending]
        what = f"claim {c.namespace}/{c.name}" if c else f"claim {m.uid[:40]}"
        if c is None and not said:
            return p.Done(message=f"{what} is not prepared on this node: nothing to do")
        return p.Done(message=f"{what} unprepared" + "".join(f"; {s}" for s in said))

    def set_config(self, m: p.SetConfig) -> p.Message:
        """``m`` applied live; :meth:`persist` writes it to the file after."""
        if m.gpu is not None and not 0 <= m.gpu < len(self.arbiters):
            n = len(self.arbiters)
            message = f"no GPU {m.gpu} on this node (it has {n}: --gpu 0..{n - 1})"
            self.live.refused("ctl", message)
            return p.Error(code="gpu", message=message)
        try:  # all of it checked before any GPU changes
            change = validate(tq_s=m.tq_s, mode=m.mode, policy=m.policy, escalation=m.escalation)
        except SettingsError as e:
            self.live.refused("ctl", str(e))
            return p.Error(code="value", message=str(e))
        targets = self.arbiters if m.gpu is None else [self.arbiters[m.gpu]]
        try:
            for arb in targets:
                self.decisions.act(arb, arb.set_config(change))
        except ArbiterError as e:
            return p.Error(code="value", message=str(e))
        for arb in targets:
            s = arb.settings
            log.info(
                "GPU %d: TQ %g s, mode %s, policy %s (from next quantum)",
                arb.gpu,
                s.tq_s,
                s.mode,
                s.policy,
            )
        return p.ConfigReply(
            gpus=[
                p.GpuConfig(
                    index=a.gpu,
                    tq_s=a.settings.tq_s,
                    mode=a.settings.mode,
                    policy=a.settings.policy,
                    escalation=a.settings.escalation,
                )
                for a in targets
            ],
        )

    async def persist(self, m: p.SetConfig, reply: p.ConfigReply) -> p.Message:
        """``m``'s change (applied live already) written to the node's file: on a
        thread of its own, one at a time (each reads, edits and writes the file), by
        ``run_in_executor`` (which virtual time waits for, as for the records). The
        write ends in an fsync (seconds while a checkpoint
        fills the disk beside the node), and no grant may wait behind it."""
        change = validate(tq_s=m.tq_s, mode=m.mode, policy=m.policy, escalation=m.escalation)
        try:
            if self._files is None:
                self._files = ThreadPoolExecutor(1, thread_name_prefix="gpushare-config")
            loop = asyncio.get_running_loop()
            persisted = await loop.run_in_executor(self._files, self.live.persist, m.gpu, change)
        except NotPersisted as e:
            return p.Error(code="persist", message=str(e))
        return msgspec.structs.replace(reply, persisted_to=persisted)

    async def serve_events(
        self, conn: Conn, m: p.EventsRequest, reader: asyncio.StreamReader
    ) -> None:
        """The backlog (since ``since_s`` ago, of one session), the end marker, then with
        ``follow`` live events until the node stops or this reader falls too far behind
        (then an error frame says so, and the connection ends)."""
        since = self.clock.wall() - m.since_s if m.since_s is not None else None
        f = self.events.follow() if m.follow else None
        try:
            for rec in self.events.select(since, m.session):
                conn.send(p.EventMsg(event=rec))
            conn.send(p.EventsEnd())
            await drained(conn.writer)
            if f is None:
                return
            # A follower says nothing more: anything it sends, or its end, ends the
            # stream at once (not at the next event: its connection counts till then).
            gone: asyncio.Future[Any] = asyncio.ensure_future(reader.read(1))
            try:
                while (live := await _next(f.queue, gone)) is not None:
                    if m.session is None or live.get("session") == m.session:
                        conn.send(p.EventMsg(event=live))
                        await drained(conn.writer)
            finally:
                gone.cancel()
            if f.dropped:
                conn.send(
                    p.Error(
                        code="behind",
                        message=(
                            f"dropped: this reader fell {f.limit} events behind the node;"
                            " read faster (or narrow it with --session) and follow again"
                        ),
                    )
                )
                await drained(conn.writer)
        finally:
            if f is not None:
                self.events.unfollow(f)


async def drained(writer: asyncio.StreamWriter) -> None:
    """What was written taken by the peer, within :data:`IDLE_S` (else TimeoutError: a
    peer that asks and never reads does not hold the node's buffers for good)."""
    await asyncio.wait_for(writer.drain(), IDLE_S)


class _Gone(Exception):
    """The peer sent something, or hung up."""


async def _next(
    queue: asyncio.Queue[dict[str, Any] | None], gone: asyncio.Future[Any]
) -> dict[str, Any] | None:
    """The next event queued, or :class:`_Gone` once ``gone`` is done first."""
    if not queue.empty():
        return queue.get_nowait()
    task: asyncio.Future[Any] = asyncio.ensure_future(queue.get())
    await asyncio.wait([task, gone], return_when=asyncio.FIRST_COMPLETED)
    if not task.done():
        task.cancel()
        raise _Gone()
    live: dict[str, Any] | None = task.result()
    return live

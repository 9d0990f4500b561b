"""The admin socket: status, live settings, ending a session, the event stream. Each
request is decoded, checked (the peer may administer, at a bounded rate) and answered;
settings go to the arbiters and their actions to the node's decisions, like every
other input."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from gpushare import protocol as p
from gpushare.core.arbiter import Arbiter, ArbiterError
from gpushare.core.clock import Clock
from gpushare.node.decisions import Decisions
from gpushare.node.dispatch import Dispatch
from gpushare.node.events import EventBus
from gpushare.node.guard import Conn, Guard, Refused
from gpushare.node.live_config import LiveConfig, NotPersisted
from gpushare.node.snapshot import StatusFrames
from gpushare.node.sockets import read_frame
from gpushare.settings import SettingsError, validate
from gpushare.status import NodeStatus

log = logging.getLogger("gpushare.node.admin_server")


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
    ) -> None:
        self.live, self.arbiters, self.conns = live, arbiters, conns
        self.guard, self.dispatch, self.events = guard, dispatch, events
        self.decisions = decisions
        self.status, self.clock = status, clock
        self.status_frames = StatusFrames(status, clock.monotonic)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = self.guard.accept(writer)
        try:
            self.guard.check_admin(conn)
            while True:
                msg = await asyncio.wait_for(read_frame(reader), 3600)
                await self.guard.spend(conn)
                if isinstance(msg, p.StatusRequest):  # bounded in cost (snapshot.py)
                    conn.write(await self.status_frames.take())
                elif isinstance(msg, p.SetConfig):
                    conn.send(self.set_config(msg))
                elif isinstance(msg, p.EndSession):
                    conn.send(self.end_session(msg))
                elif isinstance(msg, p.EventsRequest):
                    await self.serve_events(conn, msg)
                    return
                elif isinstance(msg, p.Hello):
                    raise p.ProtocolError(
                        f"{self.live.config.admin_socket} is this node's admin socket:"
                        " workloads (gpushare run, gpushare.attach) attach at its workload"
                        f" socket, {self.live.config.socket} (--socket, or GPUSHARE_SOCKET)"
                    )
                else:
                    raise p.ProtocolError(f"{type(msg).__name__} is not an admin request")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            pass
        except (Refused, p.ProtocolError) as e:
            self.guard.refuse(conn, "admin", e)
        finally:
            writer.close()

    def end_session(self, m: p.EndSession) -> p.Message:
        c = self.conns.get(m.session)
        if c is None:
            return p.Error(code="session", message=f"no session {m.session} on this node")
        log.warning("ending session %d (pid %d): %s", m.session, c.pid, m.reason)
        self.dispatch.end_session(c, m.reason)
        return p.Done(message=f"session {m.session} ended")

    def set_config(self, m: p.SetConfig) -> p.Message:
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
        persisted = ""
        if m.persist:
            try:
                persisted = self.live.persist(m.gpu, change)
            except NotPersisted as e:
                return p.Error(code="persist", message=str(e))
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
            persisted_to=persisted,
        )

    async def serve_events(self, conn: Conn, m: p.EventsRequest) -> None:
        """The backlog (since ``since_s`` ago, of one session), the end marker, then with
        ``follow`` live events until the node stops or this reader falls too far behind
        (then an error frame says so, and the connection ends)."""
        since = self.clock.wall() - m.since_s if m.since_s is not None else None
        f = self.events.follow() if m.follow else None
        try:
            for rec in self.events.select(since, m.session):
                conn.send(p.EventMsg(event=rec))
            conn.send(p.EventsEnd())
            await conn.writer.drain()
            if f is None:
                return
            while (live := await f.queue.get()) is not None:
                if m.session is None or live.get("session") == m.session:
                    conn.send(p.EventMsg(event=live))
                    await conn.writer.drain()
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
                await conn.writer.drain()
        finally:
            if f is not None:
                self.events.unfollow(f)

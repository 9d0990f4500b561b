"""The connection guard: who is at the other end of a connection (the kernel's word, not
the client's), how fast it may talk, how many connections a uid may keep waiting for a
hello and how many sessions it may hold, who may administer (and from where), and the one
way a request is refused (logged and made an event at a bounded rate, an error frame)."""

from __future__ import annotations

import asyncio
import grp
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from gpushare import protocol as p
from gpushare.core import events as typed
from gpushare.core.clock import Clock
from gpushare.node.config import NodeConfig
from gpushare.node.events import EventBus
from gpushare.node.identity import CgroupIdentity, groups_of, peer_credentials, read_identity
from gpushare.node.procs import ProcRef, holders_of, peer_inode, ref_of
from gpushare.node.recovery import SessionRecord
from gpushare.status import Claimed

log = logging.getLogger("gpushare.node.guard")


@dataclass
class Conn:
    writer: asyncio.StreamWriter
    pid: int
    uid: int
    gid: int
    session: int = 0
    gpu: int = 0
    claimed: Claimed = field(default_factory=Claimed)  # what the client says it is
    identity: CgroupIdentity = field(default_factory=CgroupIdentity)  # what the kernel says
    verified: bool = False  # the claimed pod UID is the kernel's
    rank: int = -1  # its rank in its gang, as its client says (shown)
    ask: int = 0  # the number of its last ask read (echoed by grants; 0: not numbered)
    frozen: bool = False
    ended: bool = False  # an administrator ended its session (ctl end)
    tokens: float = 0.0
    refilled: float = 0.0
    proc: ProcRef | None = None  # the connecting process, named for good (start time)
    pending: bool = False  # counted among the connections that have not said hello yet
    stopped: list[ProcRef] = field(default_factory=list)  # what a freeze stopped
    names: tuple[str, str, str] | None = None  # the API's names, pinned once seen
    weight_source: str = ""
    record: SessionRecord | None = None  # what a restarted node recovers it from
    # It may have memory on the GPU: on record from before a restart, or granted a lease
    # or prefetch room since it attached. Until then its reports of memory are refused.
    may_hold_memory: bool = False

    def send(self, msg: p.Message) -> None:
        self.write(p.encode(msg))

    def write(self, data: bytes) -> None:
        """Frames, already encoded, in one write."""
        if not self.writer.is_closing():
            self.writer.write(data)

    def unread_bytes(self) -> int:
        """What waits in the node for the peer to read (beyond the kernel's buffer)."""
        return self.writer.transport.get_write_buffer_size()

    def workload(self, proc_root: str) -> list[ProcRef]:
        """Every process of this session's uid holding its connection: the one that
        attached and each child that inherited the socket (a DataLoader worker)."""
        refs = [self.proc] if self.proc is not None else []
        sock = self.writer.get_extra_info("socket")
        inode = peer_inode(sock) if sock is not None else 0
        if inode:
            refs += [r for r in holders_of(inode, self.uid, proc_root) if r not in refs]
        return refs

    def spend(self, rate: float, now: float) -> float:
        """One message from the token bucket (``rate``/s, bursts of twice that): the
        seconds to wait before reading on (0: at once). The bucket goes into debt, so
        a connection that keeps sending is read at ``rate`` and no faster."""
        self.tokens = min(2 * rate, self.tokens + (now - self.refilled) * rate) - 1
        self.refilled = now
        return 0.0 if self.tokens >= 0 else -self.tokens / rate


class Refused(Exception):
    """A request this connection may not make; it is answered, logged, and closed."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class RateLimit:
    """At most ``rate`` per second (bursts of as many); what is held back is counted and
    said with the next that passes."""

    def __init__(self, rate: float) -> None:
        self.rate, self.tokens, self.last, self.held = rate, rate, 0.0, 0

    def allow(self, now: float) -> int | None:
        """None: hold this one back; else the number held back since the last allowed."""
        self.tokens = min(self.rate, self.tokens + (now - self.last) * self.rate)
        self.last = now
        if self.tokens < 1:
            self.held += 1
            return None
        self.tokens -= 1
        held, self.held = self.held, 0
        return held


def _placement(i: CgroupIdentity) -> tuple[str, str]:
    """Where a process runs, as its cgroup says: a pod, a container, the host; or
    unknown (its cgroup could not be read)."""
    if i.pod_uid:
        return "pod", i.pod_uid
    if i.container_id:
        return "container", i.container_id
    return ("host", "") if i.cgroup_version else ("unknown", "")


def admin_gid(config: NodeConfig) -> int | None:
    g = config.admin_group
    if not g:
        return None
    return int(g) if g.isdigit() else grp.getgrnam(g).gr_gid


class Guard:
    def __init__(
        self,
        config: Callable[[], NodeConfig],
        clock: Clock,
        events: EventBus,
        conns: dict[int, Conn],
    ) -> None:
        self._config = config
        self.clock = clock
        self.events = events
        self.conns = conns
        self.pending: dict[int, int] = {}  # connections without a hello yet, per uid
        self.pending_total = 0
        self.slowed = 0  # messages read late for their connection's rate
        self._refusals = RateLimit(20.0)  # log lines and events per second

    def accept(self, writer: asyncio.StreamWriter) -> Conn:
        """A connection, with its peer from the kernel and a full message allowance."""
        cfg = self._config()
        peer = peer_credentials(writer.get_extra_info("socket"))
        rate = cfg.max_messages_per_s
        return Conn(
            writer,
            peer.pid,
            peer.uid,
            peer.gid,
            tokens=2 * rate,
            refilled=self.clock.monotonic(),
            proc=ref_of(peer.pid, cfg.proc_root) if peer.pid > 0 else None,
        )

    def admit(self, conn: Conn) -> None:
        """Count a connection that has not said hello yet, or :class:`Refused` when its
        uid (or everyone) has as many as allowed waiting already."""
        cfg = self._config()
        mine = self.pending.get(conn.uid, 0)
        if mine >= cfg.max_pending_per_uid or self.pending_total >= cfg.max_pending:
            which = (
                f"uid {conn.uid} has {mine} connections"
                if mine >= cfg.max_pending_per_uid
                else f"{self.pending_total} connections are"
            )
            raise Refused(
                "busy",
                f"{which} open without a hello, the most allowed (max_pending_per_uid,"
                " max_pending): say hello at once, or close them",
            )
        self.pending[conn.uid] = mine + 1
        self.pending_total += 1
        conn.pending = True

    def said_hello(self, conn: Conn) -> None:
        """The connection is no longer waiting for its hello (it said it, or it ended)."""
        if conn.pending:
            conn.pending = False
            self.pending_total -= 1
            left = self.pending[conn.uid] - 1
            if left:
                self.pending[conn.uid] = left
            else:
                del self.pending[conn.uid]

    async def spend(self, conn: Conn) -> None:
        """One message's allowance: a connection over ``max_messages_per_s`` is not read
        for a while (its messages wait in its socket, and its client's sends block), so
        a fast client is slowed down, never ended for it, and the node's loop serves
        everyone else meanwhile."""
        wait = conn.spend(self._config().max_messages_per_s, self.clock.monotonic())
        if wait > 0:
            self.slowed += 1
            await asyncio.sleep(wait)

    def check_sessions_of_uid(self, conn: Conn) -> None:
        mine = sum(1 for c in self.conns.values() if c.uid == conn.uid)
        if mine >= self._config().max_sessions_per_uid:
            raise Refused(
                "limit",
                f"uid {conn.uid} has {mine} sessions, the most allowed"
                " (max_sessions_per_uid): close some first",
            )

    def check_admin(self, conn: Conn) -> None:
        # The socket's mode already keeps others out; the peer check holds even if the
        # mode was loosened by hand. And uid 0 is not enough: a root container that
        # reached the socket is not the host, nor the node's own pod.
        cfg = self._config()
        self._check_admin_user(conn, cfg)
        peer = _placement(
            read_identity(conn.pid, cfg.proc_root) if conn.pid > 0 else CgroupIdentity()
        )
        own = _placement(read_identity(os.getpid(), cfg.proc_root))
        if peer == own or peer == ("host", ""):
            return
        where = f"{peer[0]} {peer[1]}".strip()
        raise Refused(
            "denied",
            f"pid {conn.pid} runs in {where}: this node is administered only from the host"
            " or its own pod (kubectl exec into the gpushare-node pod)",
        )

    def _check_admin_user(self, conn: Conn, cfg: NodeConfig) -> None:
        if conn.uid in (0, os.geteuid()):
            return
        gid = admin_gid(cfg)
        if gid is not None and (conn.gid == gid or gid in groups_of(conn.pid, cfg.proc_root)):
            return
        group = f" or a member of group {cfg.admin_group}" * bool(cfg.admin_group)
        raise Refused(
            "denied",
            f"uid {conn.uid} may not administer this node: run as root, uid {os.geteuid()}{group}",
        )

    def refuse(self, conn: Conn, where: str, error: Refused | p.ProtocolError) -> None:
        """Log a refusal, make it an event, then answer it (in that order: whoever reads
        the answer finds the event already written). A message that breaks the protocol
        is refused with code ``protocol``."""
        code = error.code if isinstance(error, Refused) else "protocol"
        message = str(error)
        held = self._refusals.allow(self.clock.monotonic())
        if held is not None:  # a flood of refusals is logged at a bounded rate
            more = f" ({held} more refusals not logged)" if held else ""
            log.warning(
                "refused pid %d uid %d on the %s socket: %s%s",
                conn.pid,
                conn.uid,
                where,
                message,
                more,
            )
            self.events.publish(
                typed.record(
                    typed.Refused(
                        session=conn.session or None,
                        pid=conn.pid,
                        uid=conn.uid,
                        socket=where,
                        code=code,
                        reason=message,
                        not_logged=held or None,
                    ),
                    ts=self.clock.wall(),
                    gpu=None,
                )
            )
        conn.send(p.Error(code=code, message=message))

"""The connection guard: who is at the other end of a connection (the kernel's word, not
the client's), how fast it may talk, how many sessions a uid may hold, who may
administer, and the one way a request is refused (logged, an event, an error frame)."""

from __future__ import annotations

import asyncio
import grp
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from gpushare import protocol as p
from gpushare.core.clock import Clock
from gpushare.node.config import NodeConfig
from gpushare.node.events import EventBus
from gpushare.node.identity import CgroupIdentity, groups_of, peer_credentials
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
    frozen: bool = False
    tokens: float = 0.0
    refilled: float = 0.0

    def send(self, msg: p.Message) -> None:
        if not self.writer.is_closing():
            self.writer.write(p.encode(msg))

    def spend(self, rate: float, now: float) -> bool:
        """One message from the token bucket (``rate``/s, bursts of twice that)."""
        self.tokens = min(2 * rate, self.tokens + (now - self.refilled) * rate)
        self.refilled = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


class Refused(Exception):
    """A request this connection may not make; it is answered, logged, and closed."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


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

    def accept(self, writer: asyncio.StreamWriter) -> Conn:
        """A connection, with its peer from the kernel and a full message allowance."""
        peer = peer_credentials(writer.get_extra_info("socket"))
        rate = self._config().max_messages_per_s
        return Conn(
            writer, peer.pid, peer.uid, peer.gid, tokens=2 * rate, refilled=self.clock.monotonic()
        )

    def spend(self, conn: Conn, where: str) -> None:
        """One message's allowance, or :class:`Refused`."""
        rate = self._config().max_messages_per_s
        if conn.spend(rate, self.clock.monotonic()):
            return
        if where == "admin":
            raise Refused("rate", "too many admin requests per second: slow down")
        raise Refused("rate", f"more than {rate:g} messages per second: slow down")

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
        # mode was loosened by hand.
        cfg = self._config()
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
        log.warning(
            "refused pid %d uid %d on the %s socket: %s", conn.pid, conn.uid, where, message
        )
        self.events.publish(
            {
                "ts": self.clock.wall(),
                "gpu": None,
                "event": "refused",
                "session": conn.session or None,
                "pid": conn.pid,
                "uid": conn.uid,
                "socket": where,
                "code": code,
                "reason": message,
            }
        )
        conn.send(p.Error(code=code, message=message))

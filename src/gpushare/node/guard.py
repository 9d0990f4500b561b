"""The connection guard: who is at the other end of a connection (the kernel's word, not
the client's), how fast it may talk, how many connections a uid may keep waiting for a
hello and how many sessions it may hold, who may administer (and from where), and the one
way a request is refused (logged and made an event at a bounded rate, an error frame)."""

from __future__ import annotations

import asyncio
import collections
import grp
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from gpushare import protocol as p
from gpushare.core import events as typed
from gpushare.core.clock import Clock
from gpushare.node.host.identity import CgroupIdentity, groups_of, peer_credentials, read_identity
from gpushare.node.host.procs import ProcRef, holders_of, peer_inode, ref_of
from gpushare.node.keep.config import NodeConfig
from gpushare.node.keep.events import EventBus
from gpushare.node.keep.recovery import SessionRecord
from gpushare.status import Claimed

log = logging.getLogger("gpushare.node.guard")

# Connections of a uid that may wait in line for room to say hello in, as a multiple of
# max_pending_per_uid (of max_pending, all uids together): each holds a descriptor, so
# the line is short; past it a connection is refused `busy` (its client tries again).
LINE_FACTOR = 4
# Messages a connection's handler reads in a row before it lets the loop serve others
# (frames already in its buffer are read without waiting: a client that wrote thousands
# kept the loop for all of them).
YIELD_EVERY = 32


class Bucket:
    """A token bucket (``rate``/s, bursts of twice that) that goes into debt, so that
    whoever keeps drawing on it is held to ``rate`` and no faster."""

    __slots__ = ("refilled", "tokens")

    def __init__(self, rate: float, now: float) -> None:
        self.tokens, self.refilled = 2 * rate, now

    def spend(self, rate: float, now: float) -> float:
        """One from the bucket: the seconds to wait before going on (0: at once)."""
        self.tokens = min(2 * rate, self.tokens + (now - self.refilled) * rate) - 1
        self.refilled = now
        return 0.0 if self.tokens >= 0 else -self.tokens / rate


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
    claim: str = ""  # the DRA ResourceClaim UID it attached by (serve/prepared_claims)
    resident_model: str = ""  # how its resident bytes are modelled (a simulated GPU's)
    rank: int = -1  # its rank in its gang, as its client says (shown)
    ask: int = 0  # the number of its last ask read (echoed by grants; 0: not numbered)
    frozen: bool = False
    ended: bool = False  # an administrator ended its session (ctl end)
    ending: asyncio.TimerHandle | None = None  # ctl end's grace: the end to come
    ending_at: float = 0.0  # when it comes (the node's monotonic clock)
    bucket: Bucket | None = None  # its own message allowance
    budget: Bucket | None = None  # its user's, shared by all its connections (a session's)
    who: str = ""  # whose budget it draws on
    streak: int = 0  # messages read since its handler last let the loop go
    proc: ProcRef | None = None  # the connecting process, named for good (start time)
    pending: bool = False  # counted among the connections that have not said hello yet
    stopped: list[ProcRef] = field(default_factory=list)  # what a freeze stopped
    names: tuple[str, str, str] | None = None  # the API's names, pinned once seen
    weight_source: str = ""
    sharing_source: str = ""  # where its compute-sharing mode comes from ("": none)
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


def _expire(turn: asyncio.Future[None]) -> None:
    if not turn.done():
        turn.set_exception(TimeoutError())


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
        self.slowed = 0  # messages read late for their connection's (or user's) rate
        # Connections waiting for room to say hello in, per uid, and the uids' turns:
        # the room there is goes to one uid after another, so that a burst (or a flood)
        # of one uid waits behind itself, never ahead of another uid's attach.
        self.lines: dict[int, collections.deque[asyncio.Future[None]]] = {}
        self._turns: collections.deque[int] = collections.deque()
        self.waiting = 0
        self.sessions: dict[int, int] = {}  # sessions per uid (max_sessions_per_uid)
        # Each user's message budget (a pod, by its UID; else a uid), and its connections.
        self._budgets: dict[str, tuple[Bucket, int]] = {}
        self._refusals = RateLimit(20.0)  # log lines and events per second

    def accept(self, writer: asyncio.StreamWriter, name: bool = True) -> Conn:
        """A connection, with its peer from the kernel and a full message allowance;
        its process named for good (:meth:`name`) now, or later."""
        cfg = self._config()
        peer = peer_credentials(writer.get_extra_info("socket"))
        conn = Conn(
            writer,
            peer.pid,
            peer.uid,
            peer.gid,
            bucket=Bucket(cfg.max_messages_per_s, self.clock.monotonic()),
        )
        if name:
            self.name(conn)
        return conn

    def name(self, conn: Conn) -> None:
        if conn.pid > 0:
            conn.proc = ref_of(conn.pid, self._config().proc_root)

    def _room(self, uid: int) -> bool:
        cfg = self._config()
        return (
            self.pending.get(uid, 0) < cfg.max_pending_per_uid
            and self.pending_total < cfg.max_pending
        )

    def _count(self, conn: Conn) -> None:
        self.pending[conn.uid] = self.pending.get(conn.uid, 0) + 1
        self.pending_total += 1
        conn.pending = True

    def may_wait(self, conn: Conn) -> None:
        """:class:`Refused` (``busy``) where the connection could not even wait in line
        for room to say hello in (at once, before anything is spent on it)."""
        cfg = self._config()
        if self._room(conn.uid) and conn.uid not in self.lines:
            return
        mine = self.pending.get(conn.uid, 0)
        queued = len(self.lines.get(conn.uid, ()))
        if (
            queued >= LINE_FACTOR * cfg.max_pending_per_uid
            or self.waiting >= LINE_FACTOR * cfg.max_pending
        ):
            which = (
                f"uid {conn.uid} has {mine} connections"
                if mine >= cfg.max_pending_per_uid
                else f"{self.pending_total} connections are"
            )
            raise Refused(
                "busy",
                f"{which} open without a hello, the most allowed (max_pending_per_uid,"
                f" max_pending), and {queued} more wait: say hello at once, or close them",
            )

    async def admit(self, conn: Conn) -> None:
        """Count a connection that is to say hello now. Where its uid (or everyone) has
        as many as allowed doing so, it waits in its uid's line (its hello unread, its
        hello_timeout not begun) until one of them is done; uids take the room in turn.
        One that waited hello_timeout is refused ``busy`` (its client tries again)."""
        self.may_wait(conn)
        if self._room(conn.uid) and conn.uid not in self.lines:
            self._count(conn)
            return
        line = self.lines.get(conn.uid)
        if line is None:
            line = self.lines[conn.uid] = collections.deque()
            self._turns.append(conn.uid)
        loop = asyncio.get_running_loop()
        turn: asyncio.Future[None] = loop.create_future()
        line.append(turn)
        self.waiting += 1
        timeout = self._config().hello_timeout
        # A timer rather than wait_for(shield()): those take three turns of the loop to
        # wake the handler, all the while holding the room it was given (a burst on a
        # busy node was served slower, and refused more, with the line than without).
        timer = loop.call_later(timeout, _expire, turn)
        try:
            await turn
        except TimeoutError:
            raise Refused(
                "busy",
                f"waited {timeout:g} s in line for room to say hello in (uid {conn.uid} has"
                f" {self.pending.get(conn.uid, 0)} connections open without a hello:"
                " max_pending_per_uid): try again",
            ) from None
        finally:
            timer.cancel()
            if turn.done() and not turn.cancelled() and turn.exception() is None:
                conn.pending = True  # its turn came: the waker counted it, took it off
            else:
                turn.cancel()
                line.remove(turn)
                self.waiting -= 1
                if not line:
                    self._drop_line(conn.uid)

    def end_lines(self) -> None:
        """The node is stopping: every connection waiting in line ends now (it is told
        ``busy``, and its client tries the next node)."""
        for line in self.lines.values():
            for turn in line:
                _expire(turn)

    def _drop_line(self, uid: int) -> None:
        del self.lines[uid]
        self._turns.remove(uid)

    def _wake(self) -> None:
        """Connections waiting in line take the room there is, one uid after another."""
        stuck = 0
        while self._turns and stuck < len(self._turns):
            uid = self._turns[0]
            self._turns.rotate(-1)
            if not self._room(uid):
                stuck += 1
                continue
            stuck = 0
            line = self.lines[uid]
            turn = line.popleft()
            self.waiting -= 1
            if not line:
                self._drop_line(uid)
            # counted now (the room is its), not when its handler next runs
            self.pending[uid] = self.pending.get(uid, 0) + 1
            self.pending_total += 1
            turn.set_result(None)

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
            if self.lines:
                self._wake()

    def join_budget(self, conn: Conn, who: str) -> None:
        """The connection draws on ``who``'s message budget from now on (its session's
        user: the pod, else the uid)."""
        budget, n = self._budgets.get(who) or (
            Bucket(self._config().max_messages_per_s_per_user, self.clock.monotonic()),
            0,
        )
        self._budgets[who] = (budget, n + 1)
        conn.budget, conn.who = budget, who

    def leave_budget(self, conn: Conn) -> None:
        if conn.budget is None:
            return
        budget, n = self._budgets[conn.who]
        if n > 1:
            self._budgets[conn.who] = (budget, n - 1)
        else:
            del self._budgets[conn.who]
        conn.budget = None

    async def spend(self, conn: Conn) -> None:
        """One message's allowance: a connection over ``max_messages_per_s``, or whose
        user's connections together are over ``max_messages_per_s_per_user``, is not read
        for a while (its messages wait in its socket, and its client's sends block), so
        a fast client is slowed down, never ended for it, and the node's loop serves
        everyone else meanwhile: one user's connections cannot starve another's."""
        cfg, now = self._config(), self.clock.monotonic()
        assert conn.bucket is not None
        wait = conn.bucket.spend(cfg.max_messages_per_s, now)
        if conn.budget is not None:
            wait = max(wait, conn.budget.spend(cfg.max_messages_per_s_per_user, now))
        if wait > 0:
            self.slowed += 1
            conn.streak = 0
            await asyncio.sleep(wait)
        else:
            conn.streak += 1
            if conn.streak >= YIELD_EVERY:
                conn.streak = 0
                await asyncio.sleep(0)  # others' turn on the loop

    def joined(self, conn: Conn) -> None:
        self.sessions[conn.uid] = self.sessions.get(conn.uid, 0) + 1

    def left(self, conn: Conn) -> None:
        n = self.sessions.get(conn.uid, 0) - 1
        if n > 0:
            self.sessions[conn.uid] = n
        else:
            self.sessions.pop(conn.uid, None)

    def check_sessions_of_uid(self, conn: Conn) -> None:
        mine = self.sessions.get(conn.uid, 0)
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

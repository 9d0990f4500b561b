"""The workload socket: a session's hello (who it is, which GPU, how much memory), then
its messages, each decoded, checked and handed to its GPU's arbiter. A workload acts
only on its own session; anything else is refused through the guard.

Every field of a hello is bounded (names as Kubernetes bounds them, no control
characters, weights and portions finite and in range: ``gpushare.node.serve.hello_bounds``)
and refused with a message naming it; a session that outlived a node restart gets its
old id back only if the node matches it to its record (``gpushare.node.keep.recovery``),
and its lease only with the lease's token.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Sequence
from typing import Literal, overload

from gpushare import protocol as p
from gpushare.core.actions import Action
from gpushare.core.arbiter import Arbiter, ArbiterError
from gpushare.core.attach import AttachRecord
from gpushare.core.attribution import Attribution
from gpushare.core.gangs import across_gpus
from gpushare.node.decide.decisions import Decisions
from gpushare.node.guard import Conn, Guard, Refused
from gpushare.node.host.gpus import GpuInfo
from gpushare.node.host.identity import read_identity
from gpushare.node.host.procs import descends
from gpushare.node.host.sockets import read_frame
from gpushare.node.keep.config import NodeConfig
from gpushare.node.keep.recovery import IdsUnavailable, Recovery, SessionRecord
from gpushare.node.kube.k8s import PodCache, PodInfo
from gpushare.node.serve.hello_bounds import check_hello
from gpushare.node.serve.hello_figures import (
    bucket_of,
    family_of,
    gang_of,
    limit_of,
    record_of,
    request_of,
    who_of,
)
from gpushare.node.serve.prepared_claims import (
    PreparedClaim,
    PreparedClaims,
    held_already,
    not_prepared,
    of_record,
)
from gpushare.status import Claimed

log = logging.getLogger("gpushare.node.workload_server")

# What an administrator's tool sends first: said to have come to the wrong socket.
ADMIN_REQUESTS = (p.StatusRequest, p.SetConfig, p.EndSession, p.EventsRequest)


def _check_version(h: p.Hello) -> None:
    if h.version != p.PROTOCOL_VERSION:
        raise Refused(
            "version",
            f"client speaks protocol {h.version}, this node {p.PROTOCOL_VERSION}:"
            " use the same gpushare version in workloads and node",
        )


def _gone(conn: Conn) -> str:
    """Why a session's connection ended: ``ended`` by an administrator (also one that
    stopped within its grace), else ``disconnected``."""
    if conn.ending is not None:  # the end it had to come is not needed now
        conn.ending.cancel()
        return "ended"
    return "ended" if conn.ended else "disconnected"


class WorkloadServer:
    def __init__(
        self,
        *,
        config: Callable[[], NodeConfig],
        gpus: Sequence[GpuInfo],
        arbiters: Sequence[Arbiter],
        conns: dict[int, Conn],
        guard: Guard,
        decisions: Decisions,
        utilization: Sequence[Attribution],
        sim_link: Callable[[int, int], str],
        recovery: Recovery,
        returned: Callable[[], None],
        pods: Callable[[], PodCache | None],
        claims: PreparedClaims | None = None,
        retire: Callable[[int, int], None] = lambda gpu, sid: None,
        nvml_used: Callable[[int, Collection[int]], int | None] = lambda gpu, pids: None,
    ) -> None:
        self._config = config
        self.gpus, self.arbiters, self.conns = gpus, arbiters, conns
        self.guard, self.decisions, self.utilization = guard, decisions, utilization
        self.sim_link = sim_link  # (gpu, uid) -> the link file that uid may book
        self.recovery = recovery
        self.returned = returned  # every session on record is back: the window ends
        self.pods = pods
        self.claims = claims if claims is not None else PreparedClaims()
        self.retire = retire  # a session's figures, kept as it leaves (node/keep/totals.py)
        # (gpu, pids) -> the GPU memory NVML counts for them; None where it cannot say
        self.nvml_used = nvml_used

    def socket_path(self) -> str:
        return self._config().socket

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            conn = self.guard.accept(writer, name=False)
        except OSError:  # gone before the kernel could say who it was
            writer.close()
            return
        arb: Arbiter | None = None
        try:
            hello = await self._hello(conn, reader)
            if reader.at_eof():  # its client gave up waiting (a burst on a slow node):
                return  # no session for nobody, the node's time goes to the next
            arb = await self._attach_on_record(conn, hello)
            await self._serve(arb, conn, reader)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except (Refused, p.ProtocolError) as e:
            self.guard.refuse(conn, "workload", e)
        finally:
            self.guard.leave_budget(conn)
            if arb is not None and conn.session in self.conns:
                self._leave(arb, conn)
            writer.close()

    async def _hello(self, conn: Conn, reader: asyncio.StreamReader) -> p.Hello:
        """A connection's first message, its hello, read once the guard admits it (a
        bounded number at once, each within ``hello_timeout``); or :class:`Refused`, or
        :class:`~gpushare.protocol.ProtocolError` for anything but a hello."""
        cfg = self._config()
        try:
            self.guard.may_wait(conn)  # refused at once: nothing more spent on it
            self.guard.name(conn)  # its process, named for good as soon as may be
            await self.guard.admit(conn)  # a bounded number say hello at once
            hello = await asyncio.wait_for(read_frame(reader), cfg.hello_timeout)
        except TimeoutError:
            raise Refused("timeout", f"no hello within {cfg.hello_timeout:g} s") from None
        finally:
            self.guard.said_hello(conn)
        if isinstance(hello, ADMIN_REQUESTS):
            raise p.ProtocolError(
                f"{self.socket_path()} is this node's workload socket: ctl, top and"
                f" timeline talk to its admin socket, {cfg.admin_socket} (--socket"
                " ADMIN_SOCKET, or GPUSHARE_ADMIN_SOCKET)"
            )
        if not isinstance(hello, p.Hello):
            raise p.ProtocolError(f"first message must be hello, not {type(hello).__name__}")
        return hello

    async def _serve(self, arb: Arbiter, conn: Conn, reader: asyncio.StreamReader) -> None:
        """An attached session's messages, each handed to its arbiter, until its
        connection ends (:class:`asyncio.IncompleteReadError`, or a refusal)."""
        while True:
            msg = await read_frame(reader)
            await self.guard.spend(conn)
            if not conn.may_hold_memory and _claims_memory(msg, conn):
                conn.send(p.Error(code="value", message=NO_MEMORY_YET))
                continue
            try:
                actions = self._message(arb, conn.session, msg)
                if isinstance(msg, p.Acquire) or (isinstance(msg, p.Release) and msg.again):
                    conn.ask = msg.ask  # accepted: the grants that follow answer it
                if isinstance(msg, p.Release | p.Report | p.SwapDone):
                    self.recovery.save_soon()  # its memory and lease, on record soon
                self.decisions.act(arb, actions)
            except ArbiterError as e:  # not valid now, or a figure the node knows wrong:
                # answered (the field named), nothing changed, the session goes on
                conn.send(p.Error(code=e.code, message=str(e)))

    def _leave(self, arb: Arbiter, conn: Conn) -> None:
        """An attached session's connection gone: its figures kept, it detached (its
        actions delivered) and its record saved soon."""
        self.retire(arb.gpu, conn.session)
        del self.conns[conn.session]
        self.guard.left(conn)
        self.utilization[arb.gpu].forget(conn.session)
        self.decisions.act(arb, arb.detach(conn.session, reason=_gone(conn)))
        self.recovery.save_soon()

    def _gpu_of(self, h: p.Hello) -> int:
        """The GPU a hello asks for (by UUID, or index), or :class:`Refused`."""
        gpu = 0 if h.gpu is None else h.gpu
        if h.gpu_uuid:
            by_uuid = {g.uuid: g.index for g in self.gpus}
            if h.gpu_uuid not in by_uuid:
                raise Refused(
                    "gpu",
                    f"no GPU {h.gpu_uuid} on this node (NVIDIA_VISIBLE_DEVICES): it has "
                    + ", ".join(by_uuid),
                )
            gpu = by_uuid[h.gpu_uuid]
        if not 0 <= gpu < len(self.arbiters):
            raise Refused(
                "gpu",
                f"no GPU {gpu} on this node (it has {len(self.arbiters)}): choose gpu=0.."
                f"{len(self.arbiters) - 1}",
            )
        return gpu

    def _where(self, conn: Conn, h: p.Hello, proc_root: str) -> tuple[Conn | None, int]:
        """The session a member joins now (new, or back after a restart that kept no
        record of it; None: not a member) and the GPU: a member's is its session's."""
        if h.family and not (h.session and h.session in self.recovery.previous):
            head = self._head_of(conn, h, proc_root)
            return head, head.gpu
        return None, self._gpu_of(h)

    def _head_of(self, conn: Conn, h: p.Hello, proc_root: str) -> Conn:
        """The session a hello with ``family`` joins as one of its processes: attached
        here, of the same user, and this process started by its process or by one that
        process started (the kernel's view, not the client's word); or :class:`Refused`."""
        head = self.conns.get(h.family)
        fix = (
            "a process joins the session of the program that started it (gpushare run sets"
            " GPUSHARE_FAMILY in its environment): unset GPUSHARE_FAMILY to attach it as"
            " a session of its own"
        )
        if head is None and h.family in self.recovery.expected:
            raise Refused(  # its session comes back first: the client tries again
                "busy",
                f"the node restarted and session {h.family} is not back yet: try again soon",
            )
        if head is None or head.ended:
            raise Refused("family", f"hello: no session {h.family} is attached to join: {fix}")
        if head.ending is not None:  # its members are ended with it: none joins meanwhile
            raise Refused(
                "family",
                f"hello: session {h.family} is being ended (ctl end, or its claim unprepared):"
                " its processes cannot join it now",
            )
        if (
            head.uid != conn.uid
            or head.proc is None
            or not descends(conn.pid, head.proc, proc_root)
        ):
            raise Refused(
                "family",
                f"hello: process {conn.pid} was not started by session {h.family}'s process"
                f" (pid {head.pid}) or its children, or is another user's: {fix}",
            )
        return head

    def _weight(self, conn: Conn, h: p.Hello, claim: PreparedClaim | None) -> tuple[float, str]:
        """The session's weight and where it comes from: the pod's gpu-fraction
        annotation through the API (checked), else its claim's as the DRA plugin
        prepared it, else the workload's word."""
        pods = self.pods()
        if pods is not None and conn.identity.pod_uid:
            fraction = pods.fraction(conn.identity.pod_uid)
            if fraction is not None:
                return fraction, "kubernetes"
        if claim is not None and claim.weight:
            return claim.weight, "claim"
        if h.weight is None:
            return 1.0, "default"
        return h.weight, "portion" if h.portion is not None and h.weight == h.portion else "claimed"

    def _pod(self, conn: Conn) -> tuple[PodInfo, str] | None:
        """The session's pod as the API serves it, and its container's name (""
        where the API does not name the kernel's container ID), under ``--kubernetes``."""
        pods = self.pods()
        pod = (
            pods.pod(conn.identity.pod_uid) if pods is not None and conn.identity.pod_uid else None
        )
        if pod is None:
            return None
        return pod, pod.containers.get(conn.identity.container_id, "")

    def _sharing(self, conn: Conn, h: p.Hello, workload_sharing: bool) -> tuple[str, str]:
        """The session's compute-sharing mode and where it comes from. A GPU's mode is
        its administrator's: a session holds in another only as its pod says through the
        API (``kubernetes``), else where the node's ``workload_sharing`` lets a workload
        choose (``workload``); otherwise the hello's word is only shown (``claimed``)."""
        pod = self._pod(conn)
        if pod is not None:
            mode = pod[0].sharing(pod[1])
            return mode, "kubernetes" if mode else ""
        if workload_sharing:
            return h.sharing, "workload" if h.sharing else ""
        return "", ""

    def _memory_of(
        self,
        conn: Conn,
        h: p.Hello,
        head: Conn | None,
        arb: Arbiter,
        limit: int,
        claim: PreparedClaim | None,
    ) -> tuple[int, int | None]:
        """The limit and request a hello asks for, within its pod's and its claim's (a
        member's: its part of its session's, split by the arbiter)."""
        if head is not None:
            return limit, None
        request = request_of(h, arb.capacity, limit)
        bounded = self._bounded_limit(conn, limit, arb.capacity)
        if bounded < limit and request is not None:  # within the pod's, as its limit
            request = min(request, bounded)
        return claim.bounds(bounded, request) if claim is not None else (bounded, request)

    def _sharing_of(
        self, conn: Conn, h: p.Hello, head: Conn | None, arb: Arbiter, workload_sharing: bool
    ) -> tuple[str, str]:
        """:meth:`_sharing`, a member's its session's; a word not taken said in the log."""
        if head is not None:  # a process of a session holds as its session does
            sharing, source = arb.sessions[head.session].sharing, head.sharing_source
        else:
            sharing, source = self._sharing(conn, h, workload_sharing)
        if h.sharing and h.sharing != sharing:
            log.warning(
                "pid %d uid %d: hello asks for compute-sharing mode %s, but %s: it takes %s",
                conn.pid,
                conn.uid,
                h.sharing,
                "its pod's annotations through the API say otherwise"
                if self._pod(conn) is not None
                else "this node lets no workload choose one (workload_sharing = false)",
                sharing or "the GPU's mode",
            )
        return sharing, source

    def _bounded_limit(self, conn: Conn, limit: int, capacity: int) -> int:
        """A memory limit no more than the pod's annotations give it through the API
        (the workload's word otherwise, as before)."""
        pod = self._pod(conn)
        bound = pod[0].memory_bound(pod[1], capacity) if pod is not None else None
        if bound is None or limit <= bound:
            return limit
        log.warning(
            "pid %d uid %d: hello asks for a memory limit of %d bytes, but its pod %s/%s's"
            " annotations give it %d: taken as %d",
            conn.pid,
            conn.uid,
            limit,
            pod[0].namespace if pod else "",
            pod[0].name if pod else "",
            bound,
            bound,
        )
        return bound

    def _new_id(self, conn: Conn, h: p.Hello, limit: int) -> int:
        """The id a session with no record gets (on disk with its record before it is
        welcomed: :meth:`_attach_on_record`)."""
        self._no_record(conn, h, limit)
        return self.recovery.new_id()

    async def _attach_on_record(self, conn: Conn, h: p.Hello) -> Arbiter:
        """:meth:`_attach`, a new session's record on disk first: its hello is checked
        as for the attach, its record written on the records' thread (the loop goes on
        meanwhile), then the attach is made, checked anew. A record that cannot be
        written is refused here (``busy``, naming the directory and the fix), never
        found missing after a restart."""
        pending = self._attach(conn, h, dry=True)
        if pending.id in self.recovery.previous:  # on record from before a restart: at once
            arb = self._attach(conn, h)
            self.recovery.save_soon(0.0)  # as it is now, at the end of this turn
            return arb
        try:
            await self.recovery.written(pending)
        except IdsUnavailable as e:
            raise Refused("busy", str(e)) from None
        try:
            arb = self._attach(conn, h, pending)
        except BaseException:
            self.recovery.settled(pending.id, attached=False)
            raise
        self.recovery.settled(pending.id, attached=True)
        if conn.record != pending:  # a member's limit, say: as it is now, soon
            self.recovery.save_soon(0.0)
        return arb

    def _sid(
        self,
        conn: Conn,
        h: p.Hello,
        limit: int,
        rec: SessionRecord | None,
        pending: SessionRecord | None,
    ) -> int:
        """The session's id: its record's (from before a restart, or written now), or,
        for the check before that record is written, a new one."""
        if rec is not None:
            return rec.id
        if pending is not None:
            return pending.id
        return self._new_id(conn, h, limit)

    @overload
    def _attach(
        self, conn: Conn, h: p.Hello, pending: None = None, *, dry: Literal[True]
    ) -> SessionRecord: ...

    @overload
    def _attach(self, conn: Conn, h: p.Hello, pending: SessionRecord | None = None) -> Arbiter: ...

    def _attach(
        self, conn: Conn, h: p.Hello, pending: SessionRecord | None = None, dry: bool = False
    ) -> Arbiter | SessionRecord | None:
        """A session for the hello, welcomed; or :class:`Refused`, with nothing changed.
        ``dry``: only checked, and the session's record (a new id, or its record's from
        before a restart); ``pending``: a new session's record, on disk."""
        self.guard.check_sessions_of_uid(conn)
        _check_version(h)
        check_hello(h)
        cfg = self._config()
        head, gpu = self._where(conn, h, cfg.proc_root)
        arb, g = self.arbiters[gpu], self.gpus[gpu]
        # A member asks for its part of its session's limit (all it has free, unless it
        # names less), at its session's weight.
        limit = limit_of(h, arb.capacity) if head is None else h.memory_limit or arb.capacity
        identity = read_identity(conn.pid, cfg.proc_root)
        conn.identity = identity
        claim = self._claim_of(h, head, gpu, identity.pod_uid)
        limit, request = self._memory_of(conn, h, head, arb, limit, claim)
        sharing, sharing_source = self._sharing_of(conn, h, head, arb, cfg.workload_sharing)
        weight, source = self._weight(conn, h, claim)
        if head is not None:
            weight, source = arb.sessions[head.session].weight, "family"
        # Back after a restart? Only the process the record names gets the id it had,
        # and its lease only with the token that lease was granted with.
        rec = None
        if h.session:
            rec = self.recovery.match(
                h.session, conn.proc, identity.pod_uid, identity.container_id, gpu, limit,
                self.conns,
            )  # fmt: skip
        claim_uid = self._claim_uid(h, head, claim)
        terms = claim.terms if claim is not None else (0, 0.0, 0.0)
        swapped = h.swapped
        sid = self._sid(conn, h, limit, rec, pending)
        name = h.name or f"pid-{conn.pid}"
        # A new member's gang is its session's, never its hello's word (which would put
        # that session in a gang of its choosing).
        gang, spans_nodes = gang_of(h, conn.uid, identity) if head is None else ("", False)
        family, gang = family_of(arb, head, rec, gang, who_of(conn.uid, identity))
        self._check_gang_across(arb, gang)
        if dry:
            return record_of(conn, sid, gpu, identity, limit, name, family, claim_uid, terms)
        # Memory a session says it has on the GPU counts only where the node can check
        # it: on record from before a restart, or as NVML counts its process's (then no
        # more than that). A new session with neither has nothing resident. (What it
        # says it has swapped out, in its own host memory, only costs it swap-ins.)
        resident = self._resident(conn, gpu, h.resident, rec)
        link = self.sim_link(gpu, conn.uid) if g.simulated else ""  # before any change
        figures = AttachRecord(
            name=name,
            memory_limit=limit,
            memory_request=request,
            # Real GPUs too: the torch allocator asks first (gs_on_grow). One that has
            # more without asking is revoked (docs/scheduling.md 6).
            grows=h.grows,
            sharing=sharing,
            # real GPUs: not yet (docs/scheduling.md); a claim's is the node's word
            compute_limit=h.compute_limit if claim is None else claim.compute(h.compute_limit),
            workload=bucket_of(conn.uid, identity, name),
            weight=weight,
            resident=resident,
            swapped=swapped,
            discarded=h.discarded,
            holding=h.holding,
            lease=h.lease,
            verified=self._claim_verified(conn, h, rec),
            fills=h.fills,
            prefetch=h.prefetch,
            gang=gang,
            gang_size=h.gang_size,
            spans_nodes=spans_nodes,
            family=family,
            joins_family=head is not None,
        )
        try:
            actions = arb.attach(sid, figures)
        except ArbiterError as e:  # busy: a member whose session holds tries again
            raise Refused("busy" if e.code == "busy" else "attach", str(e)) from None
        limit = arb.sessions[sid].memory.limit  # a member's: its part of its session's
        conn.session, conn.gpu, conn.weight_source = sid, gpu, source
        # else only once granted (dispatch)
        conn.may_hold_memory = rec is not None or resident > 0
        conn.rank = h.rank if gang else -1
        # The pod UID is the kernel's; the names beside it are the workload's word.
        conn.verified = bool(identity.pod_uid) and h.pod_uid == identity.pod_uid
        conn.claimed = Claimed(
            pod=h.pod, namespace=h.namespace, container=h.container, sharing=h.sharing
        )
        conn.sharing_source, conn.claim = sharing_source, claim_uid
        conn.resident_model = h.resident_model if g.simulated else ""
        conn.record = record_of(conn, sid, gpu, identity, limit, name, family, claim_uid, terms)
        self.conns[sid] = conn
        self.guard.joined(conn)
        self.guard.join_budget(
            conn, f"pod {identity.pod_uid}" if identity.pod_uid else f"uid {conn.uid}"
        )
        conn.send(
            p.Welcome(
                session=sid,
                name=name,
                gpu=gpu,
                gpu_name=g.name,
                gpu_uuid=g.uuid,
                simulated=g.simulated,
                memory_limit=limit,
                memory_request=arb.sessions[sid].memory.request,
                weight=weight,
                idle_release_s=cfg.idle_release,
                sim_scale=cfg.sim_scale,
                sim_bandwidth=cfg.sim_bandwidth,
                sim_swap_failure_rate=cfg.sim_swap_failure_rate,
                sim_link=link,
                tq_s=arb.settings.tq_s,
            )
        )
        self.decisions.act(arb, actions)
        if rec is not None and self.recovery.returned(sid):
            self.returned()  # the last one expected: the recovery window ends
        return arb

    def _claim_of(
        self, h: p.Hello, head: Conn | None, gpu: int, pod_uid: str
    ) -> PreparedClaim | None:
        """The prepared claim a new session's hello names, checked (a member's is its
        session's); one named but not prepared is left to :meth:`_claim_uid`."""
        if head is not None:
            return None
        prev = self.recovery.previous.get(h.session) if h.session else None
        c = self.claims.admit(h.claim, gpu, pod_uid, prev.claim if prev else "")
        if c is None and prev is not None:
            c = of_record(h.claim, prev, gpu, pod_uid)
        if c is None:
            return None
        # One session a claim: a second would get the claim's share again (its
        # processes join the first as members, which split its limit).
        others = [x.session for x in self.conns.values() if x.claim == c.uid and not x.ended]
        if held := [sid for sid in others if sid != h.session]:
            raise held_already(c, held)
        return c

    def _claim_uid(self, h: p.Hello, head: Conn | None, claim: PreparedClaim | None) -> str:
        """The claim the session is shown by: a member's session's, else the one it
        attaches by (prepared, or its record's from before a restart: :meth:`_claim_of`)."""
        if head is not None:
            return head.claim
        if claim is not None:
            return claim.uid
        if h.claim:
            raise not_prepared(h.claim)  # its record's only for the process it names
        return ""

    def _check_gang_across(self, arb: Arbiter, gang: str) -> None:
        """A gang on several GPUs of this node only where their modes allow it."""
        if not gang:
            return
        elsewhere = {
            a.gpu: a.settings.mode for a in self.arbiters if a is not arb and gang in a.gangs
        }
        why = across_gpus(gang, arb.gpu, arb.settings.mode, elsewhere)
        if why:
            raise Refused("attach", why)

    def _claim_verified(self, conn: Conn, h: p.Hello, rec: SessionRecord | None) -> bool:
        """A lease claimed from before a restart is the session's only with its record
        and the lease's token; else it is told to yield it."""
        wrong = self.recovery.claim_wrong(rec, h.lease, h.token)
        if h.holding and wrong:
            log.warning(
                "pid %d uid %d: hello claims lease %d from before the restart, but %s: told"
                " to yield it",
                conn.pid,
                conn.uid,
                h.lease,
                wrong,
            )
        return not wrong

    def _no_record(self, conn: Conn, h: p.Hello, limit: int) -> None:
        """A hello the node has no record of: while the recovery window is open it waits
        (``busy``: the client tries again within its timeout), so that the sessions on
        record come back first; memory it says it has is not believed (said in the log)."""
        if self.recovery.open:
            n = len(self.recovery.expected)
            raise Refused(
                "busy",
                f"the node restarted and is recovering {n} sessions on record, which come"
                f" back first (recovery_window, {self._config().recovery_window:g} s at"
                " most): try again then",
            )
        held = h.resident + h.swapped + h.discarded
        if min(h.resident, h.swapped, h.discarded) < 0 or held > limit:
            raise Refused(  # no session could have these: a broken client, said so
                "attach",
                f"hello: resident + swapped + discarded ({h.resident} + {h.swapped} +"
                f" {h.discarded} bytes) must be bytes within the memory limit of {limit}"
                " bytes",
            )

    def _resident(self, conn: Conn, gpu: int, claimed: int, rec: SessionRecord | None) -> int:
        """What of the memory a hello says is resident the node believes: NVML's count
        for the process where it has one (at most); for a session on record that NVML
        does not list (a node outside the host's pid namespace sees no pids of its), or
        where NVML cannot say, no more than its record's memory (resident and swapped:
        a swap-in may have moved the one into the other since); none for a new one."""
        if claimed <= 0:
            return 0
        seen = self.nvml_used(gpu, {conn.pid})
        on_record = rec is not None
        if seen is None or (on_record and seen == 0):
            believed = min(claimed, rec.resident + rec.swapped) if rec is not None else 0
            why = (
                f"its record says it had {rec.resident + rec.swapped} bytes"
                if rec is not None
                else "the session is not on record (new to this node), nor counted by NVML"
            )
        else:
            believed = min(claimed, seen)
            why = f"NVML counts {seen} bytes for its process"
        if believed < claimed:
            log.warning(
                "pid %d uid %d: hello says %d bytes are resident on GPU %d, but %s: taken as %d",
                conn.pid,
                conn.uid,
                claimed,
                gpu,
                why,
                believed,
            )
        return believed

    @staticmethod
    def _message(arb: Arbiter, sid: int, msg: p.Message) -> list[Action]:
        if isinstance(msg, p.Acquire):
            return arb.acquire(sid)
        if isinstance(msg, p.Release):
            return arb.release(
                sid,
                resident=msg.resident,
                swapped=msg.swapped,
                again=msg.again,
                swapped_out=msg.swapped_out,
                seconds=msg.seconds,
                swapping_out=msg.swapping_out,
                need=msg.need,
                discarded=msg.discarded,
                idle_s=msg.idle_s,
            )
        if isinstance(msg, p.SwapDone):
            return arb.swap_done(
                sid,
                direction=msg.direction,
                nbytes=msg.bytes,
                seconds=msg.seconds,
                resident=msg.resident,
                swapped=msg.swapped,
                error=msg.error,
                prefetch=msg.prefetch,
                discarded=msg.discarded,
            )
        if isinstance(msg, p.Report):
            return arb.report(
                sid, resident=msg.resident, swapped=msg.swapped, discarded=msg.discarded
            )
        raise Refused(
            "denied",
            f"{type(msg).__name__} is not a workload message: a workload acts only on its own"
            " session (administration uses the admin socket)",
        )


NO_MEMORY_YET = (
    "resident: this session has had no lease nor prefetch room since it attached, and is"
    " not on record from before a restart: it has nothing on the GPU (report memory"
    " within a lease)"
)


def _claims_memory(msg: p.Message, conn: Conn) -> bool:
    """A report or release saying the session has memory on the GPU, within its limit (a report
    over it is the workload's own word that it broke the limit: the arbiter escalates
    it, and books nothing)."""
    if not isinstance(msg, p.Report | p.Release):  # a swap_done answers what it was asked
        return False
    limit = conn.record.limit if conn.record is not None else 0
    return 0 < msg.resident <= limit

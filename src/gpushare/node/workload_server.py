"""The workload socket: a session's hello (who it is, which GPU, how much memory), then
its messages, each decoded, checked and handed to its GPU's arbiter. A workload acts
only on its own session; anything else is refused through the guard."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from gpushare import protocol as p
from gpushare.core.actions import Action
from gpushare.core.arbiter import Arbiter, ArbiterError
from gpushare.core.attribution import Attribution
from gpushare.core.gangs import across_gpus
from gpushare.node.config import NodeConfig
from gpushare.node.dispatch import Dispatch
from gpushare.node.gpus import GpuInfo
from gpushare.node.guard import Conn, Guard, Refused
from gpushare.node.identity import CgroupIdentity, read_identity
from gpushare.node.sockets import read_frame
from gpushare.status import Claimed

MAX_GANG_ID = 256  # characters of a job id
MAX_RANKS = 1 << 16  # ranks a job may say it has (on the node, or in all)


class WorkloadServer:
    def __init__(
        self,
        *,
        config: Callable[[], NodeConfig],
        gpus: Sequence[GpuInfo],
        arbiters: Sequence[Arbiter],
        conns: dict[int, Conn],
        guard: Guard,
        dispatch: Dispatch,
        utilization: Sequence[Attribution],
        sim_link: Callable[[int], str],
    ) -> None:
        self._config = config
        self.gpus, self.arbiters, self.conns = gpus, arbiters, conns
        self.guard, self.dispatch, self.utilization = guard, dispatch, utilization
        self.sim_link = sim_link
        self._next_session = 1

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = self.guard.accept(writer)
        arb: Arbiter | None = None
        cfg = self._config()
        try:
            try:
                hello = await asyncio.wait_for(read_frame(reader), cfg.hello_timeout)
            except TimeoutError:
                raise Refused("timeout", f"no hello within {cfg.hello_timeout:g} s") from None
            if not isinstance(hello, p.Hello):
                raise p.ProtocolError(f"first message must be hello, not {type(hello).__name__}")
            arb = self._attach(conn, hello)
            while True:
                msg = await read_frame(reader)
                self.guard.spend(conn, "workload")
                try:
                    self.dispatch.apply(arb, self._message(arb, conn.session, msg))
                except ArbiterError as e:  # not valid now: answered, the session goes on
                    conn.send(p.Error(code="state", message=str(e)))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except (Refused, p.ProtocolError) as e:
            self.guard.refuse(conn, "workload", e)
        finally:
            if arb is not None and conn.session in self.conns:
                del self.conns[conn.session]
                self.utilization[arb.gpu].forget(conn.session)
                self.dispatch.apply(arb, arb.detach(conn.session, reason="disconnected"))
            writer.close()

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

    def _attach(self, conn: Conn, h: p.Hello) -> Arbiter:
        """A session for the hello, welcomed; or :class:`Refused`, with nothing changed."""
        self.guard.check_sessions_of_uid(conn)
        if h.version != p.PROTOCOL_VERSION:
            raise Refused(
                "version",
                f"client speaks protocol {h.version}, this node {p.PROTOCOL_VERSION}:"
                " use the same gpushare version in workloads and node",
            )
        gpu = self._gpu_of(h)
        arb, g, cfg = self.arbiters[gpu], self.gpus[gpu], self._config()
        if h.memory_limit is not None:
            limit = h.memory_limit
        elif h.portion is not None and 0 < h.portion <= 1:
            limit = int(arb.capacity * h.portion)
        else:
            limit = arb.capacity
        weight = h.weight if h.weight is not None else 1.0
        sid = self._next_session
        name = h.name or f"pid-{conn.pid}"
        identity = read_identity(conn.pid, cfg.proc_root)
        gang, spans_nodes = gang_of(h, conn.uid, identity)
        if gang:
            elsewhere = {
                a.gpu: a.settings.mode for a in self.arbiters if a is not arb and gang in a.gangs
            }
            why = across_gpus(gang, gpu, arb.settings.mode, elsewhere)
            if why:
                raise Refused("attach", why)
        try:
            actions = arb.attach(
                sid,
                name=name,
                limit=limit,
                weight=weight,
                resident=h.resident,
                swapped=h.swapped,
                holding=h.holding,
                fills=h.fills,
                prefetch=h.prefetch,
                gang=gang,
                gang_size=h.gang_size,
                spans_nodes=spans_nodes,
            )
        except ArbiterError as e:
            raise Refused("attach", str(e)) from None
        self._next_session += 1
        conn.session, conn.gpu = sid, gpu
        conn.identity = identity
        conn.rank = h.rank if gang else -1
        conn.verified = bool(conn.identity.pod_uid) and h.pod_uid == conn.identity.pod_uid
        conn.claimed = Claimed(pod=h.pod, namespace=h.namespace, container=h.container)
        self.conns[sid] = conn
        conn.send(
            p.Welcome(
                session=sid,
                name=name,
                gpu=gpu,
                gpu_name=g.name,
                gpu_uuid=g.uuid,
                simulated=g.simulated,
                memory_limit=limit,
                weight=weight,
                idle_release_s=cfg.idle_release,
                sim_scale=cfg.sim_scale,
                sim_bandwidth=cfg.sim_bandwidth,
                sim_swap_failure_rate=cfg.sim_swap_failure_rate,
                sim_link=self.sim_link(gpu) if g.simulated else "",
            )
        )
        self.dispatch.apply(arb, actions)
        return arb

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
            )
        if isinstance(msg, p.Report):
            return arb.report(sid, resident=msg.resident, swapped=msg.swapped)
        raise Refused(
            "denied",
            f"{type(msg).__name__} is not a workload message: a workload acts only on its own"
            " session (administration uses the admin socket)",
        )


def gang_of(h: p.Hello, uid: int, identity: CgroupIdentity) -> tuple[str, bool]:
    """The node's key of the job a hello says it is a rank of ("" for none), and whether
    the job spans nodes; or :class:`Refused` for figures out of bounds. The key joins
    the job's id to what the kernel says (the pod, else the uid): a rank can join only
    a job of its own pod or user, whatever id it claims."""
    if not h.gang:
        return "", False
    if len(h.gang) > MAX_GANG_ID:
        raise Refused(
            "attach", f"gang id longer than {MAX_GANG_ID} characters: set a shorter GPUSHARE_GANG"
        )
    for what, value, low in (
        ("gang_size", h.gang_size, 0),
        ("world_size", h.world_size, 0),
        ("rank", h.rank, -1),
    ):
        if not low <= value <= MAX_RANKS:
            raise Refused(
                "attach",
                f"{what} {value} is not in {low}..{MAX_RANKS}: check GPUSHARE_GANG_SIZE,"
                " GPUSHARE_RANK or what the launcher set (WORLD_SIZE, LOCAL_WORLD_SIZE, RANK)",
            )
    who = f"pod:{identity.pod_uid}" if identity.pod_uid else f"uid:{uid}"
    return f"{h.gang}@{who}", 0 < h.gang_size < h.world_size

"""The status snapshot (``gpushare.status``), built from the arbiters' state, the
connections' identities and the utilization figures: what ``ctl status``, ``top``, the
exporter and the demo read."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import msgspec

from gpushare import protocol as p
from gpushare.core.arbiter import Arbiter
from gpushare.core.attribution import Attribution
from gpushare.core.gangs import Gang
from gpushare.core.sessions import SessionState, State
from gpushare.node.guard import Conn
from gpushare.node.host.gpus import GpuInfo
from gpushare.node.host.identity import CgroupIdentity
from gpushare.node.keep.totals import Totals
from gpushare.node.kube.k8s import PodCache
from gpushare.status import (
    Claimed,
    GangStatus,
    GpuStatus,
    NodeInfo,
    NodeStatus,
    SessionStatus,
    WorkloadStatus,
)


def take(
    info: NodeInfo,
    gpus: Sequence[GpuInfo],
    arbiters: Sequence[Arbiter],
    utilization: Sequence[Attribution],
    conns: Mapping[int, Conn],
    pods: PodCache | None,
    totals: Sequence[Totals] = (),
) -> NodeStatus:
    out = NodeStatus(
        node=info,
        gpus=[
            gpu(g, a, att, [session(a, s, att, conns.get(s.id), pods) for s in a.sessions.values()])
            for g, a, att in zip(gpus, arbiters, utilization, strict=True)
        ],
    )
    for g, t in zip(out.gpus, totals, strict=False):  # workloads: sessions gone included
        g.workloads = t.workloads(g.sessions)
    return out


def session(
    a: Arbiter, s: SessionState, att: Attribution, c: Conn | None, pods: PodCache | None
) -> SessionStatus:
    """A session's figures, live ones (lease and wait running now) included, and who it
    is. With the Kubernetes API, the names are the API's for the kernel's pod UID
    (verified), kept once seen (a pod deleted from the API while its process runs keeps
    them); without, a claim whose pod UID is the kernel's is shown as the claim it is
    (not verified); any other only under ``claimed``."""
    claimed = c.claimed if c else Claimed()
    ident = c.identity if c else CgroupIdentity()
    names = _names(c, ident, pods)
    consistent = bool(c and c.verified)  # the claim names the kernel's pod UID
    if names:  # the API's names for the kernel's pod
        shown = Claimed(namespace=names[0], pod=names[1], container=names[2])
    else:
        shown = claimed if consistent else Claimed()
    with_conn = c if c is not None else _NO_CONN
    return SessionStatus(
        id=s.id,
        name=s.name,
        frozen=s.esc.frozen,
        state=str(s.state),
        weight=s.weight,
        memory_limit_bytes=s.memory.limit,
        memory_request_bytes=s.memory.guaranteed,
        memory_bound_bytes=s.memory.held if s.holding else 0,
        reclaims_total=s.memory.reclaims,
        reclaimed_bytes_total=s.memory.reclaimed,
        discarded_bytes=s.memory.discarded,
        discarded_bytes_total=s.totals.discarded_bytes,
        sharing=s.sharing,
        sharing_source=with_conn.sharing_source,
        compute_limit=s.share.cap,
        compute_left_s=a.compute_left(s),
        resident_bytes=s.memory.resident,
        swapped_bytes=s.memory.swapped,
        pending_swap_out_bytes=s.memory.pending_out,
        room_bytes=s.memory.room,
        lease_seconds_total=a.lease_seconds(s),
        wait_seconds_total=a.wait_seconds(s),
        wait_seconds_max=s.totals.wait_max_s,
        grants_total=s.totals.grants,
        bursts_total=s.totals.bursts,
        revokes_total=s.totals.revokes,
        escalations_total=s.totals.escalations,
        swap_out_total=s.totals.swap_outs,
        swap_in_total=s.totals.swap_ins,
        swap_out_bytes_total=s.totals.swap_out_bytes,
        swap_in_bytes_total=s.totals.swap_in_bytes,
        swap_out_seconds_total=s.totals.swap_out_s,
        swap_in_seconds_total=s.totals.swap_in_s,
        attached_seconds=a.clock.monotonic() - s.attached,
        wait_seconds_completed_total=s.totals.wait_s,
        wait_seconds_buckets=list(s.totals.wait_counts),
        wait_seconds_p95=p95(s.totals.recent_waits),
        utilization_seconds_total=att.by_session.get(s.id, 0.0),
        pid=with_conn.pid,
        uid=with_conn.uid,
        pod=shown.pod,
        namespace=shown.namespace,
        container=shown.container,
        identity_verified=bool(names),
        identity_source="kubernetes" if names else "claim" if consistent else "",
        claimed=claimed,
        pod_uid=ident.pod_uid,
        container_id=ident.container_id,
        runtime=ident.runtime,
        weight_source=with_conn.weight_source,
        claim=with_conn.claim,
        resident_model=with_conn.resident_model,
        gang=s.rank.gang,
        gang_rank=with_conn.rank if s.rank.gang else -1,
        parked=s.rank.parked,
        turns_total=s.totals.turns,
        turn_credit_seconds=s.share.credit,
        turn_credit_rate=a.turns.rate(s),
        usual_burst_seconds=a.turns.usual_burst(s) or 0.0,
        measured_use_ratio=a.turns.use(s),
        family=s.rank.family,
    )


def _names(
    c: Conn | None, ident: CgroupIdentity, pods: PodCache | None
) -> tuple[str, str, str] | None:
    """The API's names for the kernel's pod UID, kept once seen (a pod deleted from the
    API while its process runs keeps them)."""
    names = pods.resolve(ident.pod_uid, ident.container_id) if pods and ident.pod_uid else None
    if c is None:
        return names
    if names and (c.names is None or names[2] or not c.names[2]):
        c.names = names  # pinned: what the API said stays when the pod is gone from it
    return c.names


@dataclass(frozen=True)
class _Unconnected:
    """What a session with no connection (gone, or back after a restart) shows."""

    pid: int = 0
    uid: int = 0
    weight_source: str = ""
    sharing_source: str = ""
    rank: int = -1
    claim: str = ""
    resident_model: str = ""


_NO_CONN = _Unconnected()


def gang(a: Arbiter, g: Gang) -> GangStatus:
    members = [a.sessions[m] for m in sorted(g.members)]
    if g.revoked:
        state = "yielding"
    elif any(m.holding for m in members):
        state = "holding"
    elif any(m.state is State.WAITING for m in members):
        state = "waiting"
    else:
        state = "idle"
    return GangStatus(
        gang=g.key,
        sessions=[m.id for m in members],
        size=g.size,
        spans_nodes=g.spans_nodes,
        state=state,
        regroups_total=g.regroups,
    )


def gpu(g: GpuInfo, a: Arbiter, att: Attribution, sessions: list[SessionStatus]) -> GpuStatus:
    return GpuStatus(
        index=g.index,
        name=g.name,
        uuid=g.uuid,
        simulated=g.simulated,
        memory_bytes=g.memory_bytes,
        usable_bytes=a.capacity,
        used_bytes=a.used_bytes(),
        utilization_ratio=att.last_ratio,
        grants_total=a.grants_total,
        shared_utilization_seconds_total=att.shared,
        tq_s=a.settings.tq_s,
        mode=a.settings.mode,
        policy=a.settings.policy,
        escalation=a.settings.escalation,
        holders=list(a.holders),
        queue=list(a.queue),
        sessions=sessions,
        recovering=a.recovering,
        gangs=[gang(a, g) for g in a.gangs.values()],
    )


def fit(status: NodeStatus, most: int) -> NodeStatus:
    """The status, with as many sessions as fit in ``most`` encoded bytes: holders first,
    then those waiting, then the rest, taken from each GPU in turn; then as many
    workloads' totals as fit beside them, those with sessions attached first. What is
    left out is counted (``sessions_omitted``, ``workloads_omitted``) and marked
    (``truncated``): a status always fits."""
    encode = msgspec.msgpack.encode
    if len(encode(status)) <= most:
        return status
    sessions = []
    for g in status.gpus:
        rank = {sid: i for i, sid in enumerate([*g.holders, *g.queue])}
        sessions.append(sorted(g.sessions, key=lambda s: rank.get(s.id, len(rank))))
    workloads = [sorted(g.workloads, key=lambda w: not w.sessions) for g in status.gpus]
    bare = msgspec.structs.replace(
        status,
        gpus=[msgspec.structs.replace(g, sessions=[], workloads=[]) for g in status.gpus],
    )
    budget = most - len(encode(bare)) - 64 * len(status.gpus)  # the omitted counts' room
    kept, budget = _take(sessions, budget)
    kept_workloads, _ = _take(workloads, budget)
    gpus = [
        msgspec.structs.replace(
            g,
            sessions=k,
            sessions_omitted=len(g.sessions) - len(k),
            workloads=w,
            workloads_omitted=len(g.workloads) - len(w),
        )
        for g, k, w in zip(status.gpus, kept, kept_workloads, strict=True)
    ]
    return msgspec.structs.replace(status, gpus=gpus, truncated=True)


T = TypeVar("T", SessionStatus, WorkloadStatus)


def _take(lists: list[list[T]], budget: int) -> tuple[list[list[T]], int]:
    """From each list in turn, the next item while its encoding fits the budget; what
    was kept of each, and the budget left."""
    encode = msgspec.msgpack.encode
    kept: list[list[T]] = [[] for _ in lists]
    full = [False] * len(lists)
    depth = 0
    while not all(full):
        for i, items in enumerate(lists):
            if full[i] or depth >= len(items):
                full[i] = True
                continue
            size = len(encode(items[depth]))
            if size > budget:
                full[i] = True
                continue
            budget -= size
            kept[i].append(items[depth])
        depth += 1
    return kept, budget


def p95(xs: Iterable[float]) -> float:
    v = sorted(xs)
    return v[min(len(v) - 1, int(0.95 * len(v)))] if v else 0.0


class StatusFrames:
    """``status`` replies for the admin socket, encoded, each taken after the request it
    answers (so a reply shows everything the node did before it was asked), but no
    more often than every ``SHARE`` times the last one's cost (and ``MOST_S``): a
    request sooner waits for the next, which every request waiting then shares. However
    fast ``ctl status`` is polled, status takes at most 1/(SHARE + 1) of the loop's time
    (2%), and grants go on meanwhile."""

    SHARE = 50
    MOST_S = 0.5

    def __init__(self, status: Callable[[], NodeStatus], clock: Callable[[], float]) -> None:
        self._status, self._clock = status, clock
        self._next = float("-inf")  # no reply is taken before then
        self._due: asyncio.Future[bytes] | None = None
        self.taken = self.shared = 0

    async def take(self) -> bytes:
        now = self._clock()
        if self._due is None:
            if now >= self._next:
                return self._take()
            self._due = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().create_task(self._take_at(self._next - now, self._due))
        self.shared += 1
        return await asyncio.shield(self._due)

    async def _take_at(self, delay: float, due: asyncio.Future[bytes]) -> None:
        await asyncio.sleep(delay)
        self._due = None
        try:
            due.set_result(self._take())
        except Exception as e:  # every waiter hears it
            due.set_exception(e)

    def _take(self) -> bytes:
        t0 = self._clock()
        reply = p.StatusReply(status=fit(self._status(), p.MAX_FRAME - 1024))
        frame = p.encode(reply)  # always fits a frame (marked if cut)
        self.taken += 1
        self._next = t0 + min(self.MOST_S, (self._clock() - t0) * (self.SHARE + 1))
        return frame

"""The status snapshot (``gpushare.status``), built from the arbiters' state, the
connections' identities and the utilization figures: what ``ctl status``, ``top``, the
exporter and the demo read."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from gpushare.core.arbiter import Arbiter
from gpushare.core.attribution import Attribution
from gpushare.core.gangs import Gang
from gpushare.core.sessions import SessionState, State
from gpushare.node.gpus import GpuInfo
from gpushare.node.guard import Conn
from gpushare.node.identity import CgroupIdentity
from gpushare.node.k8s import PodCache
from gpushare.status import (
    Claimed,
    GangStatus,
    GpuStatus,
    NodeInfo,
    NodeStatus,
    SessionStatus,
)


def take(
    info: NodeInfo,
    gpus: Sequence[GpuInfo],
    arbiters: Sequence[Arbiter],
    utilization: Sequence[Attribution],
    conns: Mapping[int, Conn],
    pods: PodCache | None,
) -> NodeStatus:
    return NodeStatus(
        node=info,
        gpus=[
            gpu(g, a, att, [session(a, s, att, conns.get(s.id), pods) for s in a.sessions.values()])
            for g, a, att in zip(gpus, arbiters, utilization, strict=True)
        ],
    )


def session(
    a: Arbiter, s: SessionState, att: Attribution, c: Conn | None, pods: PodCache | None
) -> SessionStatus:
    """A session's figures, live ones (lease and wait running now) included, and who it
    is. Claims are shown only when the kernel agrees; with the Kubernetes API, the names
    are the API's for the kernel's pod UID."""
    claimed = c.claimed if c else Claimed()
    ident = c.identity if c else CgroupIdentity()
    names = pods.resolve(ident.pod_uid, ident.container_id) if pods and ident.pod_uid else None
    ok = bool(names) or bool(c and c.verified)
    if names:  # the API's names for the kernel's pod
        shown = Claimed(namespace=names[0], pod=names[1], container=names[2])
    else:
        shown = claimed if ok else Claimed()
    return SessionStatus(
        id=s.id,
        name=s.name,
        frozen=s.frozen,
        state=str(s.state),
        weight=s.weight,
        memory_limit_bytes=s.limit,
        resident_bytes=s.resident,
        swapped_bytes=s.swapped,
        pending_swap_out_bytes=s.pending_out,
        room_bytes=s.room,
        lease_seconds_total=a.lease_seconds(s),
        wait_seconds_total=a.wait_seconds(s),
        wait_seconds_max=s.wait_max_s,
        grants_total=s.grants,
        bursts_total=s.bursts,
        revokes_total=s.revokes,
        escalations_total=s.escalations,
        swap_out_total=s.swap_outs,
        swap_in_total=s.swap_ins,
        swap_out_bytes_total=s.swap_out_bytes,
        swap_in_bytes_total=s.swap_in_bytes,
        swap_out_seconds_total=s.swap_out_s,
        swap_in_seconds_total=s.swap_in_s,
        attached_seconds=a.clock.monotonic() - s.attached,
        wait_seconds_completed_total=s.wait_s,
        wait_seconds_buckets=list(s.wait_counts),
        wait_seconds_p95=p95(s.recent_waits),
        utilization_seconds_total=att.by_session.get(s.id, 0.0),
        pid=c.pid if c else 0,
        uid=c.uid if c else 0,
        pod=shown.pod,
        namespace=shown.namespace,
        container=shown.container,
        identity_verified=ok,
        identity_source="kubernetes" if names else "claim" if ok else "",
        claimed=claimed,
        pod_uid=ident.pod_uid,
        container_id=ident.container_id,
        runtime=ident.runtime,
        gang=s.gang,
        gang_rank=c.rank if c and s.gang else -1,
        parked=s.parked,
    )


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
        gangs=[gang(a, g) for g in a.gangs.values()],
    )


def p95(xs: Iterable[float]) -> float:
    v = sorted(xs)
    return v[min(len(v) - 1, int(0.95 * len(v)))] if v else 0.0

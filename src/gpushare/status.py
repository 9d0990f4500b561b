"""The status snapshot, typed: what ``ctl status --json`` prints, the admin socket's
``StatusReply`` carries, the exporter, ``top`` and the demo read.

The node builds it (``gpushare.node.observe.snapshot``); the tools decode it. The names of
DESIGN.md's contract are fields here and stay; more fields may be added. Field order is
the JSON's key order.
"""

from __future__ import annotations

import msgspec

from gpushare.settings import Escalation, Mode, Policy


class Claimed(msgspec.Struct, kw_only=True):
    """What the client said about its pod (shown apart: only checked claims count)."""

    pod: str = ""
    namespace: str = ""
    container: str = ""
    sharing: str = ""  # the compute-sharing mode it asked for (in force only as `sharing`)


class SessionStatus(msgspec.Struct, kw_only=True):
    id: int
    name: str
    frozen: bool
    state: str  # idle, waiting, holding, yielding
    weight: float
    memory_limit_bytes: int
    resident_bytes: int
    swapped_bytes: int
    pending_swap_out_bytes: int
    room_bytes: int  # > 0: swapping in within this room (an overlapped switch)
    lease_seconds_total: float
    wait_seconds_total: float
    wait_seconds_max: float
    grants_total: int
    bursts_total: int
    revokes_total: int
    escalations_total: int
    swap_out_total: int
    swap_in_total: int
    swap_out_bytes_total: int
    swap_in_bytes_total: int
    swap_out_seconds_total: float
    swap_in_seconds_total: float
    attached_seconds: float
    wait_seconds_completed_total: float
    wait_seconds_buckets: list[int]  # per bucket of core.sessions.WAIT_BUCKETS, then +Inf
    wait_seconds_p95: float
    utilization_seconds_total: float
    # who it is: the kernel's view, names only where checked
    pid: int
    uid: int
    pod: str
    namespace: str
    container: str
    identity_verified: bool
    identity_source: str  # "kubernetes", "claim" (checked against the kernel) or ""
    claimed: Claimed
    pod_uid: str
    container_id: str
    runtime: str
    # where its weight comes from: "kubernetes" (the pod's gpu-fraction annotation, through
    # the API), "portion" (the GPU fraction the workload says KAI gave it), "claimed" (a
    # weight it set), "default" (1)
    weight_source: str = ""
    # the distributed job it is a rank of (docs/scheduling.md "Gangs"): the node's key of
    # its gang ("": none), its rank as its client says (-1: not known), parked: it
    # yielded and waits for its gang's other ranks to yield too
    gang: str = ""
    gang_rank: int = -1
    parked: bool = False
    # What the node guarantees and packs by in mode auto (its limit unless it asked for
    # less); while it holds, the most it may have without asking (its bound, lent up to
    # its limit); bursts given back and the bytes lent above its request they took back.
    memory_request_bytes: int = 0
    memory_bound_bytes: int = 0
    reclaims_total: int = 0
    reclaimed_bytes_total: int = 0
    # discardable memory dropped now (neither on the GPU nor in host memory: made again,
    # empty, at its grant), and all it dropped instead of swapping out
    discarded_bytes: int = 0
    discarded_bytes_total: int = 0
    # its pod's compute-sharing mode (KAI: "time-slicing", "sm-sharing"; "": the GPU's)
    sharing: str = ""
    # where that mode comes from: "kubernetes" (its pod's annotation, through the API),
    # "workload" (its own word, where the node's workload_sharing allows it); "": none
    sharing_source: str = ""
    # its compute limit (the most of the GPU's time it may take; 0: none) and the GPU
    # seconds it may hold now before it rests (core/caps.py)
    compute_limit: float = 0.0
    compute_left_s: float = 0.0
    # its interactive turns (docs/scheduling.md 3): taken, its credit (GPU seconds), what
    # it earns per idle second, its usual burst (the lower median of its recent bursts'
    # GPU seconds; 0: none yet) and its measured use (the fraction of the last minute or
    # so it wanted the GPU), the last two as of its last ask or burst's end
    turns_total: int = 0
    turn_credit_seconds: float = 0.0
    turn_credit_rate: float = 0.0
    usual_burst_seconds: float = 0.0
    measured_use_ratio: float = 0.0
    # a process of that session's (docs/scheduling.md "Families": one lease, its memory
    # out of that session's limit); 0: a session of its own
    family: int = 0
    # the DRA ResourceClaim (its UID) whose share this is, as gpushare's DRA plugin
    # prepared it on this node (docs/kubernetes.md "DRA"); "": none
    claim: str = ""
    # on a simulated GPU, how a CPU-run program's resident bytes are modelled
    # ("weights", "declared": gpushare run --sim-resident); "": what it allocated
    resident_model: str = ""


class GangStatus(msgspec.Struct, kw_only=True):
    """The ranks of one job on a GPU, granted and revoked as one holder."""

    gang: str  # the node's key: the job's id @ its pod (pod:UID) or user (uid:N)
    sessions: list[int]  # its members attached to this GPU
    size: int  # ranks on the node, as its clients say (shown, never waited for)
    spans_nodes: bool  # the job has ranks on other nodes (one node cannot co-schedule it)
    state: str  # holding, yielding (revoked, members parking), waiting or idle
    regroups_total: int  # parked members sent on to their next safe point


class WorkloadStatus(msgspec.Struct, kw_only=True):
    """A workload's totals on a GPU: its sessions of the same name, namespace, pod and
    container summed, those that detached included (from the node's start)."""

    name: str
    namespace: str = ""
    pod: str = ""
    container: str = ""
    sessions: int = 0  # attached now
    sessions_total: int = 0  # attached since the node started, those gone included
    lease_seconds_total: float = 0.0
    wait_seconds_total: float = 0.0
    grants_total: int = 0
    revokes_total: int = 0
    swap_out_bytes_total: int = 0
    swap_in_bytes_total: int = 0
    utilization_seconds_total: float = 0.0


class GpuStatus(msgspec.Struct, kw_only=True):
    index: int
    name: str
    uuid: str
    simulated: bool
    memory_bytes: int
    usable_bytes: int
    used_bytes: int
    utilization_ratio: float
    grants_total: int
    shared_utilization_seconds_total: float
    tq_s: float
    mode: Mode
    policy: Policy
    escalation: Escalation
    holders: list[int]
    queue: list[int]
    sessions: list[SessionStatus]
    workloads: list[WorkloadStatus] = msgspec.field(default_factory=list)
    recovering: bool = False  # after a restart: nothing granted until its sessions are back
    sessions_omitted: int = 0  # sessions left out so that the status fits one frame
    workloads_omitted: int = 0  # workloads' totals left out so that the status fits
    gangs: list[GangStatus] = msgspec.field(default_factory=list)


class NodeInfo(msgspec.Struct, kw_only=True):
    pid: int
    started: float  # Unix seconds
    config: str  # the config file, if any


class NodeStatus(msgspec.Struct, kw_only=True):
    node: NodeInfo
    gpus: list[GpuStatus]
    # some sessions or workloads were left out (GpuStatus.sessions_omitted, .workloads_omitted)
    truncated: bool = False


def to_json_object(status: NodeStatus) -> dict[str, object]:
    """The snapshot as plain JSON types, keys in field order (``ctl status --json``)."""
    out: dict[str, object] = msgspec.to_builtins(status)
    return out

"""The exporter as it was before gpushare wrote its text itself (gpushare at commit
81033a6: prometheus_client's families, rendered by its ``generate_latest``), kept as the
reference that the exporter's output is checked against: every series it has is still
there, with the same help, type, labels and values, byte for byte. Since kept, its
collect is split in two, the per-GPU and the per-session families (issue 37); what it
writes is as it was."""

from __future__ import annotations

import platform
import pwd
from collections.abc import Callable, Iterator
from functools import lru_cache

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

from gpushare._version import __version__
from gpushare.core.sessions import WAIT_BUCKETS, State
from gpushare.settings import MODES, POLICIES
from gpushare.status import GpuStatus, NodeStatus, SessionStatus, WorkloadStatus

DEFAULT_PORT = 9423
GPU_LABELS = ["gpu", "gpu_uuid", "simulated"]
SESSION_LABELS = ["gpu", "gpu_uuid", "namespace", "pod", "container", "session"]

Figure = Callable[[SessionStatus], float]
# (metric, its figure in the snapshot, help) for per-session counters and gauges
_SESSION_COUNTERS: list[tuple[str, Figure, str]] = [
    ("lease_seconds", lambda s: s.lease_seconds_total, "Seconds this session held a lease."),
    ("grants", lambda s: s.grants_total, "Leases granted to this session."),
    (
        "revokes",
        lambda s: s.revokes_total,
        "Leases revoked from this session at a quantum's end.",
    ),
    ("escalations", lambda s: s.escalations_total, "Escalations applied to this session."),
    ("bursts", lambda s: s.bursts_total, "Bursts (requests for the GPU) this session made."),
    (
        "utilization_seconds",
        lambda s: s.utilization_seconds_total,
        "GPU utilization attributed to this session through its lease, in busy-seconds.",
    ),
]
_SESSION_GAUGES: list[tuple[str, Figure, str]] = [
    ("resident_bytes", lambda s: s.resident_bytes, "Bytes of this session's memory on the GPU."),
    (
        "swapped_bytes",
        lambda s: s.swapped_bytes,
        "Bytes of this session's GPU memory in host memory.",
    ),
    ("memory_limit_bytes", lambda s: s.memory_limit_bytes, "This session's GPU memory limit."),
    ("weight", lambda s: s.weight, "This session's weight under policy weighted."),
]


class NodeCollector(Collector):
    def __init__(self, snapshot: Callable[[], NodeStatus]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        st = self.snapshot()
        info = InfoMetricFamily("gpushare_build", "gpushare version and Python.")
        info.add_metric([], {"version": __version__, "python": platform.python_version()})
        yield info

        gpus, sessions = _GpuFamilies(), _SessionFamilies()
        for g in st.gpus:
            gpus.add(g)
            for s in g.sessions:
                sessions.add(g, s)
        yield from gpus.families()
        yield from sessions.families()
        yield from session_info(st)
        yield from workload_totals(st)


class _GpuFamilies:
    """The per-GPU families, filled a GPU at a time (its sessions counted by state)."""

    def __init__(self) -> None:
        self.ginfo = InfoMetricFamily(
            "gpushare_gpu", "Each GPU the node arbitrates.", labels=GPU_LABELS
        )
        self.g_gauges = {
            k: GaugeMetricFamily(f"gpushare_gpu_{k}", h, labels=GPU_LABELS)
            for k, h in [
                ("memory_bytes", "The GPU's memory."),
                ("usable_bytes", "The GPU's memory less the reserve: what sessions may use."),
                ("used_bytes", "Memory in use now, holders counted at their limits."),
                ("utilization_ratio", "The GPU's utilization, last sample (0-1)."),
                ("queue_length", "Sessions waiting for the GPU."),
                ("holders", "Sessions holding a lease."),
            ]
        }
        self.tq = GaugeMetricFamily("gpushare_tq_seconds", "The time quantum.", labels=GPU_LABELS)
        self.mode = GaugeMetricFamily(
            "gpushare_mode", "1 for the GPU's arbitration mode.", labels=[*GPU_LABELS, "mode"]
        )
        self.policy = GaugeMetricFamily(
            "gpushare_policy", "1 for the GPU's share policy.", labels=[*GPU_LABELS, "policy"]
        )
        self.ggrants = CounterMetricFamily(
            "gpushare_gpu_grants", "Leases granted on the GPU.", labels=GPU_LABELS
        )
        self.shared = CounterMetricFamily(
            "gpushare_shared_utilization_seconds",
            "GPU busy-seconds in shared periods that no per-process sample attributed.",
            labels=GPU_LABELS,
        )
        self.states = GaugeMetricFamily(
            "gpushare_sessions", "Sessions by state.", labels=[*GPU_LABELS, "state"]
        )

    def add(self, g: GpuStatus) -> None:
        gl = [str(g.index), g.uuid, "true" if g.simulated else "false"]
        self.ginfo.add_metric(gl, {"name": g.name})
        self.g_gauges["memory_bytes"].add_metric(gl, g.memory_bytes)
        self.g_gauges["usable_bytes"].add_metric(gl, g.usable_bytes)
        self.g_gauges["used_bytes"].add_metric(gl, g.used_bytes)
        self.g_gauges["utilization_ratio"].add_metric(gl, g.utilization_ratio)
        self.g_gauges["queue_length"].add_metric(gl, len(g.queue))
        self.g_gauges["holders"].add_metric(gl, len(g.holders))
        self.tq.add_metric(gl, g.tq_s)
        for m in MODES:
            self.mode.add_metric([*gl, m], 1.0 if g.mode == m else 0.0)
        for pol in POLICIES:
            self.policy.add_metric([*gl, pol], 1.0 if g.policy == pol else 0.0)
        self.shared.add_metric(gl, g.shared_utilization_seconds_total)
        self.ggrants.add_metric(gl, g.grants_total)
        counts = {s.value: 0 for s in State}
        for s in g.sessions:
            counts[s.state] += 1
        for state_name, n in counts.items():
            self.states.add_metric([*gl, state_name], n)

    def families(self) -> Iterator[Metric]:
        yield self.ginfo
        yield from self.g_gauges.values()
        yield from (self.tq, self.mode, self.policy, self.shared, self.ggrants, self.states)


class _SessionFamilies:
    """The per-session families, filled a session at a time."""

    def __init__(self) -> None:
        self.s_counters = [
            (figure, CounterMetricFamily(f"gpushare_{name}", h, labels=SESSION_LABELS))
            for name, figure, h in _SESSION_COUNTERS
        ]
        self.s_gauges = [
            (figure, GaugeMetricFamily(f"gpushare_{name}", h, labels=SESSION_LABELS))
            for name, figure, h in _SESSION_GAUGES
        ]
        self.swaps = CounterMetricFamily(
            "gpushare_swaps", "Swaps by direction.", labels=[*SESSION_LABELS, "direction"]
        )
        self.swap_bytes = CounterMetricFamily(
            "gpushare_swap_bytes",
            "Bytes swapped by direction.",
            labels=[*SESSION_LABELS, "direction"],
        )
        self.swap_secs = CounterMetricFamily(
            "gpushare_swap_seconds",
            "Seconds spent swapping.",
            labels=[*SESSION_LABELS, "direction"],
        )
        self.waits = HistogramMetricFamily(
            "gpushare_wait_seconds",
            "Seconds from asking for the GPU to being granted it.",
            labels=SESSION_LABELS,
        )
        self.sstate = GaugeMetricFamily(
            "gpushare_session_state",
            "1 for the session's state.",
            labels=[*SESSION_LABELS, "state"],
        )

    def add(self, g: GpuStatus, s: SessionStatus) -> None:
        marks = [len(fam.samples) for fam in self.families()]
        self._add(g, s)
        if s.claim:  # since issue 41: a claimed session's series carry its claim's UID too
            for fam, mark in zip(self.families(), marks, strict=True):
                fam.samples[mark:] = [
                    x._replace(labels={**x.labels, "claim": s.claim}) for x in fam.samples[mark:]
                ]

    def _add(self, g: GpuStatus, s: SessionStatus) -> None:
        sl = [str(g.index), g.uuid, s.namespace, s.pod, s.container, str(s.id)]
        for figure, fam in self.s_counters:
            fam.add_metric(sl, figure(s))
        for figure, gauge in self.s_gauges:
            gauge.add_metric(sl, figure(s))
        for d, n, nbytes, secs in (
            ("out", s.swap_out_total, s.swap_out_bytes_total, s.swap_out_seconds_total),
            ("in", s.swap_in_total, s.swap_in_bytes_total, s.swap_in_seconds_total),
        ):
            self.swaps.add_metric([*sl, d], n)
            self.swap_bytes.add_metric([*sl, d], nbytes)
            self.swap_secs.add_metric([*sl, d], secs)
        cum, buckets = 0, []
        for le, k in zip([*WAIT_BUCKETS, float("inf")], s.wait_seconds_buckets, strict=True):
            cum += k
            buckets.append(("+Inf" if le == float("inf") else repr(float(le)), cum))
        self.waits.add_metric(sl, buckets, sum_value=s.wait_seconds_completed_total)
        for stt in State:
            self.sstate.add_metric([*sl, stt.value], 1.0 if s.state == stt.value else 0.0)

    def families(self) -> Iterator[Metric]:
        yield from (fam for _, fam in self.s_counters)
        yield from (gauge for _, gauge in self.s_gauges)
        yield from (self.swaps, self.swap_bytes, self.swap_secs, self.waits, self.sstate)


@lru_cache(maxsize=1024)
def user_name(uid: int) -> str:
    """The uid's name on this node, else the number (a container's user, say)."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def session_info(st: NodeStatus) -> Iterator[Metric]:
    """``gpushare_session_info{gpu, gpu_uuid, namespace, pod, container, session, name,
    user} 1``: one series per session, so that any per-session series joins to the name
    a person knows, ``* on(instance, gpu, session) group_left(name) gpushare_session_info``
    (no pid: it would make a series per process for nothing a name does not say)."""
    info = InfoMetricFamily(
        "gpushare_session",
        "Who each session is: its name and user (join on gpu and session).",
        labels=SESSION_LABELS,
    )
    for g in st.gpus:
        for s in g.sessions:
            sl = [str(g.index), g.uuid, s.namespace, s.pod, s.container, str(s.id)]
            claimed = {"claim": s.claim} if s.claim else {}  # since issue 41, as above
            info.add_metric(sl, {"name": s.name, "user": user_name(s.uid), **claimed})
    yield info


WORKLOAD_LABELS = ["gpu", "gpu_uuid", "namespace", "pod", "container", "name"]
_WORKLOAD_COUNTERS: list[tuple[str, Callable[[WorkloadStatus], float], str]] = [
    ("sessions", lambda w: w.sessions_total, "Sessions this workload attached."),
    ("lease_seconds", lambda w: w.lease_seconds_total, "Seconds its sessions held a lease."),
    ("wait_seconds", lambda w: w.wait_seconds_total, "Seconds its sessions waited for the GPU."),
    ("grants", lambda w: w.grants_total, "Leases granted to its sessions."),
    ("revokes", lambda w: w.revokes_total, "Leases revoked from its sessions."),
    (
        "utilization_seconds",
        lambda w: w.utilization_seconds_total,
        "GPU utilization attributed to its sessions, busy-seconds.",
    ),
]


def workload_totals(st: NodeStatus) -> Iterator[Metric]:
    """``gpushare_workload_*_total{gpu, gpu_uuid, namespace, pod, container, name}``: a
    workload's figures summed over its sessions of that name and pod, those that detached
    included, counting on across them from the node's start: a job shorter than the
    scrape interval is counted all the same."""
    fams = [
        (f, CounterMetricFamily(f"gpushare_workload_{n}", h, labels=WORKLOAD_LABELS))
        for n, f, h in _WORKLOAD_COUNTERS
    ]
    swap_bytes = CounterMetricFamily(
        "gpushare_workload_swap_bytes",
        "Bytes its sessions swapped, by direction.",
        labels=[*WORKLOAD_LABELS, "direction"],
    )
    for g in st.gpus:
        for w in g.workloads:
            wl = [str(g.index), g.uuid, w.namespace, w.pod, w.container, w.name]
            for figure, fam in fams:
                fam.add_metric(wl, figure(w))
            swap_bytes.add_metric([*wl, "out"], w.swap_out_bytes_total)
            swap_bytes.add_metric([*wl, "in"], w.swap_in_bytes_total)
    yield from (fam for _, fam in fams)
    yield swap_bytes


def registry_for(snapshot: Callable[[], NodeStatus]) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(NodeCollector(snapshot))
    return reg

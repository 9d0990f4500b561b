"""What the exporter exports: a table per kind of series (GPU gauges and counters, a
session's counters, gauges and swaps, a workload's totals), the lines each family writes
for one row, and the text format's pieces as prometheus_client writes them (values,
escaping, headers, label sets). :mod:`gpushare.node.observe.metrics` writes a snapshot
through them.

Names: prefix ``gpushare_``, base units, counters end in ``_total``, ratios are 0-1.
Per-session series carry ``gpu``, ``gpu_uuid``, ``namespace``, ``pod``, ``container``,
``session`` (no pid label), and ``claim`` (the DRA ResourceClaim's UID) where the session
attached by one; GPU-level series carry ``gpu``, ``gpu_uuid`` and
``simulated``. A session's name and user are on one info series per session
(``gpushare_session_info``), joined on ``session`` (Prometheus' advice: names that
change rarely on an info series, not on every series); a workload's totals by name and
pod outlive its sessions (``gpushare_workload_*_total``, node/keep/totals.py). A series is
added by a line in one of the tables below.
"""

from __future__ import annotations

import itertools
import math
import platform
import pwd
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from functools import lru_cache
from operator import attrgetter
from typing import Any

from gpushare._version import __version__
from gpushare.core.sessions import WAIT_BUCKETS, State
from gpushare.status import GpuStatus, SessionStatus

# --- what is exported -------------------------------------------------------------------
# (metric, help, the GpuStatus figure) for GPU-level gauges
_GPU_GAUGES: list[tuple[str, str, Callable[[GpuStatus], float]]] = [
    ("gpu_memory_bytes", "The GPU's memory.", lambda g: g.memory_bytes),
    (
        "gpu_usable_bytes",
        "The GPU's memory less the reserve: what sessions may use.",
        lambda g: g.usable_bytes,
    ),
    (
        "gpu_used_bytes",
        "Memory in use now, holders counted at their limits.",
        lambda g: g.used_bytes,
    ),
    (
        "gpu_utilization_ratio",
        "The GPU's utilization, last sample (0-1).",
        lambda g: g.utilization_ratio,
    ),
    ("gpu_queue_length", "Sessions waiting for the GPU.", lambda g: len(g.queue)),
    ("gpu_holders", "Sessions holding a lease.", lambda g: len(g.holders)),
    ("tq_seconds", "The time quantum.", lambda g: g.tq_s),
]
# (metric, help, the GpuStatus figure) for GPU-level counters (the name less _total)
_GPU_COUNTERS: list[tuple[str, str, Callable[[GpuStatus], float]]] = [
    (
        "shared_utilization_seconds",
        "GPU busy-seconds in shared periods that no per-process sample attributed.",
        lambda g: g.shared_utilization_seconds_total,
    ),
    ("gpu_grants", "Leases granted on the GPU.", lambda g: g.grants_total),
]
# (metric, the SessionStatus field, help) for per-session counters and gauges
_SESSION_COUNTERS: list[tuple[str, str, str]] = [
    ("lease_seconds", "lease_seconds_total", "Seconds this session held a lease."),
    ("grants", "grants_total", "Leases granted to this session."),
    ("revokes", "revokes_total", "Leases revoked from this session at a quantum's end."),
    ("escalations", "escalations_total", "Escalations applied to this session."),
    ("bursts", "bursts_total", "Bursts (requests for the GPU) this session made."),
    ("turns", "turns_total", "Interactive turns granted to this session."),
    (
        "reclaims",
        "reclaims_total",
        "Bursts this session gave back (memory lent above its request).",
    ),
    (
        "discarded_bytes",
        "discarded_bytes_total",
        "Bytes of discardable memory this session dropped instead of swapping them out.",
    ),
    (
        "reclaimed_bytes",
        "reclaimed_bytes_total",
        "Bytes lent above this session's request that its reclaims took back.",
    ),
    (
        "utilization_seconds",
        "utilization_seconds_total",
        "GPU utilization attributed to this session through its lease, in busy-seconds.",
    ),
]
_SESSION_GAUGES: list[tuple[str, str, str]] = [
    ("resident_bytes", "resident_bytes", "Bytes of this session's memory on the GPU."),
    ("swapped_bytes", "swapped_bytes", "Bytes of this session's GPU memory in host memory."),
    ("memory_limit_bytes", "memory_limit_bytes", "This session's GPU memory limit."),
    (
        "memory_request_bytes",
        "memory_request_bytes",
        "This session's GPU memory request (what the node guarantees and packs by).",
    ),
    ("weight", "weight", "This session's weight under policy weighted."),
    ("turn_credit_seconds", "turn_credit_seconds", "This session's turn credit, GPU seconds."),
    (
        "usual_burst_seconds",
        "usual_burst_seconds",
        "The lower median of this session's recent bursts, GPU seconds (0: none yet).",
    ),
    (
        "measured_use_ratio",
        "measured_use_ratio",
        "The fraction of the last minute or so this session wanted the GPU.",
    ),
]
# (metric, help, the fields out and in) for per-session counters by direction
_SESSION_SWAPS: list[tuple[str, str, str, str]] = [
    ("swaps", "Swaps by direction.", "swap_out_total", "swap_in_total"),
    (
        "swap_bytes",
        "Bytes swapped by direction.",
        "swap_out_bytes_total",
        "swap_in_bytes_total",
    ),
    (
        "swap_seconds",
        "Seconds spent swapping.",
        "swap_out_seconds_total",
        "swap_in_seconds_total",
    ),
]
# Every SessionStatus field the session's lines show (beside its GPU and id): when none
# changed since the last scrape, its lines are the last scrape's.
_SHOWN = attrgetter(
    "claim",
    "namespace",
    "pod",
    "container",
    "name",
    "uid",
    "state",
    "gang",
    "gang_rank",
    "wait_seconds_completed_total",
    "wait_seconds_buckets",
    *(f for _, f, _ in _SESSION_COUNTERS),
    *(f for _, f, _ in _SESSION_GAUGES),
    *(f for _, _, o, i in _SESSION_SWAPS for f in (o, i)),
)
# (metric, the WorkloadStatus field, help) for a workload's counters
_WORKLOAD_COUNTERS: list[tuple[str, str, str]] = [
    ("sessions", "sessions_total", "Sessions this workload attached."),
    ("lease_seconds", "lease_seconds_total", "Seconds its sessions held a lease."),
    ("wait_seconds", "wait_seconds_total", "Seconds its sessions waited for the GPU."),
    ("grants", "grants_total", "Leases granted to its sessions."),
    ("revokes", "revokes_total", "Leases revoked from its sessions."),
    (
        "utilization_seconds",
        "utilization_seconds_total",
        "GPU utilization attributed to its sessions, busy-seconds.",
    ),
]
_WORKLOAD_SHOWN = attrgetter(
    *(f for _, f, _ in _WORKLOAD_COUNTERS), "swap_out_bytes_total", "swap_in_bytes_total"
)
_LE = [repr(float(b)) for b in WAIT_BUCKETS] + ["+Inf"]
_STATES = [st.value for st in State]


# --- the text format, as prometheus_client's generate_latest writes it ------------------
def value(v: float) -> str:
    """A sample's value as Go (and prometheus_client) write it: exponents from 1e7."""
    if v.__class__ is int and 0 <= v < 10**15:  # counts and bytes: the same, sooner
        if v < len(_SMALL):
            return _SMALL[v]
        s = str(v)
        if len(s) <= 6:
            return s + ".0"
        return f"{s[0]}.{s[1:]}".rstrip("0.") + f"e+{len(s) - 1:02d}"
    d = float(v)
    if math.isinf(d):
        return "+Inf" if d > 0 else "-Inf"
    if math.isnan(d):
        return "NaN"
    s = repr(d)
    dot = s.find(".")
    if d > 0 and dot > 6:
        mantissa = f"{s[0]}.{s[1:dot]}{s[dot + 1 :]}".rstrip("0.")
        return f"{mantissa}e+{dot - 1:02d}"
    return s


_SMALL = [f"{i}.0" for i in range(1024)]


def _escape(v: str) -> str:
    return v.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _header(name: str, kind: str, help_: str) -> str:
    doc = help_.replace("\\", r"\\").replace("\n", r"\n")
    return f"# HELP {name} {doc}\n# TYPE {name} {kind}\n"


class Labels:
    """One label set, written sorted by name (as prometheus_client does), alone or with
    one more label in its place (its value given escaped: most are constants)."""

    __slots__ = ("_pairs", "_splits", "plain")

    def __init__(self, **labels: str) -> None:
        self._pairs = sorted((k, f'{k}="{_escape(v)}"') for k, v in labels.items())
        self.plain = "{" + ",".join(p for _, p in self._pairs) + "}"
        self._splits: dict[str, tuple[str, str]] = {}

    def with_(self, name: str, v: str) -> str:
        pre, post = self.around(name)
        return f"{pre}{v}{post}"

    def plus(self, **more: str) -> str:
        """These and ``more`` (values as they are: escaped here)."""
        pairs = sorted([*self._pairs, *((k, f'{k}="{_escape(v)}"') for k, v in more.items())])
        return "{" + ",".join(p for _, p in pairs) + "}"

    def around(self, name: str) -> tuple[str, str]:
        """What goes before and after the value of label ``name``, added to these."""
        split = self._splits.get(name)
        if split is None:
            before = ",".join(p for k, p in self._pairs if k < name)
            after = ",".join(p for k, p in self._pairs if k > name)
            split = self._splits[name] = (
                "{" + before + "," * bool(before) + f'{name}="',
                '"' + "," * bool(after) + after + "}",
            )
        return split


# --- the lines of a session, of a workload -------------------------------------------------
Lines = Callable[[Any, Labels], str]  # one row's (a SessionStatus, a WorkloadStatus)


@lru_cache(maxsize=1024)
def user_name(uid: int) -> str:
    """The uid's name on this node, else the number (a container's user, say)."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _one(metric: str, field: str) -> Lines:
    get = attrgetter(field)
    return lambda s, lab: f"{metric}{lab.plain} {value(get(s))}\n"


def _by_direction(metric: str, out: str, in_: str) -> Lines:
    def lines(s: Any, lab: Labels) -> str:
        pre, post = lab.around("direction")
        return (
            f"{metric}{pre}out{post} {value(getattr(s, out))}\n"
            f"{metric}{pre}in{post} {value(getattr(s, in_))}\n"
        )

    return lines


def _waits(s: SessionStatus, lab: Labels) -> str:
    pre, post = lab.around("le")
    cums = list(itertools.accumulate(s.wait_seconds_buckets))
    return "".join(
        [
            *(
                f"gpushare_wait_seconds_bucket{pre}{le}{post} {value(n)}\n"
                for le, n in zip(_LE, cums, strict=True)
            ),
            f"gpushare_wait_seconds_count{lab.plain} {value(cums[-1])}\n",
            f"gpushare_wait_seconds_sum{lab.plain} {value(s.wait_seconds_completed_total)}\n",
        ]
    )


def _state(s: SessionStatus, lab: Labels) -> str:
    pre, post = lab.around("state")
    return "".join(
        [f"gpushare_session_state{pre}{st}{post} {_one_if(s.state == st)}\n" for st in _STATES]
    )


def _info(s: SessionStatus, lab: Labels) -> str:
    return f"gpushare_session_info{lab.plus(name=s.name, user=user_name(s.uid))} 1.0\n"


def _gang(s: SessionStatus, lab: Labels) -> str:
    """A rank of a distributed job: its job (the node's gang key) and its rank; no line
    for a session of its own."""
    if not s.gang:
        return ""
    return f"gpushare_session_gang_info{lab.plus(gang=s.gang, rank=str(s.gang_rank))} 1.0\n"


# (header, its lines for one session), in the order they are exposed
_SESSION_FAMILIES: list[tuple[str, Lines]] = [
    *(
        (_header(f"gpushare_{m}_total", "counter", h), _one(f"gpushare_{m}_total", f))
        for m, f, h in _SESSION_COUNTERS
    ),
    *(
        (_header(f"gpushare_{m}", "gauge", h), _one(f"gpushare_{m}", f))
        for m, f, h in _SESSION_GAUGES
    ),
    *(
        (_header(f"gpushare_{m}_total", "counter", h), _by_direction(f"gpushare_{m}_total", o, i))
        for m, h, o, i in _SESSION_SWAPS
    ),
    (
        _header(
            "gpushare_wait_seconds",
            "histogram",
            "Seconds from asking for the GPU to being granted it.",
        ),
        _waits,
    ),
    (_header("gpushare_session_state", "gauge", "1 for the session's state."), _state),
    (
        _header(
            "gpushare_session_info",
            "gauge",
            "Who each session is: its name and user (join on gpu and session).",
        ),
        _info,
    ),
    (
        _header(
            "gpushare_session_gang_info",
            "gauge",
            "The distributed job (gang) a session is a rank of, and its rank (join on gpu"
            " and session).",
        ),
        _gang,
    ),
]
_WORKLOAD_FAMILIES: list[tuple[str, Lines]] = [
    *(
        (
            _header(f"gpushare_workload_{m}_total", "counter", h),
            _one(f"gpushare_workload_{m}_total", f),
        )
        for m, f, h in _WORKLOAD_COUNTERS
    ),
    (
        _header(
            "gpushare_workload_swap_bytes_total",
            "counter",
            "Bytes its sessions swapped, by direction.",
        ),
        _by_direction(
            "gpushare_workload_swap_bytes_total", "swap_out_bytes_total", "swap_in_bytes_total"
        ),
    ),
]


@dataclass(frozen=True)
class _Rows:
    """A kind of row (a session, a workload): its families, what tells one from another
    on a GPU, what its lines show, and its labels."""

    families: list[tuple[str, Lines]]
    ident: Callable[[Any], Hashable]
    shown: Callable[[Any], Any]
    labels: Callable[[GpuStatus, Any], Labels]


_SESSIONS = _Rows(
    _SESSION_FAMILIES,
    attrgetter("id"),
    _SHOWN,
    lambda g, s: Labels(
        gpu=str(g.index),
        gpu_uuid=g.uuid,
        namespace=s.namespace,
        pod=s.pod,
        container=s.container,
        session=str(s.id),
        **({"claim": s.claim} if s.claim else {}),
    ),
)
_WORKLOADS = _Rows(
    _WORKLOAD_FAMILIES,
    attrgetter("name", "namespace", "pod", "container"),
    _WORKLOAD_SHOWN,
    lambda g, w: Labels(
        gpu=str(g.index),
        gpu_uuid=g.uuid,
        namespace=w.namespace,
        pod=w.pod,
        container=w.container,
        name=w.name,
    ),
)

_BUILD = _header("gpushare_build_info", "gauge", "gpushare version and Python.") + (
    f"gpushare_build_info{Labels(version=__version__, python=platform.python_version()).plain}"
    " 1.0\n"
)


def _bool(b: bool) -> str:
    return "true" if b else "false"


def _one_if(b: bool) -> str:
    return "1.0" if b else "0.0"

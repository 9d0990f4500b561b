"""The Prometheus exporter: custom collectors over a snapshot of the node's state.

Every scrape takes one snapshot (the same object ``ctl status --json`` prints), made in
the daemon's event loop, so the figures of one scrape are consistent with each other.
Names: prefix ``gpushare_``, base units, counters end in ``_total``, ratios are 0-1.
Per-session series carry ``gpu``, ``gpu_uuid``, ``namespace``, ``pod``, ``container``,
``session`` (no pid label); GPU-level series carry ``gpu``, ``gpu_uuid`` and
``simulated``.
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

from gpushare._version import __version__
from gpushare.core.arbiter import MODES, POLICIES, WAIT_BUCKETS, State

DEFAULT_PORT = 9423
GPU_LABELS = ["gpu", "gpu_uuid", "simulated"]
SESSION_LABELS = ["gpu", "gpu_uuid", "namespace", "pod", "container", "session"]

# (metric, status key, help) for per-session counters and gauges
_SESSION_COUNTERS = [
    ("lease_seconds", "lease_seconds_total", "Seconds this session held a lease."),
    ("grants", "grants_total", "Leases granted to this session."),
    ("revokes", "revokes_total", "Leases revoked from this session at a quantum's end."),
    ("escalations", "escalations_total", "Escalations applied to this session."),
    ("bursts", "bursts_total", "Bursts (requests for the GPU) this session made."),
    (
        "utilization_seconds",
        "utilization_seconds_total",
        "GPU utilization attributed to this session through its lease, in busy-seconds.",
    ),
]
_SESSION_GAUGES = [
    ("resident_bytes", "resident_bytes", "Bytes of this session's memory on the GPU."),
    ("swapped_bytes", "swapped_bytes", "Bytes of this session's GPU memory in host memory."),
    ("memory_limit_bytes", "memory_limit_bytes", "This session's GPU memory limit."),
    ("weight", "weight", "This session's weight under policy weighted."),
]


class NodeCollector(Collector):
    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        st = self.snapshot()
        info = InfoMetricFamily("gpushare_build", "gpushare version and Python.")
        info.add_metric([], {"version": __version__, "python": platform.python_version()})
        yield info

        ginfo = InfoMetricFamily("gpushare_gpu", "Each GPU the node arbitrates.", labels=GPU_LABELS)
        g_gauges = {
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
        tq = GaugeMetricFamily("gpushare_tq_seconds", "The time quantum.", labels=GPU_LABELS)
        mode = GaugeMetricFamily(
            "gpushare_mode", "1 for the GPU's arbitration mode.", labels=[*GPU_LABELS, "mode"]
        )
        policy = GaugeMetricFamily(
            "gpushare_policy", "1 for the GPU's share policy.", labels=[*GPU_LABELS, "policy"]
        )
        ggrants = CounterMetricFamily(
            "gpushare_gpu_grants", "Leases granted on the GPU.", labels=GPU_LABELS
        )
        shared = CounterMetricFamily(
            "gpushare_shared_utilization_seconds",
            "GPU busy-seconds in shared periods that no per-process sample attributed.",
            labels=GPU_LABELS,
        )
        states = GaugeMetricFamily(
            "gpushare_sessions", "Sessions by state.", labels=[*GPU_LABELS, "state"]
        )
        s_counters = {
            k: CounterMetricFamily(f"gpushare_{name}", h, labels=SESSION_LABELS)
            for name, k, h in _SESSION_COUNTERS
        }
        s_gauges = {
            k: GaugeMetricFamily(f"gpushare_{name}", h, labels=SESSION_LABELS)
            for name, k, h in _SESSION_GAUGES
        }
        swaps = CounterMetricFamily(
            "gpushare_swaps", "Swaps by direction.", labels=[*SESSION_LABELS, "direction"]
        )
        swap_bytes = CounterMetricFamily(
            "gpushare_swap_bytes",
            "Bytes swapped by direction.",
            labels=[*SESSION_LABELS, "direction"],
        )
        swap_secs = CounterMetricFamily(
            "gpushare_swap_seconds",
            "Seconds spent swapping.",
            labels=[*SESSION_LABELS, "direction"],
        )
        waits = HistogramMetricFamily(
            "gpushare_wait_seconds",
            "Seconds from asking for the GPU to being granted it.",
            labels=SESSION_LABELS,
        )
        sstate = GaugeMetricFamily(
            "gpushare_session_state",
            "1 for the session's state.",
            labels=[*SESSION_LABELS, "state"],
        )

        for g in st["gpus"]:
            gl = [str(g["index"]), g["uuid"], "true" if g["simulated"] else "false"]
            ginfo.add_metric(gl, {"name": g["name"]})
            for k in ("memory_bytes", "usable_bytes", "used_bytes", "utilization_ratio"):
                g_gauges[k].add_metric(gl, g[k])
            g_gauges["queue_length"].add_metric(gl, len(g["queue"]))
            g_gauges["holders"].add_metric(gl, len(g["holders"]))
            tq.add_metric(gl, g["tq_s"])
            for m in MODES:
                mode.add_metric([*gl, m], 1.0 if g["mode"] == m else 0.0)
            for pol in POLICIES:
                policy.add_metric([*gl, pol], 1.0 if g["policy"] == pol else 0.0)
            shared.add_metric(gl, g["shared_utilization_seconds_total"])
            ggrants.add_metric(gl, g["grants_total"])
            counts = {s.value: 0 for s in State}
            for s in g["sessions"]:
                counts[s["state"]] += 1
                sl = [
                    str(g["index"]),
                    g["uuid"],
                    s["namespace"],
                    s["pod"],
                    s["container"],
                    str(s["id"]),
                ]
                for k, fam in s_counters.items():
                    fam.add_metric(sl, s[k])
                for k, gauge in s_gauges.items():
                    gauge.add_metric(sl, s[k])
                for d in ("out", "in"):
                    swaps.add_metric([*sl, d], s[f"swap_{d}_total"])
                    swap_bytes.add_metric([*sl, d], s[f"swap_{d}_bytes_total"])
                    swap_secs.add_metric([*sl, d], s[f"swap_{d}_seconds_total"])
                cum, buckets = 0, []
                for le, n in zip(
                    [*WAIT_BUCKETS, float("inf")], s["wait_seconds_buckets"], strict=True
                ):
                    cum += n
                    buckets.append(("+Inf" if le == float("inf") else repr(float(le)), cum))
                waits.add_metric(sl, buckets, sum_value=s["wait_seconds_completed_total"])
                for stt in State:
                    sstate.add_metric([*sl, stt.value], 1.0 if s["state"] == stt.value else 0.0)
            for state_name, n in counts.items():
                states.add_metric([*gl, state_name], n)
        yield ginfo
        yield from g_gauges.values()
        yield from (tq, mode, policy, shared, ggrants, states)
        yield from s_counters.values()
        yield from s_gauges.values()
        yield from (swaps, swap_bytes, swap_secs, waits, sstate)


def registry_for(snapshot: Callable[[], dict[str, Any]]) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(NodeCollector(snapshot))
    return reg


def serve(registry: CollectorRegistry, port: int, address: str) -> Callable[[], None]:
    """Serve ``/metrics`` on a thread; returns a function that stops it."""
    from prometheus_client import start_http_server

    server, thread = start_http_server(port, addr=address, registry=registry)

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    return stop

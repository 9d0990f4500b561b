"""The Prometheus exporter: the text exposition of a snapshot of the node's state.

Every scrape takes one snapshot (the same object ``ctl status --json`` prints), made in
the daemon's event loop, so the figures of one scrape are consistent with each other;
that is all a scrape asks of the loop. The text is written in the exporter's process
(node/observe/exporter_process.py) by :class:`Exposition`, in Prometheus' text format (0.0.4)
exactly as prometheus_client writes it, without its per-sample objects: a session's
lines are written again only when one of the figures they show changed, and are
otherwise reused from the last scrape, so a scrape of many idle sessions costs little
more than joining strings.

Names, labels and the tables of series: :mod:`gpushare.node.observe.metric_tables`;
the HTTP server: :mod:`gpushare.node.observe.metrics_http`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterator
from typing import Any

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector, CollectorRegistry

from gpushare.core.sessions import State
from gpushare.node.observe.metric_tables import (
    _BUILD,
    _GPU_COUNTERS,
    _GPU_GAUGES,
    _SESSIONS,
    _WORKLOADS,
    Labels,
    _bool,
    _escape,
    _header,
    _one_if,
    _Rows,
    value,
)
from gpushare.settings import MODES, POLICIES
from gpushare.status import GpuStatus, NodeStatus


class Exposition:
    """Writes the exposition of a snapshot. Thread-safe (scrapes take turns); keeps each
    session's (and workload's) lines until one of its figures changes or it is gone."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # per kind of row: (gpu, gpu uuid, row) -> (its shown figures, its lines per family)
        self._last: dict[int, dict[tuple[int, str, Hashable], tuple[Any, list[bytes]]]] = {}

    def render(self, st: NodeStatus) -> bytes:
        with self._lock:
            gpus = [
                (g, Labels(gpu=str(g.index), gpu_uuid=g.uuid, simulated=_bool(g.simulated)))
                for g in st.gpus
            ]
            out = ["".join(self._gpu_text(gpus)).encode()]
            for kind, items in (
                (_SESSIONS, [(g, s) for g in st.gpus for s in g.sessions]),
                (_WORKLOADS, [(g, w) for g in st.gpus for w in g.workloads]),
            ):
                rows = self._rows(kind, items)
                for i, (header, _) in enumerate(kind.families):
                    out.append(header.encode())
                    out.extend([r[i] for r in rows])
            return b"".join(out)  # one copy (joining per family first took 10x as long)

    def _gpu_text(self, gpus: list[tuple[GpuStatus, Labels]]) -> Iterator[str]:
        yield _BUILD
        yield _header("gpushare_gpu_info", "gauge", "Each GPU the node arbitrates.")
        for g, lab in gpus:
            yield f"gpushare_gpu_info{lab.with_('name', _escape(g.name))} 1.0\n"
        for metric, h, fig in _GPU_GAUGES:
            yield from _per_gpu(f"gpushare_{metric}", "gauge", h, fig, gpus)
        yield from _one_of(
            "gpushare_mode", "1 for the GPU's arbitration mode.", "mode", MODES,
            lambda g: g.mode, gpus,
        )  # fmt: skip
        yield from _one_of(
            "gpushare_policy", "1 for the GPU's share policy.", "policy", POLICIES,
            lambda g: g.policy, gpus,
        )  # fmt: skip
        for metric, h, fig in _GPU_COUNTERS:
            yield from _per_gpu(f"gpushare_{metric}_total", "counter", h, fig, gpus)
        yield from _sessions_by_state(gpus)
        yield from _gang_regroups(gpus)

    def _rows(self, kind: _Rows, items: list[tuple[GpuStatus, Any]]) -> list[list[bytes]]:
        """Each row's lines per family, the last scrape's where nothing they show changed."""
        last, kept = self._last.get(id(kind), {}), {}
        rows = []
        for g, x in items:
            key = (g.index, g.uuid, kind.ident(x))
            shown = kind.shown(x)
            had = last.get(key)
            if had is None or had[0] != shown:
                lab = kind.labels(g, x)
                had = (shown, [lines(x, lab).encode() for _, lines in kind.families])
            kept[key] = had
            rows.append(had[1])
        self._last[id(kind)] = kept  # rows gone are forgotten
        return rows


def _per_gpu(
    name: str,
    kind: str,
    help_: str,
    fig: Callable[[GpuStatus], float],
    gpus: list[tuple[GpuStatus, Labels]],
) -> Iterator[str]:
    yield _header(name, kind, help_)
    for g, lab in gpus:
        yield f"{name}{lab.plain} {value(fig(g))}\n"


def _one_of(
    name: str,
    help_: str,
    label: str,
    choices: tuple[str, ...],
    of: Callable[[GpuStatus], str],
    gpus: list[tuple[GpuStatus, Labels]],
) -> Iterator[str]:
    """A gauge per GPU and choice, 1 for the GPU's own (``of``) and 0 for the others."""
    yield _header(name, "gauge", help_)
    for g, lab in gpus:
        for c in choices:
            yield f"{name}{lab.with_(label, c)} {_one_if(of(g) == c)}\n"


def _sessions_by_state(gpus: list[tuple[GpuStatus, Labels]]) -> Iterator[str]:
    """Each GPU's count of sessions in each state (0 for a state none is in)."""
    yield _header("gpushare_sessions", "gauge", "Sessions by state.")
    for g, lab in gpus:
        counts = dict.fromkeys([x.value for x in State], 0)
        for s in g.sessions:
            counts[s.state] += 1
        for state, n in counts.items():
            yield f"gpushare_sessions{lab.with_('state', state)} {value(n)}\n"


def _gang_regroups(gpus: list[tuple[GpuStatus, Labels]]) -> Iterator[str]:
    yield _header(
        "gpushare_gang_regroups_total",
        "counter",
        "Parked ranks of a distributed job let go on to their next safe point (one of"
        " its ranks was blocked in a collective).",
    )
    for g, lab in gpus:
        for k in g.gangs:
            yield f"gpushare_gang_regroups_total{lab.with_('gang', _escape(k.gang))}"
            yield f" {value(k.regroups_total)}\n"


# --- for Python callers (and tests): the exposition as prometheus_client's families -----
class _Parsed(Collector):
    def __init__(self, text: Callable[[], bytes]) -> None:
        self.text = text

    def collect(self) -> Iterator[Metric]:
        yield from text_string_to_metric_families(self.text().decode())


def registry_for(snapshot: Callable[[], NodeStatus]) -> CollectorRegistry:
    """A registry whose collection is the exposition of ``snapshot()``, parsed (slow:
    for tests and tools, not for serving)."""
    exposition = Exposition()
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Parsed(lambda: exposition.render(snapshot())))
    return reg

"""Totals that outlive sessions: a workload's figures by name (and pod), summed over its
sessions on a GPU, those gone included.

A short job can attach, work and detach between two scrapes: its session's series are
gone before Prometheus sees them. Its figures are not lost: at detach they are added to
its workload's totals (``gpushare_workload_*_total``, ``status.gpus[].workloads``), which
count on across the sessions of the same name, pod, namespace and container, like any
Prometheus counter, from the node's start. At most :data:`MAX_WORKLOADS` workloads per
GPU keep totals: past that, the one whose last session left longest ago is forgotten (a
counter reset for it), so a node that sees endless distinct names keeps bounded series.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from gpushare.status import SessionStatus, WorkloadStatus

MAX_WORKLOADS = 1000  # per GPU

Key = tuple[str, str, str, str]  # name, namespace, pod, container


def key_of(s: SessionStatus | WorkloadStatus) -> Key:
    return (s.name, s.namespace, s.pod, s.container)


def _add(w: WorkloadStatus, s: SessionStatus) -> None:
    w.sessions_total += 1
    w.lease_seconds_total += s.lease_seconds_total
    w.wait_seconds_total += s.wait_seconds_total
    w.grants_total += s.grants_total
    w.revokes_total += s.revokes_total
    w.swap_out_bytes_total += s.swap_out_bytes_total
    w.swap_in_bytes_total += s.swap_in_bytes_total
    w.utilization_seconds_total += s.utilization_seconds_total


def _empty(k: Key) -> WorkloadStatus:
    return WorkloadStatus(name=k[0], namespace=k[1], pod=k[2], container=k[3])


class Totals:
    """One GPU's retired figures, by workload."""

    def __init__(self, limit: int = MAX_WORKLOADS) -> None:
        self.limit = limit
        self._retired: OrderedDict[Key, WorkloadStatus] = OrderedDict()

    def retire(self, s: SessionStatus) -> None:
        """A session leaves: its final figures go to its workload's totals."""
        k = key_of(s)
        w = self._retired.pop(k, None) or _empty(k)
        _add(w, s)
        self._retired[k] = w  # the most recent last
        while len(self._retired) > self.limit:
            self._retired.popitem(last=False)

    def workloads(self, live: Iterable[SessionStatus]) -> list[WorkloadStatus]:
        """Every workload's totals now: what its gone sessions left, plus its live ones."""
        out: dict[Key, WorkloadStatus] = {}
        for k, w in self._retired.items():
            out[k] = WorkloadStatus(**{f: getattr(w, f) for f in w.__struct_fields__})
        for s in live:
            k = key_of(s)
            w = out.setdefault(k, _empty(k))
            _add(w, s)
            w.sessions += 1
        return sorted(out.values(), key=key_of)

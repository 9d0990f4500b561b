"""Pod names for the kernel's pod UIDs: this node's pods, listed and watched through the
Kubernetes API (the official client, a field selector on ``spec.nodeName``), cached.

The cache is what answers; the watch only keeps it fresh. When the API server is
unreachable the cache goes on answering with what it knew, and the watcher re-lists with
backoff until it is back. Container names come from ``status.containerStatuses``, whose
``containerID`` (``containerd://<id>``, ``cri-o://<id>``, ``docker://<id>``) matches the
container ID the kernel's cgroup path gives.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from gpushare.node.kube.api import Deadlines, Expired, Kube
from gpushare.settings import SHARING_MODES
from gpushare.units import MAX_SIZE, is_fraction, parse_quantity

log = logging.getLogger("gpushare.node.k8s")

# KAI Scheduler's annotations (as gpushare.client.env reads them from the downward API):
# the node reads the same pod's through the API, where the workload cannot rewrite them.
SHARING_MODE_ANNOTATION = "kai.scheduler/gpu-compute-sharing-mode"
_NV, _KAI = "nvidia.com/container.", "kai.scheduler/container."
_NV_REQUEST, _NV_LIMIT, _NV_MODE = ".gpu-memory.request", ".gpu-memory.limit", ".gpu-compute.mode"
_KAI_PORTION_LIMIT = ".gpu-memory.portion.limit"
_POD_KEYS = ("gpu-fraction", "gpu-fraction.limit", "gpu-memory", "gpu-memory.limit",
             SHARING_MODE_ANNOTATION)  # fmt: skip


@dataclass(frozen=True)
class PodInfo:
    uid: str
    namespace: str
    name: str
    containers: Mapping[str, str]  # container ID (hex) -> container name
    fraction: float | None = None  # KAI's gpu-fraction annotation, when it is one
    # its KAI annotations that bound a session (memory, compute-sharing mode), as the API
    # serves them: those that matter only, so a pod's other notes cost the cache nothing
    notes: Mapping[str, str] = field(default_factory=dict)

    def _mine(self, container: str) -> dict[str, str]:
        """Per-container annotations (suffix -> value) of ``container``: where the
        kernel's container ID names none the API knows, of the one container they name
        (KAI gives one container a pod its GPU fraction), else of none."""
        named: dict[str, dict[str, str]] = {}
        for key, value in self.notes.items():
            for prefix, suffix in _PER_CONTAINER:
                if key.startswith(prefix) and key.endswith(suffix):
                    named.setdefault(key[len(prefix) : -len(suffix)], {})[suffix] = value
        if container:
            return named.get(container, {})
        return next(iter(named.values())) if len(named) == 1 else {}

    def sharing(self, container: str) -> str:
        """Its compute-sharing mode (KAI's annotation, or NvFractions' per container):
        "" (the GPU's mode) where none is written, or one that is not a mode, or two that
        differ (the workload is refused its own reading of such annotations)."""
        modes = {
            self.notes.get(SHARING_MODE_ANNOTATION, ""),
            self._mine(container).get(_NV_MODE, ""),
        }
        modes.discard("")
        mode = modes.pop() if len(modes) == 1 else ""
        return mode if mode in SHARING_MODES else ""

    def memory_bound(self, container: str, capacity: int) -> int | None:
        """The most GPU memory its annotations give it on a GPU of ``capacity`` bytes, in
        KAI's precedence (docs/kubernetes.md): its limit, else its request; None where they
        give none (a pod KAI gave no fraction). An annotation that cannot be read is
        passed over (logged): the next one in precedence bounds it."""
        mine = self._mine(container)
        sources: list[tuple[str, str, str]] = [  # (annotation, value, how it is read)
            (_KAI + container + _KAI_PORTION_LIMIT, mine.get(_KAI_PORTION_LIMIT, ""), "fraction"),
            ("gpu-fraction.limit", self.notes.get("gpu-fraction.limit", ""), "fraction"),
            (_NV + container + _NV_LIMIT, mine.get(_NV_LIMIT, ""), "quantity"),
            ("gpu-memory.limit", self.notes.get("gpu-memory.limit", ""), "quantity"),
            ("gpu-memory", self.notes.get("gpu-memory", ""), "mib"),
            ("gpu-fraction", self.notes.get("gpu-fraction", ""), "fraction"),
            (_NV + container + _NV_REQUEST, mine.get(_NV_REQUEST, ""), "quantity"),
        ]
        for key, value, kind in sources:
            if not value:
                continue
            try:
                return _bytes(value, kind, capacity, key)
            except ValueError as e:
                log.warning("pod %s/%s: %s; passed over", self.namespace, self.name, e)
        return None


_PER_CONTAINER = ((_NV, _NV_REQUEST), (_NV, _NV_LIMIT), (_NV, _NV_MODE), (_KAI, _KAI_PORTION_LIMIT))


def _bytes(value: str, kind: str, capacity: int, key: str) -> int:
    """An annotation's figure in bytes of a GPU of ``capacity``, or ValueError."""
    if kind == "quantity":
        return min(parse_quantity(value, f"annotation {key}"), capacity)
    if kind == "mib":
        n = int(value) if value.strip().isdigit() else 0
        if not 0 < n * 2**20 <= MAX_SIZE:
            raise ValueError(f"annotation {key}={value!r} is not a whole number of MiB")
        return min(n * 2**20, capacity)
    try:
        f = float(value)
    except ValueError:
        f = math.nan
    if not is_fraction(f):
        raise ValueError(f"annotation {key}={value!r} is not a fraction in (0, 1]")
    return max(1, int(capacity * f))


def _notes(meta: Mapping[str, Any]) -> dict[str, str]:
    notes = meta.get("annotations") or {}
    return {
        k: str(v)
        for k, v in notes.items()
        if k in _POD_KEYS or any(k.startswith(p) and k.endswith(x) for p, x in _PER_CONTAINER)
    }


def _fraction(meta: Mapping[str, Any]) -> float | None:
    text = (meta.get("annotations") or {}).get("gpu-fraction")
    try:
        f = float(text) if text is not None else None
    except (TypeError, ValueError):
        return None
    return f if f is not None and 0 < f <= 1 else None  # NaN fails too


def pod_info(obj: Mapping[str, Any]) -> PodInfo:
    """From a Pod as the API serves it (JSON, camelCase)."""
    meta = obj["metadata"]
    status = obj.get("status") or {}
    containers: dict[str, str] = {}
    for key in ("initContainerStatuses", "containerStatuses", "ephemeralContainerStatuses"):
        for cs in status.get(key) or []:
            cid = cs.get("containerID") or ""
            if "://" in cid:
                containers[cid.split("://", 1)[1]] = cs["name"]
    return PodInfo(
        meta["uid"], meta["namespace"], meta["name"], containers, _fraction(meta), _notes(meta)
    )


class PodCache:
    def __init__(self) -> None:
        self._pods: dict[str, PodInfo] = {}
        self._lock = threading.Lock()
        self.synced = False  # a full list arrived at least once

    def replace(self, objs: Sequence[Mapping[str, Any]]) -> None:
        pods = {p.uid: p for p in map(pod_info, objs)}
        with self._lock:
            self._pods = pods
            self.synced = True

    def apply(self, kind: str, obj: Mapping[str, Any]) -> None:
        """A watch event: ADDED, MODIFIED, DELETED."""
        p = pod_info(obj)
        with self._lock:
            if kind == "DELETED":
                self._pods.pop(p.uid, None)
            else:
                self._pods[p.uid] = p

    def resolve(self, pod_uid: str, container_id: str = "") -> tuple[str, str, str] | None:
        """(namespace, pod, container) for a pod UID (and container ID), if known."""
        with self._lock:
            p = self._pods.get(pod_uid)
        if p is None:
            return None
        return p.namespace, p.name, p.containers.get(container_id, "")

    def fraction(self, pod_uid: str) -> float | None:
        """The pod's gpu-fraction annotation, if it has one and is known."""
        with self._lock:
            p = self._pods.get(pod_uid)
        return p.fraction if p is not None else None

    def pod(self, pod_uid: str) -> PodInfo | None:
        """The pod as the API last served it, if known."""
        with self._lock:
            return self._pods.get(pod_uid)

    def __len__(self) -> int:
        return len(self._pods)


class PodSource(Protocol):
    def list(self, node: str) -> tuple[list[dict[str, Any]], str]:
        """This node's pods and the list's resourceVersion."""
        ...

    def watch(self, node: str, resource_version: str) -> Iterator[tuple[str, dict[str, Any]]]:
        """(event type, pod) from that version on; ends when the server closes it."""
        ...


class KubernetesApi:
    """:class:`PodSource` through the one client (:class:`~gpushare.node.kube.api.Kube`),
    in-cluster or from KUBECONFIG (or ``kubeconfig``), each call under its deadline
    (:class:`~gpushare.node.kube.api.Deadlines`): a watch the server ends after
    ``watch_timeout`` seconds, taken for dead after ``idle_timeout`` (default
    ``watch_timeout`` + 30 s) of silence; a list that has no answer in
    ``request_timeout``. A refusal is raised as an ``ApiError`` naming its fix
    (410 on a watch: :class:`Expired`).
    """

    def __init__(
        self,
        kubeconfig: str | None = None,
        watch_timeout: float = 300.0,
        idle_timeout: float | None = None,
        request_timeout: float = 60.0,
    ) -> None:
        self.kube = Kube(
            kubeconfig,
            deadlines=Deadlines(request=request_timeout, watch=watch_timeout, idle=idle_timeout),
        )
        self.watch_timeout = int(watch_timeout)

    def list(self, node: str) -> tuple[list[dict[str, Any]], str]:
        core = self.kube.core()
        r = self.kube.call(
            "list pods", core.list_pod_for_all_namespaces, field_selector=f"spec.nodeName={node}"
        )
        items: list[dict[str, Any]] = [self.kube.plain(x) for x in r.items]
        return items, str(r.metadata.resource_version)

    def watch(self, node: str, resource_version: str) -> Iterator[tuple[str, dict[str, Any]]]:
        yield from self.kube.stream(
            "watch pods",
            self.kube.core().list_pod_for_all_namespaces,
            field_selector=f"spec.nodeName={node}",
            resource_version=resource_version,
        )


class PodWatcher:
    """Keeps a :class:`PodCache` fresh from a :class:`PodSource`, on its own thread."""

    def __init__(
        self, cache: PodCache, node: str, source: PodSource | None = None, max_backoff: float = 30.0
    ) -> None:
        self.cache, self.node, self._source = cache, node, source
        self.max_backoff = max_backoff
        self.failures = 0
        self.expired = 0  # watches ended by 410 Gone (normal: the server moved on)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpushare-pods", daemon=True)

    def start(self) -> PodWatcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        delay = 0.5
        while not self._stop.is_set():
            try:
                source = self._source = self._source or KubernetesApi()
                items, rv = source.list(self.node)
                self.cache.replace(items)
                log.info("pods on node %s: %d known", self.node, len(items))
                delay = 0.5
                for kind, obj in source.watch(self.node, rv):
                    if self._stop.is_set():
                        return
                    if kind in ("ADDED", "MODIFIED", "DELETED"):
                        self.cache.apply(kind, obj)
            except Expired as e:
                self.expired += 1
                log.info("pod watch expired (%s): listing again", e)
            except Exception as e:  # API away: keep the cache, try again later
                self.failures += 1
                log.warning(
                    "Kubernetes API: %s; pod names from the cache (%d pods), retrying in %.1f s",
                    e,
                    len(self.cache),
                    delay,
                )
                self._stop.wait(delay)
                delay = min(delay * 2, self.max_backoff)
            # else the watch ended by itself (its timeout): list again

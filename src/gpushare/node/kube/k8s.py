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
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger("gpushare.node.k8s")


@dataclass(frozen=True)
class PodInfo:
    uid: str
    namespace: str
    name: str
    containers: Mapping[str, str]  # container ID (hex) -> container name
    fraction: float | None = None  # KAI's gpu-fraction annotation, when it is one


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
    return PodInfo(meta["uid"], meta["namespace"], meta["name"], containers, _fraction(meta))


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

    def __len__(self) -> int:
        return len(self._pods)


class PodSource(Protocol):
    def list(self, node: str) -> tuple[list[dict[str, Any]], str]:
        """This node's pods and the list's resourceVersion."""
        ...

    def watch(self, node: str, resource_version: str) -> Iterator[tuple[str, dict[str, Any]]]:
        """(event type, pod) from that version on; ends when the server closes it."""
        ...


class Expired(Exception):
    """The watch's resourceVersion is older than the server keeps (410 Gone): list again."""


class KubernetesApi:
    """:class:`PodSource` through the official client, in-cluster or from KUBECONFIG
    (or ``kubeconfig``).

    Every call has a client-side deadline: a connection that dies without a word (a
    node cut off, a load balancer dropping it) fails the call instead of hanging. A watch
    asks the server to end it after ``watch_timeout`` seconds; one silent for longer than
    ``idle_timeout`` (default ``watch_timeout`` + 30 s) is taken for dead.
    """

    def __init__(
        self,
        kubeconfig: str | None = None,
        watch_timeout: float = 300.0,
        idle_timeout: float | None = None,
        request_timeout: float = 60.0,
    ) -> None:
        from kubernetes import client, config  # the k8s extra

        if kubeconfig:
            config.load_kube_config(config_file=kubeconfig)
        else:
            try:
                config.load_incluster_config()
            except config.ConfigException as in_cluster:
                try:
                    config.load_kube_config()
                except config.ConfigException as e:
                    # Both reasons: in a pod it is the first that says what is missing.
                    raise config.ConfigException(
                        f"no Kubernetes API configuration: in-cluster: {in_cluster} (in a"
                        f" pod: mount the service account's token); kubeconfig: {e} (set"
                        " KUBECONFIG)"
                    ) from None
        self.v1 = client.CoreV1Api()
        self.api = client.ApiClient()
        self.watch_timeout = int(watch_timeout)
        idle = idle_timeout if idle_timeout is not None else watch_timeout + 30.0
        self._list_timeout = (10.0, request_timeout)  # (connect, read) seconds
        self._watch_timeout = (10.0, idle)

    def list(self, node: str) -> tuple[list[dict[str, Any]], str]:
        r = self.v1.list_pod_for_all_namespaces(
            field_selector=f"spec.nodeName={node}", _request_timeout=self._list_timeout
        )
        items: list[dict[str, Any]] = [self.api.sanitize_for_serialization(x) for x in r.items]
        return items, str(r.metadata.resource_version)

    def watch(self, node: str, resource_version: str) -> Iterator[tuple[str, dict[str, Any]]]:
        from kubernetes import watch
        from kubernetes.client.rest import ApiException

        w = watch.Watch()
        try:
            for ev in w.stream(
                self.v1.list_pod_for_all_namespaces,
                field_selector=f"spec.nodeName={node}",
                resource_version=resource_version,
                timeout_seconds=self.watch_timeout,
                _request_timeout=self._watch_timeout,
            ):
                yield ev["type"], ev["raw_object"]
        except ApiException as e:
            if e.status == 410:
                raise Expired(str(e.reason)) from None
            raise


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

"""The Kubernetes API as the node's ``GPUShareNode`` needs it: :class:`ObjectApi` (get,
create, patch the status, an Event, watch), and :class:`KubernetesObjects`, that API
through the one client (:class:`~gpushare.node.kube.api.Kube`), whose map of refusals
raises each that means "not here" (no CRD, no right) as :class:`Absent` with its fix,
and an object gone as a ``LookupError``. The client blocks: the reconciler
(:mod:`gpushare.node.kube.gpusharenode`) calls it on threads.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Protocol

from gpushare.node.kube.api import Absent, Conflict, Deadlines, Kube
from gpushare.node.kube.node_status import API_VERSION, GROUP, KIND, PLURAL, VERSION

__all__ = ["Absent", "KubernetesObjects", "ObjectApi"]


class ObjectApi(Protocol):
    def get(self, name: str) -> dict[str, Any] | None: ...
    def create(self, name: str) -> dict[str, Any]: ...
    def patch_status(self, name: str, status: Mapping[str, Any]) -> dict[str, Any]: ...
    def event(self, namespace: str, body: Mapping[str, Any]) -> None: ...
    def watch(self, name: str) -> Iterator[tuple[str, dict[str, Any]]]: ...


class KubernetesObjects:
    """:class:`ObjectApi` through the one client (in-cluster, else KUBECONFIG), each call
    under its deadline. 404 on the kind and 403 raise :class:`Absent`; 404 on the
    object (deleted meanwhile) a ``LookupError``."""

    def __init__(self, kubeconfig: str | None = None, watch_timeout: int = 300) -> None:
        self.kube = Kube(kubeconfig, deadlines=Deadlines(watch=watch_timeout))
        self.watch_timeout = watch_timeout

    def get(self, name: str) -> dict[str, Any] | None:
        # a list by name: the role needs list and watch, not get as well
        r = self.kube.call(
            f"list {PLURAL}",
            self.kube.custom().list_cluster_custom_object,
            GROUP,
            VERSION,
            PLURAL,
            field_selector=f"metadata.name={name}",
        )
        items: list[dict[str, Any]] = r.get("items") or []
        return items[0] if items else None

    def create(self, name: str) -> dict[str, Any]:
        body = {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name}, "spec": {}}
        try:
            out: dict[str, Any] = self.kube.call(
                f"create {KIND} {name}",
                self.kube.custom().create_cluster_custom_object,
                GROUP,
                VERSION,
                PLURAL,
                body,
            )
            return out
        except Conflict:  # made meanwhile (another start of this node)
            got = self.get(name)
            if got is None:
                raise
            return got

    def patch_status(self, name: str, status: Mapping[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = self.kube.call(  # 404 on the object: NotFound, a LookupError
            f"patch {KIND} {name}/status",
            self.kube.custom().patch_cluster_custom_object_status,
            GROUP,
            VERSION,
            PLURAL,
            name,
            {"status": status},
            _content_type="application/merge-patch+json",
        )
        return out

    def event(self, namespace: str, body: Mapping[str, Any]) -> None:
        self.kube.call(
            f"create event in {namespace}",
            self.kube.core().create_namespaced_event,
            namespace,
            body,
        )

    def watch(self, name: str) -> Iterator[tuple[str, dict[str, Any]]]:
        yield from self.kube.stream(
            f"watch {PLURAL}",
            self.kube.custom().list_cluster_custom_object,
            GROUP,
            VERSION,
            PLURAL,
            field_selector=f"metadata.name={name}",
        )

"""The Kubernetes API as the node's ``GPUShareNode`` needs it: :class:`ObjectApi` (get,
create, patch the status, an Event, watch), and :class:`KubernetesObjects`, that API
through the official client, each API refusal that means "not here" (no CRD, no right)
raised as :class:`Absent` with its fix. The client blocks: the reconciler
(:mod:`gpushare.node.kube.gpusharenode`) calls it on threads.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Protocol

from gpushare.node.kube.node_status import API_VERSION, CRD, GROUP, KIND, PLURAL, VERSION


class Absent(Exception):
    """The API has no such kind (the CRD is not installed) or refuses this node's role."""


class ObjectApi(Protocol):
    def get(self, name: str) -> dict[str, Any] | None: ...
    def create(self, name: str) -> dict[str, Any]: ...
    def patch_status(self, name: str, status: Mapping[str, Any]) -> dict[str, Any]: ...
    def event(self, namespace: str, body: Mapping[str, Any]) -> None: ...
    def watch(self, name: str) -> Iterator[tuple[str, dict[str, Any]]]: ...


class KubernetesObjects:
    """:class:`ObjectApi` through the official client (in-cluster, else KUBECONFIG), each
    call with a client-side deadline. 404 on the kind and 403 raise :class:`Absent`."""

    def __init__(self, kubeconfig: str | None = None, watch_timeout: int = 300) -> None:
        from kubernetes import client, config

        cfg = client.Configuration()
        if kubeconfig:
            config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
        else:
            try:
                config.load_incluster_config(client_configuration=cfg)
            except config.ConfigException:
                config.load_kube_config(client_configuration=cfg)
        # One client per thread that calls (the watch's own, the writer's).
        self._writer = client.CustomObjectsApi(client.ApiClient(cfg))
        self._core = client.CoreV1Api(client.ApiClient(cfg))
        self._watcher = client.CustomObjectsApi(client.ApiClient(cfg))
        self.watch_timeout = watch_timeout
        self._timeout = (10.0, 30.0)

    @staticmethod
    def _absent(e: Any, what: str) -> Exception:
        from kubernetes.client.rest import ApiException

        if isinstance(e, ApiException) and e.status == 404:
            return Absent(
                f"{what}: the API server has no {KIND} kind (the CRD {CRD} is not installed:"
                " kubectl apply -k deploy/kubernetes/overlays/plain, or -f"
                " deploy/kubernetes/base/crd.yaml)"
            )
        if isinstance(e, ApiException) and e.status == 403:
            return Absent(
                f"{what}: forbidden ({e.reason}): the node's service account lacks the"
                " rights of deploy/kubernetes/base/rbac.yaml (kubectl apply -k"
                " deploy/kubernetes/overlays/plain)"
            )
        return e  # type: ignore[no-any-return]

    def get(self, name: str) -> dict[str, Any] | None:
        try:  # a list by name: the role needs list and watch, not get as well
            r = self._writer.list_cluster_custom_object(
                GROUP,
                VERSION,
                PLURAL,
                field_selector=f"metadata.name={name}",
                _request_timeout=self._timeout,
            )
        except Exception as e:
            raise self._absent(e, f"list {PLURAL}") from None
        items: list[dict[str, Any]] = r.get("items") or []
        return items[0] if items else None

    def create(self, name: str) -> dict[str, Any]:
        from kubernetes.client.rest import ApiException

        body = {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name}, "spec": {}}
        try:
            out: dict[str, Any] = self._writer.create_cluster_custom_object(
                GROUP, VERSION, PLURAL, body, _request_timeout=self._timeout
            )
            return out
        except ApiException as e:
            if e.status == 409:  # made meanwhile (another start of this node)
                got = self.get(name)
                if got is not None:
                    return got
            raise self._absent(e, f"create {KIND} {name}") from None

    def patch_status(self, name: str, status: Mapping[str, Any]) -> dict[str, Any]:
        from kubernetes.client.rest import ApiException

        try:
            out: dict[str, Any] = self._writer.patch_cluster_custom_object_status(
                GROUP,
                VERSION,
                PLURAL,
                name,
                {"status": status},
                _content_type="application/merge-patch+json",
                _request_timeout=self._timeout,
            )
            return out
        except ApiException as e:
            if e.status == 404 and "not found" in str(e.body).lower() and PLURAL in str(e.body):
                raise LookupError(name) from None  # the object is gone: made again
            raise self._absent(e, f"patch {KIND} {name}/status") from None

    def event(self, namespace: str, body: Mapping[str, Any]) -> None:
        self._core.create_namespaced_event(namespace, body, _request_timeout=self._timeout)

    def watch(self, name: str) -> Iterator[tuple[str, dict[str, Any]]]:
        from kubernetes import watch

        w = watch.Watch()
        try:
            for ev in w.stream(
                self._watcher.list_cluster_custom_object,
                GROUP,
                VERSION,
                PLURAL,
                field_selector=f"metadata.name={name}",
                timeout_seconds=self.watch_timeout,
                _request_timeout=(10.0, self.watch_timeout + 30.0),
            ):
                yield ev["type"], ev["raw_object"]
        except Exception as e:
            raise self._absent(e, f"watch {PLURAL}") from None

"""The pod watcher (gpushare.node.kube.k8s) against a real API server, with the node's service
account's token: what a scheduler's binding, a kubelet's status and a deletion look like
to it; a watch whose resourceVersion expired (410 Gone); a connection that dies silently."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpushare.node.kube.k8s import KubernetesApi, PodCache, PodWatcher
from tests.cluster.conftest import Kube, container_id, unique
from tests.cluster.controlplane import NODE_SA, Cluster
from tests.cluster.proxy import TcpProxy
from tests.support import wait_until

pytestmark = pytest.mark.cluster


@pytest.fixture
def kubeconfig(deployed: Cluster, node_token: str, tmp_path: Path):
    def write(server: str = "") -> str:
        p = tmp_path / f"node-{unique('kc')}.kubeconfig"
        p.write_text(json.dumps(deployed.config_for(NODE_SA[1], node_token, server)))
        return str(p)

    return write


@pytest.fixture
def watchers() -> Iterator[list[PodWatcher]]:
    ws: list[PodWatcher] = []
    yield ws
    for w in ws:
        w.stop()


def test_binding_status_and_deletion_as_the_watcher_sees_them(
    deployed: Cluster, kube: Kube, kubeconfig, watchers
):
    node, ns, name = unique("gpu-node"), unique("bind"), unique("train")
    cache = PodCache()
    w = PodWatcher(cache, node, KubernetesApi(kubeconfig())).start()
    watchers.append(w)
    wait_until(lambda: cache.synced, timeout=30, what="the first list")
    # Created unscheduled (as with schedulerName: kai-scheduler): not this node's yet.
    kube.namespace(ns)
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"schedulerName": "kai-scheduler", "containers": [{"name": "t", "image": "x"}]},
    }
    uid = deployed.request("POST", f"/api/v1/namespaces/{ns}/pods", pod)["metadata"]["uid"]
    # The scheduler binds it: it enters the node's field selector, an ADDED to the watch.
    deployed.request(
        "POST",
        f"/api/v1/namespaces/{ns}/pods/{name}/binding",
        {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": name},
            "target": {"apiVersion": "v1", "kind": "Node", "name": node},
        },
    )
    wait_until(lambda: cache.resolve(uid), timeout=30, what="the bound pod")
    assert cache.resolve(uid) == (ns, name, "")  # no container has started
    cid = container_id()
    kube.running(ns, name, "t", cid)
    wait_until(lambda: cache.resolve(uid, cid) == (ns, name, "t"), timeout=30, what="status")
    kube.delete(ns, name)  # graceful: waits for the kubelet, the pod stays
    kube.delete(ns, name, grace=0)
    wait_until(lambda: cache.resolve(uid) is None, timeout=30, what="the deletion")
    assert w.failures == 0


class PauseAfterList:
    """The node's API source, with something done between its first list and the watch
    that follows it."""

    def __init__(self, api: KubernetesApi, meanwhile: Any) -> None:
        self.api, self.meanwhile, self.lists = api, meanwhile, 0

    def list(self, node: str) -> tuple[list[dict[str, Any]], str]:
        out = self.api.list(node)
        self.lists += 1
        if self.lists == 1:
            self.meanwhile()
        return out

    def watch(self, node: str, rv: str) -> Iterator[tuple[str, dict[str, Any]]]:
        return self.api.watch(node, rv)


def test_an_expired_watch_lists_again(deployed: Cluster, kube: Kube, kubeconfig, watchers):
    node, ns = unique("gpu-node"), unique("expire")
    late, late_cid = unique("late"), container_id()
    kube.namespace(ns)

    def meanwhile() -> None:
        # A pod starts, then the API server restarts: its new watch cache begins after
        # the list's resourceVersion, so a watch from there is 410 Gone (as clients see
        # after every API server restart or upgrade).
        kube.pod(ns, late, node)
        kube.running(ns, late, "trainer", late_cid)
        deployed.restart_apiserver()

    src = PauseAfterList(KubernetesApi(kubeconfig()), meanwhile)
    cache = PodCache()
    w = PodWatcher(cache, node, src).start()
    watchers.append(w)
    late_uid = wait_until(
        lambda: (kube.get(ns, late) or {}).get("metadata", {}).get("uid"),
        timeout=60,
        what="the pod made meanwhile",
    )
    wait_until(lambda: w.expired or w.failures, timeout=60, what="the watch to end")
    wait_until(lambda: cache.resolve(late_uid), timeout=60, what="a list that shows it")
    assert cache.resolve(late_uid, late_cid) == (ns, late, "trainer")
    assert src.lists == 2
    # An expired watch is routine: listed again at once, not a failure to back off from.
    assert (w.expired, w.failures) == (1, 0)


def test_a_connection_that_dies_silently_is_given_up(
    deployed: Cluster, kube: Kube, kubeconfig, watchers
):
    proxy = TcpProxy(deployed.port)
    try:
        node, ns = unique("gpu-node"), unique("stall")
        # A watch the server ends after 1 s, taken for dead after 3 s of silence; a list
        # that has no answer in 3 s fails.
        kc = kubeconfig(f"https://127.0.0.1:{proxy.port}")
        api = KubernetesApi(kc, watch_timeout=1, idle_timeout=3, request_timeout=3)
        cache = PodCache()
        w = PodWatcher(cache, node, api, max_backoff=1).start()
        watchers.append(w)
        wait_until(lambda: cache.synced, timeout=30, what="the first list")
        proxy.stall()  # the watch's connection goes quiet for good, new ones for now
        name, cid = unique("train"), container_id()
        uid = kube.pod(ns, name, node)
        kube.running(ns, name, "trainer", cid)
        wait_until(
            lambda: w.failures >= 1,
            timeout=60,
            what="the watcher to give up the silent connection",
        )
        assert cache.resolve(uid) is None  # nothing came through
        proxy.resume()
        wait_until(
            lambda: cache.resolve(uid, cid) == (ns, name, "trainer"),
            timeout=60,
            what="a list on a new connection",
        )
    finally:
        proxy.close()


def test_without_any_configuration_the_error_names_both_reasons(monkeypatch, tmp_path: Path):
    """A pod without its service account's token (automountServiceAccountToken: false)
    and no kubeconfig: the one-line error says what each way lacks."""
    from kubernetes.config import ConfigException, kube_config

    for k in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(tmp_path / "none"))
    with pytest.raises(ConfigException) as e:
        KubernetesApi()
    msg = str(e.value)
    assert "in-cluster: Service host/port is not set" in msg and "KUBECONFIG" in msg, msg
    assert "\n" not in msg

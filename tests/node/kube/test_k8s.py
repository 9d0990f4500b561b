"""Pod names from recorded API objects; the watcher through an API that comes and goes."""

from __future__ import annotations

import json
import os
import threading

import pytest

from gpushare.core.attach import AttachRecord
from gpushare.node.kube.k8s import PodCache, PodWatcher, pod_info
from tests.support import FIXTURES, wait_until

FIX = FIXTURES / "k8s"
UID = "3c0f5a37-9b1e-4c7a-8d2e-6f0a1b2c3d4e"
CID = "0a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f9"


def pod(name: str) -> dict:
    return json.loads((FIX / f"{name}.json").read_text())


def test_pod_info_from_a_recorded_pod():
    p = pod_info(pod("pod-kai-training"))
    assert (p.uid, p.namespace, p.name) == (UID, "research", "train-half-gpu")
    assert p.containers[CID] == "trainer"
    assert "fetch-data" in p.containers.values()  # init containers too
    assert pod_info(pod("pod-pending")).containers == {}  # no container started yet


def test_cache_resolves_and_forgets():
    c = PodCache()
    c.replace([pod("pod-kai-training"), pod("pod-pending")])
    assert c.resolve(UID, CID) == ("research", "train-half-gpu", "trainer")
    assert c.resolve(UID, "other") == ("research", "train-half-gpu", "")
    c.apply("DELETED", pod("pod-kai-training"))
    assert c.resolve(UID) is None


class FlakyApi:
    """A PodSource whose server is away for the first calls, then serves a list and a
    watch with one event, then goes away for good (every list after the watch fails)."""

    def __init__(self, fail: int) -> None:
        self.fail = fail
        self.calls = 0
        self.done = threading.Event()

    def list(self, node: str):
        self.calls += 1
        if self.calls <= self.fail or self.done.is_set():
            raise ConnectionRefusedError("dial tcp 10.96.0.1:443: connection refused")
        return [pod("pod-pending")], "100"

    def watch(self, node: str, rv: str):
        assert rv == "100"
        yield "ADDED", pod("pod-kai-training")
        self.done.set()
        raise ConnectionResetError("the API server went away")


def test_watcher_rides_out_an_unreachable_api():
    cache = PodCache()
    api = FlakyApi(fail=2)
    w = PodWatcher(cache, "gpu-node-7", api, max_backoff=0.05).start()
    try:
        assert api.done.wait(10)
        assert cache.resolve(UID, CID) == ("research", "train-half-gpu", "trainer")
        # the watch fails, then a list: the API is away again, and the cache still answers
        wait_until(lambda: w.failures >= 4, what="the watch and a list to fail")
        assert cache.resolve(UID, CID) == ("research", "train-half-gpu", "trainer")
    finally:
        w.stop()


@pytest.mark.cluster
@pytest.mark.skipif(not os.environ.get("KUBECONFIG"), reason="KUBECONFIG is not set: no cluster")
def test_lists_pods_of_a_real_node():
    from kubernetes import client, config

    from gpushare.node.kube.k8s import KubernetesApi

    config.load_kube_config()
    node = client.CoreV1Api().list_node().items[0].metadata.name
    items, rv = KubernetesApi().list(node)
    assert rv
    cache = PodCache()
    cache.replace(items)
    for it in items:
        assert cache.resolve(it["metadata"]["uid"])[1] == it["metadata"]["name"]


def test_node_shows_api_names_for_the_kernels_pod_uid():
    from gpushare.core.clock import ManualClock
    from gpushare.node.daemon import Node
    from gpushare.node.guard import Conn
    from gpushare.node.host.gpus import simulated_gpus
    from gpushare.node.host.identity import CgroupIdentity
    from gpushare.node.keep.config import NodeConfig
    from gpushare.node.observe.metrics import registry_for
    from gpushare.status import Claimed

    class Writer:  # the node only writes to a connection here
        def is_closing(self) -> bool:
            return False

        def write(self, data: bytes) -> None:
            pass

    node = Node(NodeConfig(metrics_port=0), simulated_gpus(1, 2**34), clock=ManualClock())
    node.pods = PodCache()
    node.pods.replace([pod("pod-kai-training")])
    node.arbiters[0].attach(1, AttachRecord(name="trainer", memory_limit=2**30))
    conn = Conn(
        Writer(),
        4242,
        1000,
        1000,
        session=1,  # type: ignore[arg-type]
        claimed=Claimed(pod="something-else"),  # a claim that the API's name overrides
        identity=CgroupIdentity(UID, CID, "containerd", 2),
    )
    node.conns[1] = conn
    (s,) = node.status().gpus[0].sessions
    assert (s.namespace, s.pod, s.container) == ("research", "train-half-gpu", "trainer")
    assert s.identity_verified and s.identity_source == "kubernetes"
    labels = {
        "gpu": "0",
        "gpu_uuid": node.gpus[0].uuid,
        "namespace": "research",
        "pod": "train-half-gpu",
        "container": "trainer",
        "session": "1",
    }
    assert (
        registry_for(node.status).get_sample_value("gpushare_memory_limit_bytes", labels) == 2**30
    )

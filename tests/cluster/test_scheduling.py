"""The control plane's own controllers and scheduler placing gpushare's pods, as on a
current cluster: the DaemonSet controller makes the node's pod for every GPU node and
kube-scheduler binds it there (and nowhere else); a workload pod that asks for a GPU is
bound by kube-scheduler to the GPU node, and that node's gpushare names the session by
the pod the scheduler placed. The Node objects are the test's (no kubelet): their
capacity is what the NVIDIA device plugin would report (`nvidia.com/gpu`), their label
what GPU feature discovery sets (`nvidia.com/gpu.present`)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.cluster.conftest import Kube, container_id, unique
from tests.cluster.controlplane import Cluster
from tests.support import wait_until

pytestmark = pytest.mark.cluster
NS = "gpushare-system"


def make_node(c: Cluster, name: str, gpus: int) -> None:
    """A Node object as a kubelet registers it: capacity in its status (the status
    subresource, as the kubelet writes it), a GPU node labelled as GPU feature discovery
    labels it."""
    labels = {"kubernetes.io/hostname": name}
    if gpus:
        labels["nvidia.com/gpu.present"] = "true"
    c.request(
        "POST",
        "/api/v1/nodes",
        {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}},
    )
    capacity = {"cpu": "8", "memory": "32Gi", "pods": "110"}
    if gpus:
        capacity["nvidia.com/gpu"] = str(gpus)
    status = {
        "status": {
            "capacity": capacity,
            "allocatable": capacity,
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "lastHeartbeatTime": "2026-01-01T00:00:00Z",
                    "lastTransitionTime": "2026-01-01T00:00:00Z",
                }
            ],
        }
    }
    c.request(
        "PATCH",
        f"/api/v1/nodes/{name}/status",
        status,
        content_type="application/merge-patch+json",
    )
    # The server taints a new Node not-ready; the node lifecycle controller lifts the taint
    # once the kubelet reports Ready. That controller does not run here (with no kubelet
    # renewing the Node's lease it would taint it unreachable and evict): do its part.
    c.request(
        "PATCH",
        f"/api/v1/nodes/{name}",
        {"spec": {"taints": None}},
        content_type="application/merge-patch+json",
    )


def runtime_class(c: Cluster) -> None:
    """The `nvidia` RuntimeClass the DaemonSet names (the GPU operator installs it)."""
    try:
        c.request("GET", "/apis/node.k8s.io/v1/runtimeclasses/nvidia")
    except OSError:
        c.request(
            "POST",
            "/apis/node.k8s.io/v1/runtimeclasses",
            {
                "apiVersion": "node.k8s.io/v1",
                "kind": "RuntimeClass",
                "metadata": {"name": "nvidia"},
                "handler": "nvidia",
            },
        )


def pods_of_daemonset(c: Cluster) -> list[dict[str, Any]]:
    sel = "app.kubernetes.io/component=node"
    items = c.request("GET", f"/api/v1/namespaces/{NS}/pods?labelSelector={sel}")["items"]
    return [p for p in items if p["metadata"].get("ownerReferences")]


def test_the_daemonsets_pod_is_made_and_bound_on_gpu_nodes_only(deployed: Cluster):
    c = deployed
    runtime_class(c)
    gpu, cpu = unique("gpu-node"), unique("cpu-node")
    make_node(c, gpu, gpus=1)
    make_node(c, cpu, gpus=0)
    # kube-controller-manager's DaemonSet controller makes the pod; kube-scheduler binds it
    wait_until(
        lambda: any(p["spec"].get("nodeName") == gpu for p in pods_of_daemonset(c)),
        timeout=120,
        what="the DaemonSet's pod bound to the GPU node",
    )
    ours = [p for p in pods_of_daemonset(c) if gpu in str(p["spec"].get("affinity"))]
    assert len(ours) == 1, ours
    (pod,) = ours
    assert pod["spec"]["nodeName"] == gpu and pod["spec"]["runtimeClassName"] == "nvidia"
    assert pod["spec"]["serviceAccountName"] == "gpushare-node"
    assert not [p for p in pods_of_daemonset(c) if cpu in str(p["spec"].get("affinity"))]
    assert not [p for p in pods_of_daemonset(c) if p["spec"].get("nodeName") == cpu]
    # the scheduler's own word: the binding happened (PodScheduled), not the test's
    (cond,) = [x for x in pod["status"]["conditions"] if x["type"] == "PodScheduled"]
    assert cond["status"] == "True"


def test_a_gpu_pod_placed_by_kube_scheduler_is_a_session_named_by_its_pod(
    k8s_node, kube: Kube, deployed: Cluster
):
    k = k8s_node()
    make_node(deployed, k.name, gpus=1)
    ns, name = "sched", unique("train")
    kube.namespace(ns)
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns},
        "spec": {  # no nodeName: kube-scheduler binds it (to this test's node: other
            # tests' GPU nodes share the cluster), if a GPU is free there
            "nodeSelector": {"kubernetes.io/hostname": k.name},
            "containers": [
                {
                    "name": "trainer",
                    "image": "busybox",
                    "resources": {"limits": {"nvidia.com/gpu": "1"}},
                }
            ],
        },
    }
    uid = deployed.request("POST", f"/api/v1/namespaces/{ns}/pods", body)["metadata"]["uid"]

    def bound() -> str:
        p = kube.get(ns, name) or {}
        return str(p.get("spec", {}).get("nodeName", ""))

    wait_until(lambda: bound() != "", timeout=120, what="kube-scheduler to bind the pod")
    assert bound() == k.name
    cid = container_id()
    kube.running(ns, name, "trainer", cid)
    sid = k.session_in(ns, name, uid, cid)
    wait_until(
        lambda: k.names(sid)[:3] == (ns, name, "trainer"),
        timeout=60,
        what="the session named by the pod the scheduler placed",
    )
    # a second GPU pod does not fit the one GPU: the scheduler leaves it Pending, saying why
    second = dict(body, metadata={"name": unique("train"), "namespace": ns})
    deployed.request("POST", f"/api/v1/namespaces/{ns}/pods", second)

    def unschedulable() -> str:
        p = kube.get(ns, second["metadata"]["name"]) or {}
        for cond in p.get("status", {}).get("conditions", []):
            if cond["type"] == "PodScheduled" and cond["status"] == "False":
                return str(cond.get("message", ""))
        return ""

    wait_until(lambda: unschedulable() != "", timeout=120, what="the second pod unschedulable")
    assert "nvidia.com/gpu" in unschedulable()

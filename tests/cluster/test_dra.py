"""gpushare as a DRA driver (issue 41), against the real control plane: the DeviceClass
manifest is served, and kube-scheduler's DRA allocator shares one GPU by the consumable
capacity `memory` that gpushare's devices publish (allowMultipleAllocations), leaving a
claim past the GPU's memory unallocated. DRAConsumableCapacity is beta and on by default
in 1.36+: no feature gate is passed.

Not built yet: the `gpushare-dra` kubelet plugin. Until it is, the test publishes the
ResourceSlice the plugin is to publish (one device per GPU, its memory as capacity), as
the plugin's RBAC allows, and the scheduler's allocation is what is under test."""

from __future__ import annotations

from typing import Any

import pytest

from tests.cluster.conftest import K8S, Kube, unique
from tests.cluster.controlplane import Cluster
from tests.cluster.test_scheduling import make_node
from tests.support import wait_until

pytestmark = pytest.mark.cluster
DRIVER = "gpu.gpushare.io"
GIB = 1 << 30
R = "/apis/resource.k8s.io/v1"


@pytest.fixture(scope="module")
def dra(deployed: Cluster) -> Cluster:
    for f in ("deviceclass.yaml", "rbac.yaml"):
        deployed.kubectl("apply", "-f", str(K8S / "components" / "dra" / f))
    return deployed


def slice_for(node: str, memory: int) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-{DRIVER}"},
        "spec": {
            "driver": DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [
                {
                    "name": "gpu-0",
                    "allowMultipleAllocations": True,
                    "attributes": {
                        "model": {"string": "simulated"},
                        "simulated": {"bool": True},
                    },
                    "capacity": {"memory": {"value": str(memory)}},
                }
            ],
        },
    }


def claim_pod(c: Cluster, ns: str, node: str, memory: str) -> tuple[str, str]:
    claim = unique("share")
    c.request(
        "POST",
        f"{R}/namespaces/{ns}/resourceclaims",
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": claim, "namespace": ns},
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": "gpu",
                            "exactly": {
                                "deviceClassName": "gpushare.io",
                                "capacity": {"requests": {"memory": memory}},
                            },
                        }
                    ]
                }
            },
        },
    )
    pod = unique("train")
    c.request(
        "POST",
        f"/api/v1/namespaces/{ns}/pods",
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": pod, "namespace": ns},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": node},
                "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
                "containers": [
                    {
                        "name": "trainer",
                        "image": "busybox",
                        "resources": {"claims": [{"name": "gpu"}]},
                    }
                ],
            },
        },
    )
    return claim, pod


def test_dra_deviceclass_manifest_is_served(dra: Cluster):
    dc = dra.request("GET", f"{R}/deviceclasses/gpushare.io")
    assert DRIVER in dc["spec"]["selectors"][0]["cel"]["expression"]


def test_dra_scheduler_shares_one_gpu_by_memory_and_refuses_past_it(dra: Cluster, kube: Kube):
    c, node, ns = dra, unique("gpu-node"), "dra"
    make_node(c, node, gpus=0)
    kube.namespace(ns)
    c.request("POST", f"{R}/resourceslices", slice_for(node, 4 * GIB))
    a = claim_pod(c, ns, node, "1Gi")
    b = claim_pod(c, ns, node, "2Gi")

    def alloc(claim: str) -> dict[str, Any]:
        cl = c.request("GET", f"{R}/namespaces/{ns}/resourceclaims/{claim}")
        return dict(cl.get("status", {}).get("allocation") or {})

    for claim, _ in (a, b):
        wait_until(lambda claim=claim: alloc(claim) != {}, timeout=120, what=f"{claim} allocated")
    results = [alloc(x)["devices"]["results"][0] for x, _ in (a, b)]
    assert {r["device"] for r in results} == {"gpu-0"}
    assert [r["consumedCapacity"]["memory"] for r in results] == ["1Gi", "2Gi"]
    assert results[0]["shareID"] != results[1]["shareID"]
    third_claim, third_pod = claim_pod(c, ns, node, "2Gi")  # 1 + 2 + 2 > 4 GiB

    def unschedulable() -> str:
        p = kube.get(ns, third_pod) or {}
        for cond in p.get("status", {}).get("conditions", []):
            if cond["type"] == "PodScheduled" and cond["status"] == "False":
                return str(cond.get("message", ""))
        return ""

    wait_until(lambda: unschedulable() != "", timeout=120, what="the third pod unschedulable")
    assert alloc(third_claim) == {}

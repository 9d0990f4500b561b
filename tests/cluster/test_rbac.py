"""The node's service account, by its own token (as kubelet projects it into the
DaemonSet's pods): it may list and watch pods, cluster-wide, read GPUShareNodes, create
one, write their status (not their spec), create Events, and nothing else that
matters. What the node actually calls is checked against the audit log in test_node."""

from __future__ import annotations

import urllib.error

import pytest

from tests.cluster.controlplane import Cluster

pytestmark = pytest.mark.cluster
ALLOWED = [
    ("GET", "/api/v1/pods?fieldSelector=spec.nodeName%3Dgpu-node-1"),
    ("GET", "/api/v1/pods?fieldSelector=spec.nodeName%3Dgpu-node-1&watch=1&timeoutSeconds=1"),
    ("GET", "/api/v1/namespaces/default/pods"),
    ("GET", "/apis/gpushare.io/v1alpha1/gpusharenodes?fieldSelector=metadata.name%3Dgpu-node-1"),
]
DENIED = [  # 403, each
    ("GET", "/api/v1/namespaces/default/pods/anything"),  # get: the node never needs it
    ("GET", "/api/v1/secrets"),
    ("GET", "/api/v1/namespaces/gpushare-system/configmaps/gpushare-config"),  # mounted
    ("GET", "/api/v1/nodes"),
    ("POST", "/api/v1/namespaces/default/pods"),
    ("DELETE", "/api/v1/namespaces/default/pods/anything"),
    ("PATCH", "/api/v1/namespaces/default/pods/anything"),
    ("POST", "/api/v1/namespaces/default/pods/anything/eviction"),
    ("GET", "/api/v1/namespaces/default/pods/anything/log"),
    ("POST", "/api/v1/namespaces/default/pods/anything/exec"),
    ("GET", "/api/v1/events"),
    ("POST", "/api/v1/namespaces/gpushare-system/serviceaccounts/gpushare-node/token"),
    # its GPUShareNode's spec is the administrator's: the node reads it, never writes it
    ("PATCH", "/apis/gpushare.io/v1alpha1/gpusharenodes/gpu-node-1"),
    ("PUT", "/apis/gpushare.io/v1alpha1/gpusharenodes/gpu-node-1"),
    ("DELETE", "/apis/gpushare.io/v1alpha1/gpusharenodes/gpu-node-1"),
    ("GET", "/apis/gpushare.io/v1alpha1/gpusharenodes/gpu-node-1"),  # list by name instead
    ("GET", "/api/v1/namespaces/default/events"),  # it writes Events, never reads them
    ("PATCH", "/api/v1/namespaces/default/events/anything"),
]


@pytest.mark.parametrize(("method", "path"), ALLOWED)
def test_node_token_may(deployed: Cluster, node_token: str, method: str, path: str):
    deployed.request(method, path, token=node_token)


@pytest.mark.parametrize(("method", "path"), DENIED)
def test_node_token_may_not(deployed: Cluster, node_token: str, method: str, path: str):
    body = {} if method in ("POST", "PATCH", "PUT") else None
    ct = "application/merge-patch+json" if method == "PATCH" else "application/json"
    with pytest.raises(urllib.error.HTTPError) as e:
        deployed.request(method, path, body, token=node_token, content_type=ct)
    assert e.value.code == 403, e.value.read()


def rules_of(c: Cluster, token: str) -> set[tuple[str, str]]:
    review = c.request(
        "POST",
        "/apis/authorization.k8s.io/v1/selfsubjectrulesreviews",
        {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectRulesReview",
         "spec": {"namespace": "default"}},
        token=token,
    )  # fmt: skip
    return {
        (v, r)
        for rule in review["status"]["resourceRules"]
        for r in rule.get("resources", [])
        for v in rule["verbs"]
    }


def test_node_token_rules_are_pods_read_and_its_gpusharenode(deployed: Cluster, node_token: str):
    # What every authenticated user may do (selfsubject reviews; from 1.33 on, reading
    # ClusterTrustBundles), the server's own word: a service account with no binding.
    deployed.request("POST", "/api/v1/namespaces/default/serviceaccounts",
                     {"apiVersion": "v1", "kind": "ServiceAccount",
                      "metadata": {"name": "nobody-rbac"}})  # fmt: skip
    everyone = rules_of(deployed, deployed.token_for("default", "nobody-rbac"))
    assert ("create", "selfsubjectrulesreviews") in everyone and ("list", "pods") not in everyone
    rules = rules_of(deployed, node_token) - everyone
    assert rules == {
        ("list", "pods"),
        ("watch", "pods"),
        ("list", "gpusharenodes"),
        ("watch", "gpusharenodes"),
        ("create", "gpusharenodes"),
        ("patch", "gpusharenodes/status"),
        ("create", "events"),
    }

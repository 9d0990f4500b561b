"""The node daemon (a real process, ``gpushare node --kubernetes``) against a real API
server, with the manifests' service account's token: a session whose cgroup names a pod
gets that pod's namespace, name and container, in status and in metrics; the names
survive a broken watch and an API server restart; a pod deleted mid-session is handled;
the node makes only the calls its ClusterRole allows, and uses all it allows (its
GPUShareNode's included: tests/cluster/test_gpusharenode.py tests the object itself)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from tests.cluster.conftest import K8S, K8sNode, Kube, container_id, unique
from tests.cluster.controlplane import NODE_SA, Cluster
from tests.cluster.proxy import TcpProxy
from tests.support import wait_until

pytestmark = pytest.mark.cluster
SA_USER = f"system:serviceaccount:{NODE_SA[0]}:{NODE_SA[1]}"


def node_log(k: K8sNode) -> str:
    return k.node.log.read_text(errors="replace")


def test_session_gets_its_pods_names_in_status_and_metrics(k8s_node, kube: Kube):
    k = k8s_node()
    ns = unique("research")
    # A pod of another node first: the field selector keeps it from this node.
    other, other_cid = unique("train"), container_id()
    other_uid = kube.pod(ns, other, unique("another-node"))
    kube.running(ns, other, "trainer", other_cid)
    pod, uid, cid = k.pod(ns)
    sid = k.session_in(ns, pod, uid, cid)
    sid_other = k.session_in(ns, other, other_uid, other_cid)
    wait_until(
        lambda: k.names(sid) == (ns, pod, "trainer", "kubernetes"),
        timeout=30,
        what=f"the API's names for the session (now {k.names(sid)})",
    )
    s = k.session(sid)
    assert s["pod_uid"] == uid and s["container_id"] == cid and s["identity_verified"]
    assert k.names(sid_other)[3] == "claim"  # named by its own (verified) claim only
    samples = [
        labels
        for name, labels, value in k.metrics()
        if name == "gpushare_memory_limit_bytes" and labels.get("session") == str(sid)
    ]
    assert len(samples) == 1, samples
    assert {"namespace": ns, "pod": pod, "container": "trainer"}.items() <= samples[0].items()


def test_node_makes_only_the_calls_its_role_allows_and_uses_them_all(k8s_node, deployed: Cluster):
    k = k8s_node()
    ns = unique("audit")
    sessions_named_through_list_and_watch(k, ns)
    wait_for_the_calls_in_the_audit_log(k, deployed)
    assert_none_denied(k, deployed)
    assert_each_names_its_node(k, deployed)
    assert_uses_all_its_role_grants(k, deployed)


def sessions_named_through_list_and_watch(k: K8sNode, ns: str) -> None:
    """A session in a pod the node's list finds, and one in a pod made after it (the
    watch's): both named from the API."""
    pod, uid, cid = k.pod(ns)
    sid = k.session_in(ns, pod, uid, cid)
    wait_until(lambda: k.names(sid)[3] == "kubernetes", timeout=30, what="the pod's names")
    pod2, uid2, cid2 = k.pod(ns)  # after the node's list: it comes through the watch
    sid2 = k.session_in(ns, pod2, uid2, cid2)
    wait_until(lambda: k.names(sid2)[3] == "kubernetes", timeout=30, what="the watched pod")


def calls(k: K8sNode, deployed: Cluster) -> list[dict[str, Any]]:
    """This node's calls in the audit log: its token's pod says so."""
    pod_name = "authentication.kubernetes.io/pod-name"
    return [
        e
        for e in deployed.audit(SA_USER)
        if e["user"].get("extra", {}).get(pod_name) == [k.daemon_pod]
    ]


def wait_for_the_calls_in_the_audit_log(k: K8sNode, deployed: Cluster) -> None:
    """The node's writes, then (the node stopped) its list and watch, in the audit log."""
    # its GPUShareNode made and its status written; an Event for each pod's session
    wait_until(
        lambda: (
            {e["verb"] for e in calls(k, deployed)} >= {"create", "patch"}
            and sum(e["objectRef"]["resource"] == "events" for e in calls(k, deployed)) >= 2
        ),
        timeout=30,
        what="the node's object, status and Events",
    )
    k.node.stop()  # a watch is audited when it ends
    try:
        wait_until(lambda: {e["verb"] for e in calls(k, deployed)} >= {"list", "watch"}, timeout=30)
    except AssertionError:
        raise AssertionError(
            "the node's list and watch are not in the audit log:\n"
            + "\n".join(f"{e['verb']} {e['requestURI']}" for e in deployed.audit(SA_USER))
        ) from None


def assert_none_denied(k: K8sNode, deployed: Cluster) -> None:
    # 429 is the server's priority and fairness shedding load (a busy test machine), not
    # a refusal of the role: the node tries again, as client-go does
    codes = [(e, e["responseStatus"]["code"]) for e in calls(k, deployed)]
    denied = [e for e, code in codes if code >= 400 and code != 429]
    assert not denied, [
        (
            e["verb"],
            e["requestURI"],
            e["responseStatus"].get("code"),
            e["responseStatus"].get("reason"),
        )
        for e in denied
    ]


def assert_each_names_its_node(k: K8sNode, deployed: Cluster) -> None:
    """Each names its node: the node never lists or watches the whole cluster's pods, nor
    reads or writes another node's GPUShareNode."""
    selector = f"fieldSelector=spec.nodeName%3D{k.name}"
    pods = [e for e in calls(k, deployed) if e["objectRef"]["resource"] == "pods"]
    assert pods and all(selector in e["requestURI"] for e in pods), [e["requestURI"] for e in pods]
    gsn = [e for e in calls(k, deployed) if e["objectRef"]["resource"] == "gpusharenodes"]
    for e in gsn:
        if e["verb"] in ("list", "watch"):
            assert f"fieldSelector=metadata.name%3D{k.name}" in e["requestURI"], e["requestURI"]
        else:  # create (its name is in the body, not the URI), patch of its status
            assert e["objectRef"].get("name") == k.name, e


def assert_uses_all_its_role_grants(k: K8sNode, deployed: Cluster) -> None:
    """The (verb, resource) pairs the node used are those its ClusterRole grants."""
    used = {
        (e["verb"], e["objectRef"]["resource"] + ("/" + e["objectRef"]["subresource"]
                                                  if e["objectRef"].get("subresource") else ""))
        for e in calls(k, deployed)
    }  # fmt: skip
    plain = deployed.kubectl("kustomize", str(K8S / "overlays" / "plain")).stdout
    (role,) = [
        o
        for o in yaml.safe_load_all(plain)
        if o and o["kind"] == "ClusterRole" and o["metadata"]["name"] == "gpushare-node"
    ]
    granted = {(v, r) for rule in role["rules"] for r in rule["resources"] for v in rule["verbs"]}
    assert used == granted, f"the node used {sorted(used)}; its role grants {sorted(granted)}"


def test_names_survive_a_broken_watch(k8s_node, deployed: Cluster, kube: Kube):
    proxy = TcpProxy(deployed.port)
    try:
        k = k8s_node(f"https://127.0.0.1:{proxy.port}")
        ns = unique("watch")
        pod, uid, cid = k.pod(ns)
        sid = k.session_in(ns, pod, uid, cid)
        wait_until(lambda: k.names(sid)[3] == "kubernetes", timeout=30, what="the pod's names")
        connections = proxy.connections_total
        proxy.cut()  # the watch breaks; reconnecting is refused for now
        wait_until(lambda: "Kubernetes API:" in node_log(k), timeout=30, what="the node to see it")
        # Meanwhile a pod starts on the node: only a fresh list (or watch) can tell.
        pod2, uid2, cid2 = k.pod(ns)
        assert k.names(sid) == (ns, pod, "trainer", "kubernetes")  # the cache answers
        proxy.resume()
        sid2 = k.session_in(ns, pod2, uid2, cid2)
        wait_until(
            lambda: k.names(sid2) == (ns, pod2, "trainer", "kubernetes"),
            timeout=60,
            what="the pod started while the watch was down",
        )
        assert k.names(sid) == (ns, pod, "trainer", "kubernetes")
        assert proxy.connections_total > connections  # it did reconnect
    finally:
        proxy.close()


def test_names_survive_an_api_server_restart(k8s_node, deployed: Cluster):
    k = k8s_node()
    ns = unique("restart")
    pod, uid, cid = k.pod(ns)
    sid = k.session_in(ns, pod, uid, cid)
    wait_until(lambda: k.names(sid)[3] == "kubernetes", timeout=30, what="the pod's names")
    deployed.stop_apiserver()
    try:
        wait_until(
            lambda: "Kubernetes API:" in node_log(k), timeout=30, what="the node to see it gone"
        )
        assert k.names(sid) == (ns, pod, "trainer", "kubernetes")  # the cache answers
    finally:
        deployed.start_apiserver()
    pod2, uid2, cid2 = k.pod(ns)
    sid2 = k.session_in(ns, pod2, uid2, cid2)
    wait_until(
        lambda: k.names(sid2) == (ns, pod2, "trainer", "kubernetes"),
        timeout=90,
        what="a pod made after the restart",
    )
    assert k.names(sid) == (ns, pod, "trainer", "kubernetes")


def test_pod_deleted_mid_session(k8s_node, kube: Kube):
    k = k8s_node()
    ns = unique("delete")
    pod, uid, cid = k.pod(ns)
    sid = k.session_in(ns, pod, uid, cid)
    wait_until(lambda: k.names(sid)[3] == "kubernetes", timeout=30, what="the pod's names")
    # A graceful delete of a pod bound to a node waits for its kubelet: the pod stays,
    # marked for deletion, and keeps its names.
    kube.delete(ns, pod)
    got = kube.get(ns, pod)
    assert got and got["metadata"].get("deletionTimestamp")
    assert k.names(sid) == (ns, pod, "trainer", "kubernetes")
    # Gone from the API (forced, or the kubelet confirmed) while the process still runs:
    # the session keeps the names the API gave it (pinned), never the workload's own word
    # in their place, and goes on being served.
    kube.delete(ns, pod, grace=0)
    assert kube.get(ns, pod) is None
    # A new pod of the same name is another pod (another UID): its session gets the API's
    # names for it; by then the node has seen the deletion (the watch is in order).
    kube.pod(ns, pod, k.name)  # same name, new UID
    new = kube.get(ns, pod)
    assert new and new["metadata"]["uid"] != uid
    cid2 = container_id()
    kube.running(ns, pod, "trainer", cid2)
    sid2 = k.session_in(ns, pod, new["metadata"]["uid"], cid2)
    wait_until(lambda: k.names(sid2)[3] == "kubernetes", timeout=30, what="the new pod")
    s = k.session(sid)
    assert k.names(sid) == (ns, pod, "trainer", "kubernetes") and s["identity_verified"]
    assert s["pod_uid"] == uid and k.session(sid2)["pod_uid"] == new["metadata"]["uid"]
    # The node still serves both sessions.
    assert {sid, sid2} <= {s["id"] for g in k.node.status()["gpus"] for s in g["sessions"]}

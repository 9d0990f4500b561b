"""The one Kubernetes client's map of refusals: each status to its one-line message naming
the fix, first as the pure table, then from real HTTP answers (an API server's Status
bodies over a real socket, through the official client) and from a server that is not
there or says nothing. Against a real API server: tests/cluster/."""

from __future__ import annotations

import json
import socket

import pytest

from gpushare.node.kube.api import (
    NODE,
    PERSON,
    Absent,
    ApiError,
    Conflict,
    Deadlines,
    Expired,
    Forbidden,
    Kube,
    NoKind,
    NotFound,
    TooMany,
    Unauthorized,
    Unreachable,
    refusal,
)
from gpushare.node.kube.node_status import GROUP, PLURAL, VERSION
from tests.node.kube.apiserver import api_status, kubeconfig

pytest.importorskip("kubernetes")

# (status, caller, the call, more) -> the error's class and the words it must say
TABLE = [
    (401, NODE, "list pods", {}, Unauthorized, ["unauthorized", "service account's token"]),
    (401, PERSON, "list gpusharenodes", {}, Unauthorized, ["your kubeconfig's credentials"]),
    (403, NODE, "patch GPUShareNode n/status", {}, Forbidden,
     ["forbidden", "ClusterRole gpushare-node", "rbac.yaml", "kubectl apply -k"]),
    (403, PERSON, "list gpusharenodes", {}, Forbidden,
     ["forbidden", "ClusterRole gpushare-viewer", "rbac.yaml", "clusterrolebinding"]),
    (403, PERSON, "patch GPUShareNode n", {}, Forbidden,
     ["ClusterRole gpushare-editor", "--clusterrole=gpushare-editor"]),
    (404, NODE, "list gpusharenodes", {}, NoKind,
     ["no GPUShareNode kind", "gpusharenodes.gpushare.io",
      "kubectl apply -k deploy/kubernetes/overlays/plain", "crd.yaml"]),
    (404, NODE, "patch GPUShareNode n/status", {"name": "n"}, NotFound, ["the message"]),
    (409, NODE, "create GPUShareNode n", {}, Conflict, ["conflict"]),
    (410, NODE, "watch pods", {}, Expired, ["expired", "list again"]),
    (429, PERSON, "list gpusharenodes", {"retry_after": 3.0}, TooMany,
     ["throttling", "try again in 3 s"]),
    (429, NODE, "list pods", {}, TooMany, ["try again later"]),
    (503, NODE, "list pods", {}, ApiError, ["API server failed", "kubectl cluster-info"]),
    (422, PERSON, "patch GPUShareNode n", {}, ApiError, ["patch GPUShareNode n: the message"]),
]  # fmt: skip


@pytest.mark.parametrize(("status", "caller", "what", "more", "kind", "words"), TABLE)
def test_each_status_maps_to_one_line_naming_its_fix(status, caller, what, more, kind, words):
    e = refusal(what, status, "the message", caller, **more)
    assert type(e) is kind and e.status == status
    text = str(e)
    assert text.startswith(f"{what}: ") and "\n" not in text
    for w in words:
        assert w in text, text


def test_what_the_node_takes_for_not_here_and_for_gone():
    # the reconciler runs on without its object on Absent, makes it again on LookupError
    assert isinstance(refusal("x", 403, "m", NODE), Absent)
    assert isinstance(refusal("x", 404, "m", NODE), Absent)
    gone = refusal("x", 404, "m", NODE, name="n")
    assert isinstance(gone, LookupError) and not isinstance(gone, Absent)
    assert refusal("x", 429, "m", NODE, retry_after=2).retry_after == 2  # type: ignore[attr-defined]


# --- from real answers ------------------------------------------------------------------


def list_nodes(kube: Kube) -> object:
    c = kube.custom()
    return kube.call(f"list {PLURAL}", c.list_cluster_custom_object, GROUP, VERSION, PLURAL)


@pytest.mark.parametrize(
    ("code", "details", "kind", "words"),
    [
        (404, {}, NoKind, "no GPUShareNode kind"),  # the server without the CRD
        (404, {"name": "n", "kind": PLURAL}, NotFound, 'gpusharenodes.gpushare.io "n" not found'),
        (403, {}, Forbidden, "ClusterRole gpushare-viewer"),
        (401, {}, Unauthorized, "your kubeconfig's credentials"),
        (409, {"name": "n"}, Conflict, "conflict"),
        (500, {}, ApiError, "kubectl cluster-info"),
    ],
)
def test_a_real_answer_is_mapped_by_its_status_and_details(
    server, tmp_path, code, details, kind, words
):
    answer, port = server
    message = 'gpusharenodes.gpushare.io "n" not found' if details.get("name") else "said so"
    answer.status, answer.body = code, api_status(code, message, details)
    kube = Kube(kubeconfig(tmp_path, port), caller=PERSON)
    with pytest.raises(ApiError) as e:
        list_nodes(kube)
    assert type(e.value) is kind and e.value.status == code
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert answer.paths == [f"/apis/{GROUP}/{VERSION}/{PLURAL}"]  # asked once


def test_429_is_handed_back_with_its_retry_after_not_slept_on(server, tmp_path):
    answer, port = server
    answer.status, answer.body = 429, api_status(429, "too many requests")
    answer.headers = {"Retry-After": "7"}
    kube = Kube(kubeconfig(tmp_path, port), caller=PERSON)
    with pytest.raises(TooMany) as e:
        list_nodes(kube)
    # the caller decides (the node's loops back off, the plugin says when): the client
    # does not sleep 7 s and ask again on its own
    assert e.value.retry_after == 7 and "try again in 7 s" in str(e.value)
    assert len(answer.paths) == 1


def test_an_expired_watch_is_expired(server, tmp_path):
    answer, port = server
    error = {
        "type": "ERROR",
        "object": json.loads(api_status(410, "too old resource version", reason="Expired")),
    }
    answer.body = (json.dumps(error) + "\n").encode()
    kube = Kube(kubeconfig(tmp_path, port))
    with pytest.raises(Expired) as e:
        list(kube.stream("watch pods", kube.core().list_pod_for_all_namespaces))
    # the watch hands on the Status' reason and message (no body)
    assert "watch pods: expired (Expired: too old resource version): list again" in str(e.value)


def test_a_server_not_there_says_check_cluster_info(tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kube = Kube(kubeconfig(tmp_path, port), caller=PERSON)
    with pytest.raises(Unreachable) as e:
        list_nodes(kube)
    text = str(e.value)
    assert "cannot reach the API server" in text and "`kubectl cluster-info`" in text
    assert "\n" not in text


def test_a_silent_server_fails_the_call_at_its_deadline(tmp_path):
    with socket.socket() as s:  # accepts (the kernel's backlog), never answers
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        kube = Kube(
            kubeconfig(tmp_path, s.getsockname()[1]), deadlines=Deadlines(connect=1, request=0.3)
        )
        with pytest.raises(Unreachable) as e:
            list_nodes(kube)
    assert "no answer within the deadline" in str(e.value), str(e.value)


def test_without_any_configuration_both_reasons_in_one_line(monkeypatch, tmp_path):
    from kubernetes.config import ConfigException, kube_config

    for k in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT", "KUBECONFIG"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(tmp_path / "none"))
    with pytest.raises(ConfigException) as e:
        Kube()
    msg = str(e.value)
    assert "in-cluster: Service host/port is not set" in msg and "set KUBECONFIG" in msg, msg
    assert "\n" not in msg
    with pytest.raises(ConfigException, match="--kubeconfig FILE"):  # a person's: no pod
        Kube(str(tmp_path / "none"), caller=PERSON, in_cluster=False)

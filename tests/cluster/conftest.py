"""Fixtures for the cluster suite: one real control plane (etcd, kube-apiserver,
kube-controller-manager, kube-scheduler) per test session, the manifests applied to it,
and helpers that play the part no process plays here (the kubelet reporting its
containers; most tests also bind their pods themselves, as the scheduler would)."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster.controlplane import NODE_SA, Cluster, free_port, run_build
from tests.cluster.controlplane import build as build_k8s
from tests.support import REPO, NodeProcess, sim

K8S = REPO / "deploy" / "kubernetes"
# The order a user follows (docs/kubernetes.md): the Prometheus Operator's CRD comes with
# the operator, before any overlay that has a ServiceMonitor.
SERVICEMONITOR_CRD = Path(__file__).parent / "servicemonitor-crd.yaml"


def built(what: str) -> str:
    """The control plane's binaries (their folder) or the image's name, as `make test`
    built them (make cluster-deps, make image); skips, saying why, where there is none."""
    if what == "k8s":
        path, why = build_k8s()
    else:
        env = dict(os.environ, PYTHON=sys.executable)
        path, why = run_build(REPO / "deploy" / "build-image.sh", env)
    if not path:
        pytest.skip(f"no {what}: {why}")
    return path


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    bin = Path(built("k8s"))
    d = Path(tempfile.mkdtemp(prefix="gs-k8s-"))
    c = Cluster(bin, d)
    try:
        c.start()
        yield c
    finally:
        c.stop()
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def image() -> str:
    return built("image")


@pytest.fixture(scope="session")
def deployed(cluster: Cluster) -> Cluster:
    """The plain overlay applied, as a user installs gpushare."""
    cluster.kubectl("apply", "-k", str(K8S / "overlays" / "plain"))
    # as docs/kubernetes.md says: a CRD serves its kind once it is Established
    cluster.kubectl("wait", "--for=condition=established", "--timeout=60s",
                    "crd/gpusharenodes.gpushare.io")  # fmt: skip
    return cluster


@pytest.fixture(scope="session")
def node_token(deployed: Cluster) -> str:
    """A token of the node's service account, as kubelet projects it into the pod."""
    return deployed.token_for(*NODE_SA)


@pytest.fixture
def kube(deployed: Cluster) -> Kube:
    return Kube(deployed)


class Kube:
    """Pods as the scheduler and the kubelet would make them, through the admin's API."""

    def __init__(self, cluster: Cluster) -> None:
        self.c = cluster

    def namespace(self, name: str) -> None:
        try:
            self.c.request("GET", f"/api/v1/namespaces/{name}")
        except OSError:
            self.c.request(
                "POST",
                "/api/v1/namespaces",
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}},
            )

    def pod(
        self,
        namespace: str,
        name: str,
        node: str,
        container: str = "trainer",
        service_account: str = "",
    ) -> str:
        """A pod bound to ``node`` (stays Pending: no kubelet); its UID, as the server
        assigned it."""
        self.namespace(namespace)
        spec: dict[str, Any] = {
            "nodeName": node,
            "containers": [{"name": container, "image": "busybox"}],
        }
        if service_account:
            spec["serviceAccountName"] = service_account
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace},
            "spec": spec,
        }
        return str(
            self.c.request("POST", f"/api/v1/namespaces/{namespace}/pods", body)["metadata"]["uid"]
        )

    def running(self, namespace: str, name: str, container: str, container_id: str) -> None:
        """The kubelet's status update: the container started, with this runtime ID."""
        status = {
            "status": {
                "phase": "Running",
                "containerStatuses": [
                    {
                        "name": container,
                        "containerID": f"containerd://{container_id}",
                        "image": "busybox",
                        "imageID": "",
                        "ready": True,
                        "restartCount": 0,
                        "state": {"running": {"startedAt": "2024-01-01T00:00:00Z"}},
                    }
                ],
            }
        }
        self.c.request(
            "PATCH",
            f"/api/v1/namespaces/{namespace}/pods/{name}/status",
            status,
            content_type="application/merge-patch+json",
        )

    def delete(self, namespace: str, name: str, grace: int | None = None) -> dict[str, Any]:
        q = "" if grace is None else f"?gracePeriodSeconds={grace}"
        return self.c.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/{name}{q}")

    def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.c.request("GET", f"/api/v1/namespaces/{namespace}/pods/{name}")
        except OSError:
            return None


def unique(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(3)}"


def container_id() -> str:
    return secrets.token_hex(32)


def dump(obj: Any) -> str:
    return json.dumps(obj, indent=1)[:2000]


# A workload that waits for the test before it attaches: the test first writes the
# process's cgroup file into the node's fake /proc (the kernel's word on its pod).
WORKLOAD = """
import sys, gpushare
sys.stdin.readline()
s = gpushare.attach(memory="256MiB", socket=sys.argv[1], name=sys.argv[2])
print("attached", s.id, flush=True)
sys.stdin.readline()
s.close()
"""


class PodProcess:
    """A process of a container: its cgroup names pod ``uid`` and container ``cid`` (in
    the fake /proc the node reads, cgroup v2, systemd driver, containerd), its
    environment what the Downward API gives the examples' pods."""

    def __init__(self, proc_root: Path, socket: str, name: str) -> None:
        self.proc_root, self.socket, self.name = proc_root, socket, name
        self.p: subprocess.Popen[str] | None = None

    def start(self, uid: str, cid: str, namespace: str, pod: str) -> PodProcess:
        env = dict(os.environ, POD_UID=uid, POD_NAME=pod, POD_NAMESPACE=namespace)
        self.p = subprocess.Popen(
            [sys.executable, "-c", WORKLOAD, self.socket, self.name],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        d = self.proc_root / str(self.p.pid)
        d.mkdir(parents=True)
        slice_ = f"kubepods-besteffort-pod{uid.replace('-', '_')}.slice"
        (d / "cgroup").write_text(
            f"0::/kubepods.slice/kubepods-besteffort.slice/{slice_}/cri-containerd-{cid}.scope\n"
        )
        assert self.p.stdin and self.p.stdout
        self.p.stdin.write("attach\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        if not line.startswith("attached"):
            self.p.kill()
            err = self.p.stderr.read() if self.p.stderr else ""
            raise AssertionError(f"the workload did not attach: {line!r} {err}")
        self.session = int(line.split()[1])
        return self

    def stop(self) -> None:
        if self.p and self.p.poll() is None:
            assert self.p.stdin
            self.p.stdin.write("close\n")
            self.p.stdin.flush()
            try:
                self.p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()


@dataclass
class K8sNode:
    node: NodeProcess
    proc_root: Path
    name: str  # the Kubernetes node it serves ($NODE_NAME)
    daemon_pod: str  # its own pod there (what its token is bound to)
    metrics_port: int
    kube: Kube
    workloads: list[PodProcess]

    def pod(self, namespace: str, container: str = "trainer") -> tuple[str, str, str]:
        """A pod on this node, its container running: (name, UID, container ID)."""
        name, cid = unique("train"), container_id()
        uid = self.kube.pod(namespace, name, self.name, container)
        self.kube.running(namespace, name, container, cid)
        return name, uid, cid

    def session_in(self, namespace: str, pod: str, uid: str, cid: str) -> int:
        w = PodProcess(self.proc_root, self.node.socket, pod)
        self.workloads.append(w.start(uid, cid, namespace, pod))
        return w.session

    def session(self, sid: int) -> dict[str, Any]:
        for g in self.node.status()["gpus"]:
            for s in g["sessions"]:
                if s["id"] == sid:
                    return dict(s)
        raise AssertionError(f"no session {sid}")

    def names(self, sid: int) -> tuple[str, str, str, str]:
        s = self.session(sid)
        return s["namespace"], s["pod"], s["container"], s["identity_source"]

    def metrics(self) -> list[tuple[str, dict[str, str], float]]:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
        return [
            (s.name, s.labels, s.value)
            for f in text_string_to_metric_families(text)
            for s in f.samples
        ]


@pytest.fixture
def k8s_node(
    node_factory, short_tmp: Path, deployed: Cluster, kube: Kube, monkeypatch
) -> Iterator[Any]:
    made: list[K8sNode] = []

    def make(server: str = "") -> K8sNode:
        """A node whose API client has the DaemonSet's rights: its service account's
        token, bound to a pod of its own on its node (as kubelet projects it into the
        DaemonSet's pod), through ``server`` (default: the API server itself)."""
        name = unique("gpu-node")
        daemon_pod = unique("gpushare-node")
        uid = kube.pod(NODE_SA[0], daemon_pod, name, "node", service_account=NODE_SA[1])
        token = deployed.token_for(*NODE_SA, pod={"name": daemon_pod, "uid": uid})
        kc = short_tmp / "node.kubeconfig"
        kc.write_text(json.dumps(deployed.config_for(NODE_SA[1], token, server)))
        monkeypatch.setenv("KUBECONFIG", str(kc))
        monkeypatch.setenv("NODE_NAME", name)
        for k in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"):
            monkeypatch.delenv(k, raising=False)  # else the client takes the in-cluster config
        proc = short_tmp / "proc"
        proc.mkdir()
        port = free_port()
        n = node_factory(
            *sim("4GiB"),
            "--kubernetes",
            "--proc-root",
            str(proc),
            "--metrics-port",
            str(port),
            "--metrics-address",
            "127.0.0.1",
        )
        k = K8sNode(n, proc, name, daemon_pod, port, kube, [])
        made.append(k)
        return k

    yield make
    for k in made:
        for w in k.workloads:
            w.stop()

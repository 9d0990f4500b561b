"""Fixtures for the cluster suite: one real kube-apiserver + etcd per test session, the
manifests applied to it, and helpers that play the parts no process plays here (the
scheduler binding a pod, the kubelet reporting its containers)."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.apiserver import NODE_SA, Cluster, run_build
from tests.cluster.apiserver import build as build_apiserver
from tests.support import REPO

K8S = REPO / "deploy" / "kubernetes"
# The order a user follows (docs/kubernetes.md): the Prometheus Operator's CRD comes with
# the operator, before any overlay that has a ServiceMonitor.
SERVICEMONITOR_CRD = Path(__file__).parent / "servicemonitor-crd.yaml"


def built(what: str) -> str:
    """The kube-apiserver binary or the image's name, as `make test` built them (make
    cluster-deps, make image); skips, saying why, where there is none."""
    if what == "apiserver":
        path, why = build_apiserver()
    else:
        env = dict(os.environ, PYTHON=sys.executable)
        path, why = run_build(REPO / "deploy" / "build-image.sh", env)
    if not path:
        pytest.skip(f"no {what}: {why}")
    return path


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    binary = Path(built("apiserver"))
    d = Path(tempfile.mkdtemp(prefix="gs-k8s-"))
    c = Cluster(binary, d)
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

"""The node's image (deploy/Dockerfile, built here by deploy/build-image.sh) started the
way the DaemonSet starts it: the image's entrypoint with the DaemonSet's args, its
volumes mounted where its volumeMounts say, its environment, and what a kubelet adds
(the service account's token and the API server's address, for the in-cluster config).
It serves status (the liveness probe's command, run in the container) and metrics (the
readiness probe's path) on a simulated GPU, serves a workload on the host through the
socket in the hostPath volume, names the package's version, and stops on SIGTERM."""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import subprocess
import sys
import tomllib
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tomli_w
import yaml

from gpushare._version import __version__
from gpushare.tools.admin import AdminClient
from tests.cluster.conftest import K8S, Kube, unique
from tests.cluster.controlplane import NODE_SA, Cluster, die_with_parent, free_port
from tests.support import REPO, wait_until

pytestmark = pytest.mark.cluster


@functools.cache
def storage() -> list[str]:
    """buildah's global options for deploy/build-image.sh's storage (its cache)."""
    r = subprocess.run(
        ["bash", str(REPO / "deploy" / "build-image.sh"), "--buildah-options"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return r.stdout.splitlines()


def buildah(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(["buildah", *storage(), *args], capture_output=True, text=True, timeout=300)
    if check and r.returncode != 0:
        raise AssertionError(f"buildah {' '.join(args)}: {r.stderr}")
    return r


def image_config(image: str) -> dict[str, Any]:
    return dict(json.loads(buildah("inspect", "--type", "image", image).stdout)["OCIv1"]["config"])


def rendered(overlay: str = "plain") -> dict[str, dict[str, Any]]:
    kubectl = str(Path(sys.executable).parent / "kubectl")
    r = subprocess.run(
        [kubectl, "kustomize", str(K8S / "overlays" / overlay)],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return {o["kind"]: o for o in yaml.safe_load_all(r.stdout) if o}


def descendants(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids = [int(x) for x in (task / "children").read_text().split()]
        except OSError:
            continue
        for k in kids:
            out += [k, *descendants(k)]
    return out


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().split("\0")[:-1]
    except OSError:
        return []


class Container:
    """A working container of the image, run as the DaemonSet's pod would run."""

    def __init__(self, image: str, tmp: Path) -> None:
        self.image, self.tmp = image, tmp
        self.name = unique("gs-node")
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = tmp / "container.log"
        buildah("from", "--name", self.name, "--quiet", image)

    def run(self, argv: list[str], mounts: list[str], env: dict[str, str]) -> None:
        opts = [f"--volume={m}" for m in mounts] + [f"--env={k}={v}" for k, v in env.items()]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                ["buildah", *storage(), "run", "--isolation", "chroot", *opts, self.name,
                 "--", *argv],
                stdout=log, stderr=log, preexec_fn=die_with_parent,
            )  # fmt: skip

    def exec(self, argv: list[str], mounts: list[str]) -> subprocess.CompletedProcess[str]:
        opts = [f"--volume={m}" for m in mounts]
        return buildah("run", "--isolation", "chroot", *opts, self.name, "--", *argv, check=False)

    def node_pid(self) -> int:
        assert self.proc
        for pid in descendants(self.proc.pid):  # under buildah's chroot runtime and exec
            argv = cmdline(pid)
            if argv and "buildah" not in argv[0] and "node" in argv:
                return pid
        return 0

    def remove(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        buildah("rm", self.name, check=False)


@pytest.fixture
def container(image: str, tmp_path: Path) -> Iterator[Container]:
    c = Container(image, tmp_path)
    try:
        yield c
    finally:
        c.remove()


def test_image_version_is_the_packages(container: Container):
    assert container.image.split(":")[1].split("-")[0] == __version__
    r = container.exec(["gpushare", "--version"], [])
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["gpushare", __version__]
    # ... the version the manifests run (tests/deploy checks the tag offline too)
    (c,) = rendered()["DaemonSet"]["spec"]["template"]["spec"]["containers"]
    assert c["image"].endswith(f":{__version__}")


def test_container_runs_the_node_as_the_daemonset_does(
    container: Container, deployed: Cluster, node_token: str, kube: Kube, tmp_path: Path
):
    objs = rendered()
    pod = objs["DaemonSet"]["spec"]["template"]["spec"]
    (spec,) = pod["containers"]
    argv = daemonset_argv(container, spec)

    # The volumes, where the DaemonSet mounts them: the ConfigMap's files; a host
    # directory each for the hostPath volumes (here: this test's own).
    node_name = unique("gpu-node")
    metrics_port = free_port()
    sources, mounts = volumes_as_mounted(objs, pod, spec, tmp_path, metrics_port)
    # What kubelet adds: the service account's token, the CA, the namespace, and the
    # API server's address (the in-cluster config reads these).
    add_what_kubelet_adds(mounts, tmp_path, node_token, deployed)
    env = daemonset_env(spec, node_name, deployed)

    ns = unique("img")
    kube.pod(ns, unique("train"), node_name)  # a pod on this node, for its first list
    container.run(argv, mounts, env)
    run_dir, admin = run_dir_and_admin_socket(objs, spec, sources)
    wait_for_the_admin_socket(container, admin)

    assert_probes_answer(container, spec, mounts, admin, metrics_port)
    assert_serves_a_workload_on_the_host(run_dir, admin)
    assert_listed_through_the_in_cluster_config(container, node_name)
    assert_events_in_the_state_volume(spec, sources)
    assert_stops_on_sigterm(container, admin)


def daemonset_argv(container: Container, spec: dict[str, Any]) -> list[str]:
    """The node's command line as the DaemonSet's container gives it to the image."""
    cfg = image_config(container.image)
    # Kubernetes: `command` replaces the image's ENTRYPOINT, `args` its CMD.
    argv: list[str] = (spec.get("command") or cfg["Entrypoint"]) + (
        spec.get("args") or cfg.get("Cmd", [])
    )
    assert argv[0] == "gpushare" and "--kubernetes" in argv
    return argv


def volumes_as_mounted(
    objs: dict[str, dict[str, Any]],
    pod: dict[str, Any],
    spec: dict[str, Any],
    tmp_path: Path,
    metrics_port: int,
) -> tuple[dict[str, Path], list[str]]:
    """A directory for each of the pod's volumes (by name), and the mounts of them that
    the container's volumeMounts say."""
    sources: dict[str, Path] = {}
    for v in pod["volumes"]:
        d = tmp_path / "vol" / v["name"]
        d.mkdir(parents=True)
        if "configMap" in v:
            assert v["configMap"]["name"] == objs["ConfigMap"]["metadata"]["name"]
            for key, text in objs["ConfigMap"]["data"].items():
                if key == "node.toml":  # a free port, loopback: the one change, hermetic
                    conf = tomllib.loads(text)
                    conf.update(metrics_port=metrics_port, metrics_address="127.0.0.1")
                    text = tomli_w.dumps(conf)
                (d / key).write_text(text)
        else:
            assert "hostPath" in v, v
        sources[v["name"]] = d
    mounts = [
        f"{sources[m['name']]}:{m['mountPath']}" + (":ro" if m.get("readOnly") else "")
        for m in spec["volumeMounts"]
    ]
    return sources, mounts


def add_what_kubelet_adds(
    mounts: list[str], tmp_path: Path, node_token: str, deployed: Cluster
) -> None:
    """The service account's files that kubelet mounts: its token, the CA, the namespace."""
    sa = tmp_path / "vol" / "serviceaccount"
    sa.mkdir()
    (sa / "token").write_text(node_token)
    (sa / "ca.crt").write_bytes(deployed.ca.read_bytes())
    (sa / "namespace").write_text(NODE_SA[0])
    # (At /run/secrets, where /var/run/secrets leads in the image: buildah's chroot
    # puts a tmpfs on /run that hides a mount made through the /var/run symlink.)
    mounts.append(f"{sa}:/run/secrets/kubernetes.io/serviceaccount:ro")


def daemonset_env(spec: dict[str, Any], node_name: str, deployed: Cluster) -> dict[str, str]:
    """The container's environment, its node's name filled in, and the API server's
    address that kubelet adds."""
    env = {e["name"]: e.get("value", "") for e in spec.get("env", [])}
    for e in spec.get("env", []):
        if e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "spec.nodeName":
            env[e["name"]] = node_name
    env |= {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(deployed.port)}
    assert env["NODE_NAME"] == node_name
    return env


def run_dir_and_admin_socket(
    objs: dict[str, dict[str, Any]], spec: dict[str, Any], sources: dict[str, Path]
) -> tuple[Path, Path]:
    """The host's side of /run/gpushare, and the admin socket's path on the host."""
    run_dir = sources[
        next(m["name"] for m in spec["volumeMounts"] if m["mountPath"] == "/run/gpushare")
    ]
    # The admin socket: in a directory of its own that workloads never mount.
    admin_path = Path(tomllib.loads(objs["ConfigMap"]["data"]["node.toml"])["admin_socket"])
    admin = (
        sources[
            next(
                m["name"] for m in spec["volumeMounts"] if m["mountPath"] == str(admin_path.parent)
            )
        ]
        / admin_path.name
    )
    return run_dir, admin


def wait_for_the_admin_socket(container: Container, admin: Path) -> None:
    def up() -> bool:
        assert container.proc and container.proc.poll() is None, container.log.read_text()
        return admin.exists()

    wait_until(up, timeout=120, what="the node's admin socket in the hostPath volume")


def assert_probes_answer(
    container: Container, spec: dict[str, Any], mounts: list[str], admin: Path, metrics_port: int
) -> None:
    # Status: the liveness probe's command, in the container.
    probe = spec["livenessProbe"]["exec"]["command"]
    r = container.exec(probe, mounts)
    assert r.returncode == 0, r.stderr
    with AdminClient(str(admin)) as a:
        st = a.status()
    (g,) = st.gpus
    assert g.simulated is True  # no GPU here: the node says so, and simulates one
    # Metrics: the readiness probe's path, on the metrics port.
    assert spec["readinessProbe"]["httpGet"]["path"] == "/metrics"
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    m = re.search(r'gpushare_build_info\{[^}]*version="([^"]+)"', metrics)
    assert m and m.group(1) == __version__, metrics[:2000]
    assert "gpushare_tq_seconds" in metrics


def assert_serves_a_workload_on_the_host(run_dir: Path, admin: Path) -> None:
    """A workload on the host, through the socket in the hostPath volume."""
    w = subprocess.run(
        [sys.executable, "-m", "gpushare.tools.workloads", "batch", "--socket",
         str(run_dir / "gpushare.sock"), "--seconds", "0.3", "--memory", "64MiB"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert w.returncode == 0, w.stderr
    with AdminClient(str(admin)) as a:
        after = a.status()
    assert after.gpus[0].grants_total >= 1


def assert_listed_through_the_in_cluster_config(container: Container, node_name: str) -> None:
    """The in-cluster config: the node listed its node's pods with the mounted token."""
    try:
        wait_until(
            lambda: f"pods on node {node_name}: 1 known" in container.log.read_text(),
            timeout=60,
        )
    except AssertionError:
        raise AssertionError(
            "no list through the in-cluster config:\n" + container.log.read_text()[-3000:]
        ) from None


def assert_events_in_the_state_volume(spec: dict[str, Any], sources: dict[str, Path]) -> None:
    """The event log in the state volume (a hostPath: it outlives the pod)."""
    state = sources[next(m["name"] for m in spec["volumeMounts"]
                         if m["mountPath"] == "/var/lib/gpushare")]  # fmt: skip
    assert (state / "events.jsonl").read_text().strip()


def assert_stops_on_sigterm(container: Container, admin: Path) -> None:
    """SIGTERM, as the kubelet stops a pod: the node stops cleanly and removes its sockets."""
    pid = container.node_pid()
    assert pid, "the node's process in the container"
    os.kill(pid, signal.SIGTERM)
    assert container.proc
    rc = container.proc.wait(timeout=60)
    assert rc == 0, container.log.read_text()[-2000:]
    assert not admin.exists()

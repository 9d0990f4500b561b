"""GPUShareNode and ``kubectl gpushare`` against a real kube-apiserver: the manifests'
CRD installed; two node processes (``gpushare node --kubernetes``, simulated GPUs, the
DaemonSet's service account's token) publishing their status; real ``kubectl get``
output; a spec change applied live, to one node only, and kept across a restart of that
node; a bad spec value refused (condition, Event, settings kept); the plugin's commands,
run by real kubectl from PATH; the rate of status writes under a burst of changes,
counted in the API server's audit log. ``pytest -m cluster -k 'gpusharenode or plugin'``.

Run with ``-s`` to see the transcripts (docs/kubernetes.md shows them)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from gpushare.tools.admin import AdminClient
from tests.cluster.conftest import Kube, PodProcess, container_id, unique
from tests.cluster.controlplane import NODE_SA, Cluster, kubectl_path
from tests.support import REPO, NodeProcess, sim, wait_until

pytestmark = pytest.mark.cluster
SA_USER = f"system:serviceaccount:{NODE_SA[0]}:{NODE_SA[1]}"
GSN = "gpusharenodes.gpushare.io"


@dataclass
class GsnNode:
    name: str
    node: NodeProcess
    proc_root: Path
    workloads: list[PodProcess] = field(default_factory=list)

    def tqs(self) -> list[float]:
        return [g["tq_s"] for g in self.node.status()["gpus"]]


@dataclass
class Two:
    c: Cluster
    kube: Kube
    nodes: list[GsnNode]
    env: dict[str, str]  # for kubectl and the plugin: the admin's kubeconfig, the plugin on PATH
    ns: str

    def kubectl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        r = subprocess.run(
            [kubectl_path(), *args],  # no flag before a plugin's name: the cache by env
            capture_output=True,
            text=True,
            timeout=120,
            env=self.env,
        )
        if check and r.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({r.returncode}):\n{r.stderr}")
        return r

    def show(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """kubectl, its command and output printed (the transcripts of the docs)."""
        r = self.kubectl(*args, check=check)
        print(f"\n$ kubectl {shlex.join(args)}\n{r.stdout}{r.stderr}", end="")
        return r

    def obj(self, name: str) -> dict[str, Any]:
        return self.c.request("GET", f"/apis/gpushare.io/v1alpha1/gpusharenodes/{name}")


def status_of(two: Two, name: str) -> dict[str, Any]:
    try:
        return dict(two.obj(name).get("status") or {})
    except OSError:
        return {}


@pytest.fixture(scope="module")
def two(deployed: Cluster) -> Iterator[Two]:
    """Two nodes, gpu-node-1 (2 simulated GPUs) and gpu-node-2 (1), each a real process
    with the node's service account's token; pod ns/train on the first with a session,
    ns/infer on the second."""
    d = Path(tempfile.mkdtemp(prefix="gs-gsn-"))
    kube = Kube(deployed)
    token = deployed.token_for(*NODE_SA)
    kc = d / "node.kubeconfig"
    kc.write_text(json.dumps(deployed.config_for(NODE_SA[1], token)))
    bindir = d / "bin"
    bindir.mkdir()
    plugin = bindir / "kubectl-gpushare"  # as pip installs it: an executable on PATH
    plugin.write_text(f'#!/bin/sh\nexec {sys.executable} -m gpushare.tools.kubectl_gpushare "$@"\n')
    plugin.chmod(0o755)
    saved = {k: os.environ.get(k) for k in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST")}
    os.environ["KUBECONFIG"] = str(kc)  # the nodes' (they inherit it)
    os.environ.pop("KUBERNETES_SERVICE_HOST", None)
    src = str(REPO / "src")
    env = dict(
        os.environ,
        KUBECONFIG=str(deployed.kubeconfig),
        PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}",
        PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]),
        KUBECACHEDIR=str(deployed.dir / "kubectl-cache"),
    )
    t = Two(deployed, kube, [], env, "ns")
    try:
        for i, gpus in ((1, 2), (2, 1)):
            name = f"gpu-node-{i}"
            nd = d / f"n{i}"
            (nd / "proc").mkdir(parents=True)
            (nd / "node.toml").write_text(f'node_name = "{name}"\n')
            n = NodeProcess(nd, *sim("16GiB", gpus, tq=2), "--kubernetes", "--proc-root",
                            str(nd / "proc"), "--config", str(nd / "node.toml"))  # fmt: skip
            t.nodes.append(GsnNode(name, n.start(), nd / "proc"))
        for k, pod in ((t.nodes[0], "train"), (t.nodes[1], "infer")):
            if kube.get(t.ns, pod) is None:
                cid = container_id()
                uid = kube.pod(t.ns, pod, k.name)
                kube.running(t.ns, pod, "trainer", cid)
            else:  # a rerun in the same cluster: the pod of before
                got = kube.get(t.ns, pod)
                assert got is not None
                uid = got["metadata"]["uid"]
                cid = got["status"]["containerStatuses"][0]["containerID"].split("://")[1]
            w = PodProcess(k.proc_root, k.node.socket, pod)
            k.workloads.append(w.start(uid, cid, t.ns, pod))
        for k in t.nodes:
            wait_until(
                # the API's container name: the pod's, verified (a claim names none)
                lambda k=k: any(
                    s.get("container") == "trainer"
                    for s in status_of(t, k.name).get("sessions", [])
                ),
                timeout=60,
                what=f"{k.name}'s status with its pod's session, named by the API",
            )
        yield t
    finally:
        for k in t.nodes:
            for w in k.workloads:
                w.stop()
            if k.node.proc and k.node.proc.poll() is None:
                k.node.stop()
        for key, v in saved.items():
            if v is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = v
        shutil.rmtree(d, ignore_errors=True)


def test_gpusharenode_crd_is_installed_with_its_short_name(deployed: Cluster):
    crd = deployed.kubectl("get", "crd", GSN, "-o", "json").stdout
    spec = json.loads(crd)["spec"]
    assert spec["scope"] == "Cluster" and spec["names"]["shortNames"] == ["gsn"]
    r = deployed.kubectl("api-resources", "--api-group=gpushare.io").stdout
    assert "gsn" in r and "GPUShareNode" in r and "false" in r  # namespaced: false


def test_gpusharenode_status_published_and_kubectl_get(two: Two):
    one, other = two.nodes
    st = status_of(two, one.name)
    assert st["node"] == one.name and st["summary"]["gpus"] == 2
    assert [g["index"] for g in st["gpus"]] == [0, 1]
    g0 = st["gpus"][0]
    assert g0["simulated"] is True and g0["memoryBytes"] == 16 * 2**30 and g0["tq"] == 2.0
    (s,) = [s for s in st["sessions"] if s["pod"] == "train"]
    assert (s["namespace"], s["container"]) == (two.ns, "trainer")
    assert s["memoryLimitBytes"] == 256 * 2**20 and "leaseSeconds" in s and "residentBytes" in s
    # the node's own snapshot says the same
    live = one.node.status()["gpus"]
    assert [h for g in live for h in g["holders"]] == [h for g in st["gpus"] for h in g["holders"]]
    out = two.show("get", "gpusharenodes").stdout
    lines = out.splitlines()
    assert lines[0].split() == [
        "NAME", "GPUS", "TQ", "MODE", "HOLDERS", "WAITING", "SWAPPED", "AGE"
    ]  # fmt: skip
    rows = {ln.split()[0]: ln.split() for ln in lines[1:]}
    assert rows[one.name][1:4] == ["2", "2s", "auto"]
    assert rows[other.name][1:4] == ["1", "2s", "auto"]
    wide = two.show("get", "gsn", "-o", "wide", one.name, other.name).stdout
    assert "MODEL" in wide and "[simulated]" in wide and "Applied" in wide
    assert two.kubectl("get", "gsn", other.name, "-o", "jsonpath={.status.summary.holders}")


def test_plugin_status_top_and_events(two: Two):
    one, other = two.nodes
    r = two.show("gpushare", "status")
    lines = r.stdout.splitlines()
    assert lines[0].split()[:3] == ["NODE", "GPU", "MODEL"]
    mine = [ln.split() for ln in lines[1:] if ln.split()[0] in (one.name, other.name)]
    assert sorted((x[0], x[1]) for x in mine) == [(one.name, "0"), (one.name, "1"),
                                                  (other.name, "0")]  # fmt: skip
    r = two.show("gpushare", "top", "--once", "--node", one.name)
    assert f"{two.ns}/train" in r.stdout and "trainer" in r.stdout
    assert f"{two.ns}/infer" not in r.stdout
    r = two.show("gpushare", "top", "--once")
    assert f"{two.ns}/infer" in r.stdout and f"{two.ns}/train" in r.stdout
    r = two.show("gpushare", "events", "--pod", f"{two.ns}/train")
    assert "GPUShareAttached" in r.stdout and one.name in r.stdout
    r = two.show("gpushare", "status", "-o", "json")
    assert {n["node"] for n in json.loads(r.stdout)} >= {one.name, other.name}


def test_plugin_tq_by_pod_changes_only_its_node_and_survives_its_restart(two: Two):
    one, other = two.nodes
    before = other.tqs()
    r = two.show("gpushare", "tq", "20", "--pod", f"{two.ns}/train")
    assert f"node {one.name} (of pod {two.ns}/train)" in r.stdout
    assert "TQ 20 s" in r.stdout and "applied" in r.stdout
    assert one.tqs() == [20.0, 20.0]  # live: the node's own status says so at once
    assert other.tqs() == before  # the other node untouched
    assert two.obj(other.name).get("spec", {}).get("tq") is None
    assert two.obj(one.name)["spec"]["tq"] == 20
    one.node.restart()
    wait_until(lambda: one.tqs() == [20.0, 20.0], timeout=30, what="the spec applied after start")
    wait_until(
        lambda: (
            status_of(two, one.name).get("pid") == one.node.proc.pid  # type: ignore[union-attr]
            and status_of(two, one.name)["summary"]["tq"] == "20s"
        ),
        timeout=30,
        what="the restarted node's status",
    )
    print("\n# (gpu-node-1's process restarted: a new pid, its TQ from its spec again)")
    two.show("get", "gsn")
    two.show("gpushare", "status")
    r = two.show("gpushare", "events", "--node", one.name)
    assert "SettingsApplied" in r.stdout and "tq_s=20.0" in r.stdout
    # per GPU: only GPU 1 of that node
    two.show("gpushare", "tq", "7", "--node", one.name, "--gpu", "1")
    assert one.tqs() == [20.0, 7.0] and other.tqs() == before


def test_gpusharenode_bad_spec_value_refused_and_settings_kept(two: Two):
    one = two.nodes[0]
    wait_until(lambda: status_of(two, one.name).get("conditions"), timeout=30, what="conditions")
    kept = one.tqs()
    # What the schema can judge, the server refuses at once (the CRD's CEL rules), naming
    # the field; nothing is stored.
    gen = two.obj(one.name)["metadata"]["generation"]
    for patch, said in [
        ('{"spec": {"mode": "fastest"}}', "mode must be auto or exclusive"),
        ('{"spec": {"tq": 0}}', "tq must be 0.05 to 86400 seconds"),
        ('{"spec": {"gpu": {"x": {"tq": 5}}}}', "gpu keys are GPU indexes"),
        ('{"spec": {"gpu": {"0": {"escalation": "shout"}}}}', "escalation must be"),
    ]:
        r = two.show("patch", "gsn", one.name, "--type=merge", "-p", patch, check=False)
        assert r.returncode != 0 and said in r.stderr, (patch, r.stderr)
    assert two.obj(one.name)["metadata"]["generation"] == gen
    # What only the node can judge (its GPUs), the node refuses, in the status and an Event.
    two.show("patch", "gsn", one.name, "--type=merge", "-p", '{"spec": {"gpu": {"7": {"tq": 5}}}}')

    def refused() -> dict[str, Any] | None:
        st = status_of(two, one.name)
        gen = two.obj(one.name)["metadata"]["generation"]
        c = (st.get("conditions") or [{}])[0]
        return c if c.get("observedGeneration") == gen and c.get("status") == "False" else None

    c = wait_until(refused, timeout=30, what="the refusal in the status")
    assert c["reason"] == "Refused" and "spec.gpu.7: no GPU 7 on this node" in c["message"]
    assert one.tqs() == kept and {g["mode"] for g in one.node.status()["gpus"]} == {"auto"}
    events = two.show(
        "get", "events", "-n", "default", "--field-selector",
        f"involvedObject.name={one.name},reason=SettingsRefused",
    ).stdout  # fmt: skip
    assert "no GPU 7 on this node" in events
    # the node's own event stream says so too (config_refused, from this source)
    with AdminClient(one.node.admin) as a:
        recs = [e for e in a.events() if e and e.get("event") == "config_refused"]
    assert recs and recs[-1]["source"] == f"GPUShareNode {one.name}"
    # the plugin reports the node's reason for a value only the node can judge
    two.kubectl("patch", "gsn", one.name, "--type=json", "-p",
                '[{"op": "remove", "path": "/spec/gpu"}]')  # fmt: skip
    r = two.show("gpushare", "tq", "5", "--node", one.name, "--gpu", "1")
    assert r.returncode == 0 and one.tqs()[1] == 5.0


def test_plugin_errors_name_the_fix(two: Two, deployed: Cluster):
    r = two.show("gpushare", "tq", "20", "--pod", f"{two.ns}/nothing", check=False)
    assert r.returncode == 1 and f"no pod nothing in namespace {two.ns}" in r.stderr
    two.kube.pod(two.ns, p := unique("elsewhere"), "a-node-without-gpushare")
    r = two.show("gpushare", "tq", "20", "--pod", f"{two.ns}/{p}", check=False)
    assert r.returncode == 1 and "a-node-without-gpushare has no GPUShareNode" in r.stderr
    r = two.show("gpushare", "tq", "0", "--node", two.nodes[0].name, check=False)
    assert r.returncode == 1 and "TQ must be positive" in r.stderr
    # RBAC: a user with no role, then with the viewer's only
    sa = unique("someone")
    deployed.request("POST", "/api/v1/namespaces/default/serviceaccounts",
                     {"apiVersion": "v1", "kind": "ServiceAccount",
                      "metadata": {"name": sa}})  # fmt: skip
    kc = deployed.dir / f"{sa}.kubeconfig"
    kc.write_text(json.dumps(deployed.config_for(sa, deployed.token_for("default", sa))))
    env = dict(two.env, KUBECONFIG=str(kc))
    run = [kubectl_path(), "gpushare"]
    r = subprocess.run([*run, "status"], capture_output=True, text=True, env=env, timeout=60)
    print(f"\n$ kubectl gpushare status   # as {sa}, no role\n{r.stderr}", end="")
    assert r.returncode == 1 and "forbidden" in r.stderr and "gpushare-viewer" in r.stderr
    deployed.kubectl("create", "clusterrolebinding", sa, "--clusterrole=gpushare-viewer",
                     f"--serviceaccount=default:{sa}")  # fmt: skip
    wait_until(
        lambda: subprocess.run([*run, "status"], capture_output=True, env=env).returncode == 0,
        timeout=30,
        what="the viewer's binding",
    )
    r = subprocess.run([*run, "tq", "9", "--node", two.nodes[1].name], capture_output=True,
                       text=True, env=env, timeout=60)  # fmt: skip
    print(f"\n$ kubectl gpushare tq 9 --node ...   # as a viewer\n{r.stderr}", end="")
    assert r.returncode == 1 and "forbidden" in r.stderr and "gpushare-editor" in r.stderr


def test_plugin_without_the_crd_names_the_fix(deployed: Cluster):
    from tests.cluster.conftest import built

    d = Path(tempfile.mkdtemp(prefix="gs-k8s-"))
    c = Cluster(Path(built("k8s")), d)
    try:
        c.start()
        env = dict(os.environ, KUBECONFIG=str(c.kubeconfig))
        r = subprocess.run(
            [sys.executable, "-m", "gpushare.tools.kubectl_gpushare", "status"],
            capture_output=True, text=True, env=env, timeout=60,
        )  # fmt: skip
        assert r.returncode == 1 and "no GPUShareNode kind" in r.stderr, r.stderr
        assert "kubectl apply -k deploy/kubernetes/overlays/plain" in r.stderr
    finally:
        c.stop()
        shutil.rmtree(d, ignore_errors=True)


def test_gpusharenode_node_runs_on_without_the_crd(short_tmp: Path):
    """A node with --kubernetes against a server without the CRD: said once, works on."""
    from tests.cluster.conftest import built

    d = Path(tempfile.mkdtemp(prefix="gs-k8s-"))
    c = Cluster(Path(built("k8s")), d)
    n = None
    saved = os.environ.get("KUBECONFIG")
    try:
        c.start()
        os.environ["KUBECONFIG"] = str(c.kubeconfig)
        (short_tmp / "node.toml").write_text('node_name = "lonely"\n')
        n = NodeProcess(short_tmp, *sim("4GiB"), "--kubernetes", "--config",
                        str(short_tmp / "node.toml")).start()  # fmt: skip
        wait_until(lambda: "no GPUShareNode kind" in n.log.read_text(), timeout=30,
                   what="the node to say the CRD is missing")  # fmt: skip
        n.ctl("tq", "3")
        assert n.status()["gpus"][0]["tq_s"] == 3.0
        time.sleep(2)
        assert n.log.read_text().count("no GPUShareNode kind") == 1
    finally:
        if saved is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = saved
        if n is not None and n.proc and n.proc.poll() is None:
            n.stop()
        c.stop()
        shutil.rmtree(d, ignore_errors=True)


def test_gpusharenode_write_rate_under_a_burst_of_changes(two: Two):
    """A burst of 100 settings changes in about 5 s on gpu-node-2, then 20 s of its
    session attached, idle, then two workloads taking turns (a change of holder twice a
    second): the status writes of that node, counted in the audit log."""
    other = two.nodes[1]

    def writes() -> int:
        return sum(
            1
            for e in two.c.audit(SA_USER)
            if e["verb"] == "patch"
            and (e.get("objectRef") or {}).get("name") == other.name
            and (e.get("objectRef") or {}).get("subresource") == "status"
        )

    time.sleep(3)
    n0 = writes()
    t0 = time.monotonic()
    with AdminClient(other.node.admin) as a:
        for i in range(100):
            a.set_config({"tq_s": 1.0 + i % 5})
            time.sleep(0.05)
    burst_s = time.monotonic() - t0
    time.sleep(3)  # the last change written
    n1 = writes()
    burst = n1 - n0
    last_tq = other.tqs()[0]
    wait_until(lambda: status_of(two, other.name)["gpus"][0]["tq"] == last_tq, timeout=10,
               what="the last change in the status")  # fmt: skip
    time.sleep(20)
    steady = writes() - n1
    # Two workloads taking turns for 20 s, TQ 0.5 s: the holder changes twice a second.
    with AdminClient(other.node.admin) as a:
        a.set_config({"tq_s": 0.5, "mode": "exclusive"})
    n2 = writes()
    batch = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gpushare.tools.workloads",
                "batch",
                "--socket",
                other.node.socket,
                "--memory",
                "6GiB",
                "--seconds",
                "20",
                "--name",
                f"b{i}",
            ],
            stdout=subprocess.DEVNULL,
        )
        for i in range(2)
    ]
    t1 = time.monotonic()
    for b in batch:
        b.wait(timeout=120)
    busy_s = time.monotonic() - t1
    busy = writes() - n2
    with AdminClient(other.node.admin) as a:
        grants = sum(1 for e in a.events(since_s=busy_s + 5) if e and e["event"] == "grant")
    print(
        f"\nstatus writes of {other.name}: {burst} during a burst of 100 changes in"
        f" {burst_s:.1f} s (+3 s) = {burst / (burst_s + 3):.2f}/s;"
        f" {steady} in 20 s of a session attached, idle = {steady / 20:.2f}/s;"
        f" {busy} in {busy_s:.1f} s of two workloads taking turns ({grants} grants)"
        f" = {busy / busy_s:.2f}/s"
    )
    assert 1 <= burst <= (burst_s + 3) / 2.0 + 2  # at most one per 2 s, and the change made it
    assert steady <= 20 / 2.0 + 1
    assert grants > busy > 0 and busy <= busy_s / 2.0 + 2

"""gpushare as a DRA driver (issue 41), against the real control plane: the DeviceClass
manifest is served; the `gpushare-dra` kubelet plugin (deploy/dra, built by
tests/cluster/build-dra.sh) publishes its node's ResourceSlice from what the gpushare node
reports, and reconciles it when it starts again; kube-scheduler's DRA allocator shares one
GPU by the consumable capacity `memory` of that slice (allowMultipleAllocations), leaving a
claim past the GPU's memory unallocated (DRAConsumableCapacity is beta and on by default in
1.36+: no feature gate is passed); and the plugin prepares and unprepares claims through
the DRA gRPC calls the kubelet makes (`gpushare-dra kubelet-call`: no kubelet runs here),
writing a CDI spec whose env attaches a workload with the claim's request and limit, and
refusing bad opaque parameters in one line."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cluster.conftest import K8S, Kube, unique
from tests.cluster.controlplane import NODE_SA, Cluster
from tests.cluster.test_scheduling import make_node
from tests.support import REPO, NodeProcess, sim, wait_until

pytestmark = pytest.mark.cluster
DRIVER = "gpu.gpushare.io"
GIB = 1 << 30
R = "/apis/resource.k8s.io/v1"


@pytest.fixture(scope="module")
def dra(deployed: Cluster) -> Cluster:
    for f in ("deviceclass.yaml", "rbac.yaml"):
        deployed.kubectl("apply", "-f", str(K8S / "components" / "dra" / f))
    return deployed


def dra_binary() -> str:
    """The plugin as `make test` built it; the DRA plugin tests skip, saying why, without."""
    r = subprocess.run(
        ["bash", str(REPO / "tests" / "cluster" / "build-dra.sh"), "--cached"],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        pytest.skip(f"no gpushare-dra binary: {r.stderr.strip()}")
    return r.stdout.strip().splitlines()[-1]


class Plugin:
    """One `gpushare-dra` process for a Kubernetes node and its gpushare node, with the
    rights the manifests give it (the node's service account, components/dra/rbac.yaml)
    and its kubelet folders, CDI folder included, in a folder of the test's."""

    def __init__(self, binary: str, c: Cluster, node: NodeProcess, name: str, d: Path) -> None:
        self.binary, self.node, self.name, self.dir = binary, node, name, d
        self.kubeconfig = d / "dra.kubeconfig"
        # bound to its node, as the DaemonSet pod's token is bound to a pod on it: the
        # server lets a node's plugin write status.devices of that node's claims alone
        token = c.token_for(*NODE_SA, node=name)
        self.kubeconfig.write_text(json.dumps(c.config_for(NODE_SA[1], token)))
        self.cdi = d / "cdi"
        self.socket = d / "plugin" / "dra.sock"
        self.log = d / "dra.log"
        self.proc: subprocess.Popen[bytes] | None = None
        (d / "registry").mkdir()  # the kubelet's plugins_registry: there before any plugin

    def start(self) -> Plugin:
        gpushare = f"{sys.executable} -m gpushare"
        args = [
            self.binary,
            f"--kubeconfig={self.kubeconfig}",
            f"--node-name={self.name}",
            f"--gpushare={gpushare}",
            f"--admin-socket={self.node.admin}",
            f"--socket={self.node.socket}",
            f"--plugin-dir={self.dir / 'plugin'}",
            f"--registrar-dir={self.dir / 'registry'}",
            f"--cdi-dir={self.cdi}",
            "--resync=1s",  # the node's GPUs read again each second (default 30 s)
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(args, stderr=log, env=env)
        wait_until(self.serving, timeout=60, what=f"the plugin's sockets ({self.log})")
        return self

    def serving(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"gpushare-dra exited: {self.log.read_text()}")
        return self.socket.exists() and any((self.dir / "registry").glob("*-reg.sock"))

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def call(self, verb: str, ns: str, claim: dict[str, Any]) -> dict[str, Any]:
        """The kubelet's NodePrepareResources / NodeUnprepareResources for one claim: its
        reply for that claim ({} for none)."""
        m = claim["metadata"]
        at = f"--plugin-socket={self.socket}"
        r = subprocess.run(
            [self.binary, "kubelet-call", at, verb, ns, m["name"], m["uid"]],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0, r.stderr
        claims = json.loads(r.stdout).get("claims") or {}
        return dict(claims.get(m["uid"]) or {})


@pytest.fixture
def plugin(deployed: Cluster, node_factory, short_tmp: Path) -> Iterator[Any]:
    """make(memory, **node flags) -> (Plugin, Kubernetes node name): a gpushare node on one
    simulated GPU of that memory, its Node object, and the plugin serving it."""
    binary = dra_binary()
    made: list[Plugin] = []

    def make(memory: str = "4GiB", **flags: object) -> tuple[Plugin, str]:
        name = unique("gpu-node")
        make_node(deployed, name, gpus=0)
        n = node_factory(*sim(memory, **flags))
        d = short_tmp / f"dra{len(made)}"
        d.mkdir()
        p = Plugin(binary, deployed, n, name, d)
        made.append(p)
        return p.start(), name

    yield make
    for p in made:
        p.stop()
        print(f"--- {p.log}:\n{p.log.read_text()}")  # shown where the test failed


def slices_of(c: Cluster, node: str) -> list[dict[str, Any]]:
    items = c.request("GET", f"{R}/resourceslices?fieldSelector=spec.nodeName={node}")["items"]
    return [s for s in items if s["spec"]["driver"] == DRIVER]


def devices_of(c: Cluster, node: str) -> list[dict[str, Any]]:
    return [d for s in slices_of(c, node) for d in s["spec"].get("devices", [])]


def slice_for(node: str, memory: int, device: str = "gpu-0") -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": unique(f"{node}-stale")},
        "spec": {
            "driver": DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [
                {
                    "name": device,
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


def claim_pod(
    c: Cluster, ns: str, node: str, memory: str, params: dict[str, Any] | None = None
) -> tuple[str, str]:
    """A claim for a share of a GPU with ``memory``, with gpushare's opaque ``params``
    (GPUShareClaimParameters' fields), and a pod on ``node`` that uses it."""
    claim = unique("share")
    devices: dict[str, Any] = {
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
    if params is not None:
        raw = {"apiVersion": "gpushare.io/v1alpha1", "kind": "GPUShareClaimParameters"}
        devices["config"] = [
            {"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": raw | params}}
        ]
    c.request(
        "POST",
        f"{R}/namespaces/{ns}/resourceclaims",
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": claim, "namespace": ns},
            "spec": {"devices": devices},
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


def allocation(c: Cluster, ns: str, claim: str) -> dict[str, Any]:
    cl = c.request("GET", f"{R}/namespaces/{ns}/resourceclaims/{claim}")
    return dict(cl.get("status", {}).get("allocation") or {})


def allocated(c: Cluster, ns: str, claim: str) -> dict[str, Any]:
    """The claim once the scheduler has allocated it."""
    wait_until(lambda: allocation(c, ns, claim) != {}, timeout=120, what=f"{claim} allocated")
    return c.request("GET", f"{R}/namespaces/{ns}/resourceclaims/{claim}")


def test_dra_plugin_publishes_the_nodes_gpus_and_reconciles_on_restart(dra: Cluster, plugin):
    c = dra
    p, node = plugin("4GiB")
    wait_until(lambda: len(devices_of(c, node)) == 1, timeout=60, what="the node's slice")
    (dev,) = devices_of(c, node)
    (g,) = p.node.status()["gpus"]
    assert dev["name"] == "gpu-0"
    assert dev["allowMultipleAllocations"] is True
    assert dev["capacity"]["memory"]["value"] == "4Gi"
    a = dev["attributes"]
    assert a["uuid"]["string"] == g["uuid"] and a["model"]["string"] == g["name"]
    assert a["simulated"]["bool"] is True
    assert a["gpushareVersion"]["string"] and a["driverVersion"]["version"]
    (s,) = slices_of(c, node)
    assert s["spec"]["pool"]["name"] == node
    assert [o["kind"] for o in s["metadata"]["ownerReferences"]] == ["Node"]
    # While it is down, the pool goes wrong: a stale slice with a GPU the node lacks.
    p.stop()
    c.request("POST", f"{R}/resourceslices", slice_for(node, 1 * GIB, device="gpu-9"))
    assert len(devices_of(c, node)) == 2
    p.start()

    def names() -> list[str]:
        return sorted(d["name"] for d in devices_of(c, node))

    wait_until(lambda: names() == ["gpu-0"], timeout=60, what="the stale slice removed")
    assert devices_of(c, node)[0]["capacity"]["memory"]["value"] == "4Gi"


def test_dra_plugin_publishes_a_change_of_the_nodes_gpus_while_it_runs(dra: Cluster, plugin):
    c = dra
    p, node = plugin("4GiB")
    wait_until(lambda: len(devices_of(c, node)) == 1, timeout=60, what="the node's slice")
    p.node.restart("--sim-gpus", "2", "--sim-memory", "8GiB")  # the node on other GPUs

    def memory() -> list[tuple[str, str]]:
        return sorted((d["name"], d["capacity"]["memory"]["value"]) for d in devices_of(c, node))

    want = [("gpu-0", "8Gi"), ("gpu-1", "8Gi")]
    wait_until(lambda: memory() == want, timeout=60, what="the node's new GPUs published")
    assert p.proc is not None and p.proc.poll() is None


def test_dra_scheduler_shares_one_gpu_by_memory_and_refuses_past_it(
    dra: Cluster, kube: Kube, plugin
):
    c, ns = dra, "dra"
    _, node = plugin("4GiB")  # the slice is the plugin's
    kube.namespace(ns)
    wait_until(lambda: len(devices_of(c, node)) == 1, timeout=60, what="the node's slice")
    a = claim_pod(c, ns, node, "1Gi")
    b = claim_pod(c, ns, node, "2Gi")
    results = [
        allocated(c, ns, x)["status"]["allocation"]["devices"]["results"][0] for x, _ in (a, b)
    ]
    assert {r["device"] for r in results} == {"gpu-0"}
    assert {r["pool"] for r in results} == {node}
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
    assert allocation(c, ns, third_claim) == {}


ATTACH = """
import json, sys, gpushare
s = gpushare.attach(name="dra-claim")
print(json.dumps({"id": s.id}), flush=True)
sys.stdin.read()
"""


def cdi_env(p: Plugin, cdi_id: str) -> dict[str, str]:
    """The env the container runtime would give a container with CDI device ``cdi_id``,
    read from the spec files in the plugin's CDI folder."""
    kind, name = cdi_id.split("=")
    for f in p.cdi.glob("*.json"):
        spec = json.loads(f.read_text())
        if spec["kind"] != kind:
            continue
        for d in spec["devices"]:
            if d["name"] == name:
                return dict(e.split("=", 1) for e in d["containerEdits"]["env"])
    raise AssertionError(f"no CDI device {cdi_id} in {p.cdi}")


def test_dra_prepare_gives_a_cdi_spec_that_attaches_with_the_claims_request_and_limit(
    dra: Cluster, kube: Kube, plugin
):
    c, ns = dra, "dra"
    p, node = plugin("4GiB")
    kube.namespace(ns)
    params = {"memoryLimit": "2Gi", "weight": 2, "computeLimit": 0.5, "sharingMode": "sm-sharing"}
    claim, _ = claim_pod(c, ns, node, "1Gi", params)
    cl = allocated(c, ns, claim)
    reply = p.call("prepare", ns, cl)
    assert not reply.get("error"), reply
    (dev,) = reply["devices"]
    assert (dev["pool_name"], dev["device_name"], dev["request_names"]) == (node, "gpu-0", ["gpu"])
    (cdi_id,) = dev["cdi_device_ids"]
    env = cdi_env(p, cdi_id)
    (g,) = p.node.status()["gpus"]
    assert env == {
        "GPUSHARE_SOCKET": p.node.socket,
        "NVIDIA_VISIBLE_DEVICES": g["uuid"],
        "GPUSHARE_MEMORY": str(GIB),
        "GPUSHARE_MEMORY_LIMIT": str(2 * GIB),
        "GPUSHARE_WEIGHT": "2",
        "GPUSHARE_COMPUTE_LIMIT": "0.5",
        "GPUSHARE_SHARING_MODE": "sm-sharing",
        "GPUSHARE_CLAIM": cl["metadata"]["uid"],
    }
    files = {f.name: f.read_text() for f in p.cdi.glob("*.json")}
    assert p.call("prepare", ns, cl) == reply  # the kubelet may ask again: the same answer
    assert {f.name: f.read_text() for f in p.cdi.glob("*.json")} == files

    # A workload given that env (and nothing else of this shell's) attaches as the claim says.
    w, sid = attach_with(env)
    try:
        s = session_on(p, sid)
        assert (s["memory_request_bytes"], s["memory_limit_bytes"]) == (GIB, 2 * GIB)
        assert s["compute_limit"] == 0.5
        assert s["claimed"]["sharing"] == "sm-sharing"
        assert s["claim"] == cl["metadata"]["uid"]
    finally:
        w.kill()
        w.wait()

    assert p.call("unprepare", ns, cl) == {}
    assert list(p.cdi.glob("*.json")) == []
    assert p.call("unprepare", ns, cl) == {}  # again: already unprepared, no error


def share_of(c: Cluster, ns: str, claim: str) -> dict[str, Any] | None:
    """The data of this driver's entry in the claim's status.devices (None: no entry)."""
    cl = c.request("GET", f"{R}/namespaces/{ns}/resourceclaims/{claim}")
    mine = [d for d in cl.get("status", {}).get("devices") or [] if d["driver"] == DRIVER]
    return dict(mine[0].get("data") or {}) if mine else None


def only(env: dict[str, str]) -> dict[str, str]:
    """``env`` and nothing else of this shell's but what runs Python (a container's)."""
    return {k: os.environ[k] for k in ("PATH", "PYTHONPATH", "HOME") if k in os.environ} | env


def attach_with(env: dict[str, str]) -> tuple[subprocess.Popen[str], int]:
    """A workload given ``env`` (and nothing else of this shell's): its process and id."""
    w = subprocess.Popen(
        [sys.executable, "-c", ATTACH],
        env=only(env),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert w.stdout is not None
    line = w.stdout.readline()
    if not line:
        w.wait(30)
        raise AssertionError(f"the workload did not attach: {w.stderr.read() if w.stderr else ''}")
    return w, int(json.loads(line)["id"])


def session_on(p: Plugin, sid: int) -> dict[str, Any]:
    (s,) = [s for s in p.node.status()["gpus"][0]["sessions"] if s["id"] == sid]
    return dict(s)


def wait_share_sessions(c: Cluster, ns: str, claim: str, n: int) -> dict[str, Any]:
    """The claim's share once its status.devices shows ``n`` sessions."""
    wait_until(lambda: (share_of(c, ns, claim) or {}).get("sessions") == n, timeout=60,
               what=f"the claim's status.devices showing {n} session(s)")  # fmt: skip
    return share_of(c, ns, claim) or {}


def ended_by_admin(p: Plugin) -> set[int]:
    """The sessions an administrator (here: an unprepare) ended."""
    ended = [e for e in p.node.event_list() if e["event"] == "detach"]
    return {e["session"] for e in ended if e.get("reason") == "ended"}


def test_dra_a_prepared_claim_bounds_its_sessions_shows_its_share_and_unprepare_ends_them(
    dra: Cluster, kube: Kube, plugin
):
    """The node enforces what the plugin prepared: a session naming the claim gets no more
    than its limit, whatever its env asks; the claim's status.devices shows its live share;
    a node started again is told the claim again, and a second session on it is refused;
    unprepare ends the claim's session."""
    c, ns = dra, "dra"
    p, node = plugin("4GiB")
    kube.namespace(ns)
    claim, _ = claim_pod(c, ns, node, "1Gi", {"memoryLimit": "2Gi", "computeLimit": 0.5})
    cl = allocated(c, ns, claim)
    uid = cl["metadata"]["uid"]
    (cdi_id,) = p.call("prepare", ns, cl)["devices"][0]["cdi_device_ids"]
    env = cdi_env(p, cdi_id)
    # its env edited: more memory, no compute limit
    asks_more = env | {"GPUSHARE_MEMORY_LIMIT": str(3 * GIB), "GPUSHARE_COMPUTE_LIMIT": ""}
    procs = []
    try:
        w, sid = attach_with(asks_more)
        procs.append(w)
        s = session_on(p, sid)  # the node bounds it by the claim's 2 GiB and half the GPU
        assert (s["claim"], s["memory_limit_bytes"], s["memory_request_bytes"]) == (
            uid, 2 * GIB, GIB
        )  # fmt: skip
        assert s["compute_limit"] == 0.5
        data = wait_share_sessions(c, ns, claim, 1)
        assert (data["memoryRequestBytes"], data["memoryLimitBytes"]) == (GIB, 2 * GIB)
        assert data["simulated"] is True and data["state"] in ("idle", "holding")
        # a claim the plugin never prepared is no one's to name
        other, _ = attach_refused(env | {"GPUSHARE_CLAIM": "0000-not-prepared"})
        assert "is not prepared on this node" in other, other

        told = p.log.read_text().count("the node started again")
        p.node.restart()
        wait_until(lambda: p.log.read_text().count("the node started again") > told,
                   timeout=60, what="the plugin telling the node again")  # fmt: skip
        # the session came back on its claim; the node knows the claim again (a new
        # session naming it is told it is held, not that it is not prepared): one
        # session a claim
        wait_until(lambda: any(s["id"] == sid for s in p.node.status()["gpus"][0]["sessions"]),
                   timeout=60, what="the session back after the restart")  # fmt: skip
        assert (session_on(p, sid)["claim"], session_on(p, sid)["memory_limit_bytes"]) == (
            uid, 2 * GIB
        )  # fmt: skip
        second, _ = attach_refused(asks_more)
        assert f"is held by session {sid} already" in second, second
        wait_share_sessions(c, ns, claim, 1)

        assert p.call("unprepare", ns, cl) == {}
        live = {s["id"] for s in p.node.status()["gpus"][0]["sessions"]}
        assert sid not in live, live
        assert sid in ended_by_admin(p)
        wait_until(lambda: share_of(c, ns, claim) is None, timeout=60,
                   what="the claim's status.devices entry taken off")  # fmt: skip
        refused, _ = attach_refused(env)  # unprepared: no new session names it
        assert "is not prepared on this node" in refused, refused
    finally:
        for w in procs:
            w.kill()
            w.wait()


def attach_refused(env: dict[str, str]) -> tuple[str, int]:
    """A workload given ``env`` that the node refuses: its stderr and exit status."""
    r = subprocess.run(
        [sys.executable, "-c", ATTACH], env=only(env), input="", capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode != 0, r.stdout
    return r.stderr, r.returncode


TURNS = """
import json, sys, time, gpushare
s = gpushare.attach(name="dra-turns")
print(json.dumps({"id": s.id}), flush=True)
sys.stdin.readline()  # both containers attached: go
for _ in range(8):
    with s.gpu():
        time.sleep(0.1)
    time.sleep(0.02)
print(json.dumps({"bursts": 8}), flush=True)
"""


def holder_changes(events: list[dict[str, Any]], ids: set[str]) -> int:
    """How many times the GPU went from one of ``ids`` to another, by the grants."""
    order = [e["session"] for e in events if e["event"] == "grant" and e["session"] in ids]
    return sum(a != b for a, b in itertools.pairwise(order))


def test_dra_two_claims_on_one_gpu_take_turns_in_their_containers(dra: Cluster, kube: Kube, plugin):
    """Two claims prepared on one GPU, each container given only its CDI env: both attach
    with their claim's figures and, in exclusive mode, hold the GPU in turns."""
    c, ns = dra, "dra"
    p, node = plugin("4GiB", mode="exclusive", tq="0.2")
    kube.namespace(ns)
    params = {"memoryLimit": "1Gi", "sharingMode": "time-slicing"}
    procs = []
    try:
        for _ in range(2):
            cl = allocated(c, ns, claim_pod(c, ns, node, "1Gi", params)[0])
            reply = p.call("prepare", ns, cl)
            assert not reply.get("error"), reply
            (cdi_id,) = reply["devices"][0]["cdi_device_ids"]
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", TURNS],
                    env=only(cdi_env(p, cdi_id)),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        ids = set()
        for w in procs:
            assert w.stdout is not None
            ids.add(json.loads(w.stdout.readline())["id"])
        sessions = {s["id"]: s for s in p.node.status()["gpus"][0]["sessions"]}
        assert ids <= set(sessions)
        assert all(sessions[i]["memory_request_bytes"] == GIB for i in ids)
        for w in procs:
            assert w.stdin is not None
            w.stdin.write("go\n")
            w.stdin.flush()
        for w in procs:
            out, _ = w.communicate(timeout=120)
            assert w.returncode == 0 and json.loads(out.splitlines()[-1]) == {"bursts": 8}
    finally:
        for w in procs:
            if w.poll() is None:
                w.kill()
                w.wait()
    # 8 bursts of 0.1 s each against TQ 0.2 s: neither holds the GPU for all of its own.
    assert holder_changes(p.node.event_list(), ids) >= 2


@pytest.mark.parametrize(
    "params, says",
    [
        ({"weight": 0}, "GPUShareClaimParameters.weight 0: give a number above 0"),
        ({"memoryLimt": "2Gi"}, 'unknown field "memoryLimt"'),
        ({"sharingMode": "mps"}, 'sharingMode "mps": use time-slicing or sm-sharing'),
        ({"memoryLimit": "512Mi"}, "memoryLimit 512Mi is below the request's memory"),
    ],
)
def test_dra_prepare_refuses_bad_parameters_in_one_line(
    dra: Cluster, kube: Kube, plugin, params, says
):
    c, ns = dra, "dra"
    p, node = plugin("4GiB")
    kube.namespace(ns)
    claim, _ = claim_pod(c, ns, node, "1Gi", params)
    cl = allocated(c, ns, claim)
    reply = p.call("prepare", ns, cl)
    err = reply.get("error", "")
    assert says in err and "\n" not in err, err
    assert claim in err  # which claim: the kubelet shows it on the pod's events
    assert list(p.cdi.glob("*.json")) == []  # a refused claim gets no spec


def test_dra_component_runs_the_plugin_beside_the_node_with_flags_it_has(
    dra: Cluster, tmp_path: Path
):
    """components/dra over an overlay: the plugin a container of the node's pod, with the
    node's sockets and the kubelet's folders, its args flags the binary has; the server
    takes the DaemonSet (a server-side dry run)."""
    k = os.path.relpath(K8S, tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources: [{k}/overlays/plain]\ncomponents: [{k}/components/dra]\n"
    )
    out = dra.kubectl("kustomize", str(tmp_path)).stdout
    (ds,) = [o for o in yaml.safe_load_all(out) if o and o["kind"] == "DaemonSet"]
    pod = ds["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in pod["containers"]}
    assert set(containers) == {"node", "dra"}
    plugin = containers["dra"]
    mounts = {m["mountPath"] for m in plugin["volumeMounts"]}
    assert {"/run/gpushare", "/run/gpushare-admin", "/var/lib/kubelet/plugins_registry"} <= mounts
    for a in plugin["args"]:
        path = a.split("=", 1)[1]
        if a.startswith(("--admin-socket", "--socket")):
            assert any(path.startswith(m + "/") for m in mounts), a
    assert {e["name"] for e in plugin["env"]} == {"NODE_NAME"}
    helped = subprocess.run([dra_binary(), "-h"], capture_output=True, text=True).stderr
    for a in plugin["args"]:
        assert f"  -{a.split('=')[0].lstrip('-')} " in helped, (a, helped)
    (tmp_path / "ds.yaml").write_text(yaml.safe_dump(ds))
    dra.kubectl("apply", "--dry-run=server", "-f", str(tmp_path / "ds.yaml"))


def test_dra_plugin_is_gofmt_clean_vetted_and_its_go_tests_pass():
    """deploy/dra's own checks (parameters, CDI specs, what the node is told, a restart's
    resend, a claim's share), with the Go that built it; skipped, saying so, without Go."""
    go = shutil.which("go")
    if go is None:
        pytest.skip("no Go on this machine: deploy/dra's Go tests need it")
    src = REPO / "deploy" / "dra"
    gofmt = shutil.which("gofmt") or str(Path(go).resolve().parent / "gofmt")
    fmt = subprocess.run([gofmt, "-l", "."], cwd=src, capture_output=True, text=True)
    assert fmt.returncode == 0 and fmt.stdout == "", f"gofmt -l: {fmt.stdout}{fmt.stderr}"
    for args in (["vet", "./..."], ["test", "-count=1", "./..."]):
        r = subprocess.run([go, *args], cwd=src, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, f"go {' '.join(args)}:\n{r.stdout}{r.stderr}"

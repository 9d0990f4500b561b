"""The Kubernetes manifests render (kustomize) and validate against the Kubernetes
OpenAPI schema offline; the examples too; the ConfigMap's TOML is a valid node config."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import kubernetes_validate
import msgspec
import pytest
import yaml

from gpushare.node.keep.config import NodeConfig
from tests.support import REPO

ROOT = REPO
K8S = ROOT / "deploy" / "kubernetes"
KUBECTL = shutil.which("kubectl") or str(Path(sys.executable).parent / "kubectl")
VERSION = "1.33.0"


def render(overlay: str) -> list[dict]:
    r = subprocess.run(
        [KUBECTL, "kustomize", str(K8S / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    return [o for o in yaml.safe_load_all(r.stdout) if o]


def by_kind(objs: list[dict]) -> dict[str, dict]:
    return {o["kind"]: o for o in objs}


@pytest.mark.parametrize("overlay", ["plain", "kai"])
def test_overlay_renders_and_validates(overlay):
    objs = render(overlay)
    for o in objs:
        if o["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD (checked below), not in the Kubernetes schema
        kubernetes_validate.validate(o, VERSION, strict=True)
    kinds = by_kind(objs)
    assert {
        "Namespace",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "ConfigMap",
        "DaemonSet",
        "Service",
    } <= set(kinds)
    assert all(o["metadata"].get("namespace", "gpushare-system") == "gpushare-system" for o in objs)


def test_daemonset_has_what_a_node_agent_needs():
    ds = by_kind(render("plain"))["DaemonSet"]["spec"]["template"]["spec"]
    assert ds["hostPID"] is True
    assert ds["runtimeClassName"] == "nvidia"
    assert ds["priorityClassName"] == "system-node-critical"
    paths = {v["hostPath"]["path"] for v in ds["volumes"] if "hostPath" in v}
    assert paths == {"/run/gpushare", "/run/gpushare-admin", "/var/lib/gpushare"}
    (c,) = ds["containers"]
    assert c["readinessProbe"] and c["livenessProbe"] and c["resources"]["requests"]
    assert "--kubernetes" in c["args"] and any(a.startswith("--state=/var/lib") for a in c["args"])


def test_rbac_is_read_pods_and_its_gpusharenode():
    (role,) = [
        o
        for o in render("plain")
        if o["kind"] == "ClusterRole" and o["metadata"]["name"] == "gpushare-node"
    ]
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]},
        {"apiGroups": ["gpushare.io"], "resources": ["gpusharenodes"],
         "verbs": ["list", "watch", "create"]},
        {"apiGroups": ["gpushare.io"], "resources": ["gpusharenodes/status"], "verbs": ["patch"]},
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    ]  # fmt: skip
    # the people's roles: read; and patch (the spec), never the status
    roles = {o["metadata"]["name"]: o for o in render("plain") if o["kind"] == "ClusterRole"}
    assert {"gpushare-viewer", "gpushare-editor"} <= set(roles)
    editor = {(r, v) for rule in roles["gpushare-editor"]["rules"] for r in rule["resources"]
              for v in rule["verbs"]}  # fmt: skip
    assert ("gpusharenodes", "patch") in editor and not any(
        r == "gpusharenodes/status" for r, _ in editor
    )


def test_gpusharenode_crd_printer_columns_name_status_fields():
    (crd,) = [o for o in render("plain") if o["kind"] == "CustomResourceDefinition"]
    assert crd["spec"]["scope"] == "Cluster" and crd["spec"]["names"]["shortNames"] == ["gsn"]
    (v,) = crd["spec"]["versions"]
    cols = {c["name"]: c for c in v["additionalPrinterColumns"]}
    default = [n for n, c in cols.items() if not c.get("priority")]
    assert default == ["GPUs", "TQ", "Mode", "Holders", "Waiting", "Swapped", "Age"]
    # every column reads a field the node writes (gpushare.node.kube.node_status.status_body)
    from gpushare.node.kube.node_status import status_body
    from gpushare.status import NodeInfo, NodeStatus

    body = {"status": status_body("n", NodeStatus(node=NodeInfo(pid=1, started=0, config=""),
                                                  gpus=[]), [], 0, 0)}  # fmt: skip
    for c in cols.values():
        path = c["jsonPath"].split("[")[0].strip(".").split(".")
        if path[0] == "metadata":
            continue
        obj: object = body
        for part in path:
            assert isinstance(obj, dict) and part in obj, (c["name"], c["jsonPath"])
            obj = obj[part]


def test_gpusharenode_crd_rules_refuse_what_the_settings_refuse():
    """The CRD's CEL rules (the server refuses a bad spec at `kubectl apply`) say what
    gpushare.settings says: the same TQ bounds and choices, node-wide and per GPU
    (tests/cluster/test_crd.py shows the server applying them)."""
    from gpushare import settings

    (crd,) = [o for o in render("plain") if o["kind"] == "CustomResourceDefinition"]
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    per_gpu = spec["properties"]["gpu"]["additionalProperties"]["properties"]
    choices = {"mode": settings.MODES, "policy": settings.POLICIES,
               "escalation": settings.ESCALATIONS}  # fmt: skip
    for props in (spec["properties"], per_gpu):
        (tq,) = props["tq"]["x-kubernetes-validations"]
        assert tq["rule"] == f"self >= {settings.TQ_MIN_S} && self <= {settings.TQ_MAX_S}"
        for key, allowed in choices.items():
            (rule,) = props[key]["x-kubernetes-validations"]
            assert rule["rule"] == f"self in {list(allowed)}", key
            assert all(a in rule["message"] for a in allowed)


@pytest.mark.parametrize("overlay", ["plain", "kai"])
def test_configmap_is_a_valid_node_config(overlay):
    cm = by_kind(render(overlay))["ConfigMap"]
    cfg = msgspec.convert(tomllib.loads(cm["data"]["node.toml"]), NodeConfig)
    assert cfg.socket == "/run/gpushare/gpushare.sock"
    if overlay == "kai":
        assert cfg.policy == "weighted"


def test_kai_overlay_servicemonitor_selects_the_metrics_service():
    kinds = by_kind(render("kai"))
    sm, svc = kinds["ServiceMonitor"], kinds["Service"]
    sel = sm["spec"]["selector"]["matchLabels"]
    assert all(svc["metadata"]["labels"].get(k) == v for k, v in sel.items())
    assert sm["spec"]["endpoints"][0]["port"] in {p["name"] for p in svc["spec"]["ports"]}
    assert "ServiceMonitor" not in by_kind(render("plain"))


@pytest.mark.parametrize("overlay", ["plain", "kai"])
def test_the_admin_socket_is_where_no_workload_reaches_it(overlay):
    kinds = by_kind(render(overlay))
    cfg = msgspec.convert(tomllib.loads(kinds["ConfigMap"]["data"]["node.toml"]), NodeConfig)
    admin_dir = str(Path(cfg.admin_socket).parent)
    assert admin_dir != str(Path(cfg.socket).parent)
    ds = kinds["DaemonSet"]["spec"]["template"]["spec"]
    mounted = {m["mountPath"] for m in ds["containers"][0]["volumeMounts"]}
    assert admin_dir in mounted  # the node's own pod has it (kubectl exec, the probe)
    probe = ds["containers"][0]["livenessProbe"]["exec"]["command"]
    assert cfg.admin_socket in probe
    for example in sorted((ROOT / "deploy" / "examples").glob("*.yaml")):
        for o in yaml.safe_load_all(example.read_text()):
            spec = o["spec"]["template"]["spec"] if o["kind"] == "Deployment" else o["spec"]
            for v in spec["volumes"]:
                host = v.get("hostPath", {}).get("path")
                assert host is None or not (admin_dir + "/").startswith(host.rstrip("/") + "/"), (
                    f"{example.name} mounts {host}, where the admin socket is"
                )


@pytest.mark.parametrize(
    "example", sorted((ROOT / "deploy" / "examples").glob("*.yaml")), ids=lambda p: p.name
)
def test_examples_validate_and_mount_the_socket(example):
    for o in yaml.safe_load_all(example.read_text()):
        kubernetes_validate.validate(o, VERSION, strict=True)
        spec = o["spec"]["template"]["spec"] if o["kind"] == "Deployment" else o["spec"]
        assert any(v.get("hostPath", {}).get("path") == "/run/gpushare" for v in spec["volumes"])
        env = {e["name"] for e in spec["containers"][0]["env"]}
        assert {"POD_NAME", "POD_NAMESPACE", "POD_UID"} <= env

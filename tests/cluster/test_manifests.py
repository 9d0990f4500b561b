"""The manifests on a real API server, from a fresh cluster, in the order a user follows
(docs/kubernetes.md): what the server refuses out of order, that every kustomization
and example applies, that what the server keeps is what the manifests say (no drift for
`kubectl diff`), server-side apply, the selectors as the server evaluates them, and an
uninstall."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cluster.conftest import K8S, SERVICEMONITOR_CRD, built
from tests.cluster.controlplane import Cluster
from tests.support import REPO

EXAMPLES = sorted((REPO / "deploy" / "examples").glob("*.yaml"))
NS = "gpushare-system"
pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def fresh() -> Iterator[Cluster]:
    """A cluster of its own: nothing applied yet."""
    d = Path(tempfile.mkdtemp(prefix="gs-k8s-"))
    c = Cluster(Path(built("k8s")), d)
    try:
        yield c.start()
    finally:
        c.stop()
        shutil.rmtree(d, ignore_errors=True)


def rendered(c: Cluster, overlay: str) -> list[dict]:
    out = c.kubectl("kustomize", str(K8S / "overlays" / overlay)).stdout
    return [o for o in yaml.safe_load_all(out) if o]


def get(c: Cluster, *args: str) -> dict:
    return dict(yaml.safe_load(c.kubectl("get", "-o", "yaml", *args).stdout))


def test_install_as_documented(fresh: Cluster):
    c = fresh
    plain, kai = str(K8S / "overlays" / "plain"), str(K8S / "overlays" / "kai")
    assert_refused_out_of_order(c, plain, kai)
    install_in_order(c, plain, kai)
    ds = assert_kept_as_rendered(c)
    assert_selectors_select_the_pods(c, ds)
    apply_the_examples(c)
    assert_uninstalled(c, kai)


def assert_refused_out_of_order(c: Cluster, plain: str, kai: str) -> None:
    """Out of order, the server says what is missing."""
    r = c.kubectl("apply", "--dry-run=server", "-k", plain, check=False)
    assert r.returncode != 0 and f'namespaces "{NS}" not found' in r.stderr, r.stderr
    r = c.kubectl("apply", "-k", kai, check=False)
    assert r.returncode != 0 and 'no matches for kind "ServiceMonitor"' in r.stderr, r.stderr


def install_in_order(c: Cluster, plain: str, kai: str) -> None:
    """The documented steps 1 and 2, and what the server then keeps."""
    # 1. The Prometheus Operator's CRD (only for an overlay with a ServiceMonitor).
    c.kubectl("apply", "-f", str(SERVICEMONITOR_CRD))
    c.kubectl("wait", "--for=condition=established", "--timeout=60s",
              "crd/servicemonitors.monitoring.coreos.com")  # fmt: skip
    # 2. An overlay; a second overlay over it (plain, then kai) reconfigures in place.
    c.kubectl("apply", "-k", plain)
    c.kubectl("apply", "-k", kai)
    # What the server keeps is what the manifests say: nothing left to change.
    r = c.kubectl("diff", "-k", kai, check=False)
    assert r.returncode == 0, f"kubectl diff after apply:\n{r.stdout}{r.stderr}"
    assert c.kubectl("apply", "--dry-run=server", "-k", kai).returncode == 0
    # Server-side apply (kubectl --server-side, Argo CD, Flux) takes every object too.
    r = c.kubectl("apply", "--server-side", "--force-conflicts", "-k", kai, check=False)
    assert r.returncode == 0, r.stderr


def assert_kept_as_rendered(c: Cluster) -> dict[str, Any]:
    """Every object of the kai overlay is on the server, the DaemonSet's args and the
    ConfigMap as rendered; the DaemonSet as the server keeps it."""
    objs = rendered(c, "kai")
    for o in objs:
        ns = o["metadata"].get("namespace")
        kept = get(c, o["kind"], o["metadata"]["name"], *(["-n", ns] if ns else []))
        assert kept["metadata"]["uid"]
    ds = get(c, "daemonset", "gpushare-node", "-n", NS)
    want = next(o for o in objs if o["kind"] == "DaemonSet")
    assert (
        ds["spec"]["template"]["spec"]["containers"][0]["args"]
        == (want["spec"]["template"]["spec"]["containers"][0]["args"])
    )
    cm = get(c, "configmap", "gpushare-config", "-n", NS)
    assert 'policy = "weighted"' in cm["data"]["node.toml"]  # kai's, over plain's
    return ds


def assert_selectors_select_the_pods(c: Cluster, ds: dict[str, Any]) -> None:
    """The selectors as the server evaluates them: the Service and the ServiceMonitor
    select by the labels the DaemonSet's pods carry."""
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    sel = ",".join(f"{k}={v}" for k, v in get(c, "service", "gpushare-metrics", "-n", NS)
                   ["spec"]["selector"].items())  # fmt: skip
    assert all(pod_labels.get(k) == v for k, v in
               (kv.split("=") for kv in sel.split(",")))  # fmt: skip
    sm = get(c, "servicemonitor", "gpushare-node", "-n", NS)
    sm_sel = ",".join(f"{k}={v}" for k, v in sm["spec"]["selector"]["matchLabels"].items())
    svcs = get(c, "services", "-n", NS, "-l", sm_sel)["items"]
    assert [s["metadata"]["name"] for s in svcs] == ["gpushare-metrics"]
    port_names = {p["name"] for p in svcs[0]["spec"]["ports"]}
    assert {e["port"] for e in sm["spec"]["endpoints"]} <= port_names


def apply_the_examples(c: Cluster) -> None:
    """3. Workloads, in their own namespace."""
    c.kubectl("create", "namespace", "team-a")
    for ex in EXAMPLES:
        r = c.kubectl("apply", "-n", "team-a", "-f", str(ex), check=False)
        assert r.returncode == 0, f"{ex.name}: {r.stderr}"
    pods = get(c, "pods", "-n", "team-a")["items"]
    assert {p["spec"].get("schedulerName") for p in pods} == {"kai-scheduler"}


def assert_uninstalled(c: Cluster, kai: str) -> None:
    """Uninstall: every object of the overlay goes. (The namespace stays Terminating:
    there is no namespace controller here to empty it.)"""
    c.kubectl("delete", "--wait=false", "-k", kai)
    for kind in ("clusterrole", "clusterrolebinding"):
        r = c.kubectl("get", kind, "gpushare-node", check=False)
        assert r.returncode != 0 and "NotFound" in r.stderr

"""A real Prometheus server (Debian's package) scrapes a running node; the Grafana
dashboard's PromQL parses and names only metrics the exporter emits."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

import gpushare
from gpushare.core.attach import AttachRecord
from gpushare.core.clock import ManualClock
from gpushare.node.daemon import Node
from gpushare.node.host.gpus import simulated_gpus
from gpushare.node.keep.config import NodeConfig
from gpushare.node.observe.metrics import registry_for
from tests.node.observe.test_metrics import free_port
from tests.support import REPO, sim, wait_until

DASHBOARD = REPO / "deploy" / "grafana" / "gpushare.json"
needs_prometheus = pytest.mark.skipif(
    shutil.which("prometheus") is None or shutil.which("promtool") is None,
    reason="Debian's prometheus package is not installed (make test installs it as root)",
)


def dashboard_exprs() -> list[str]:
    d = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in d["panels"] for t in p["targets"]]
    for v in d["templating"]["list"]:
        if v["type"] == "query":
            m = re.fullmatch(r"label_values\((.*),\s*\w+\)", v["query"]["query"])
            assert m, v["query"]
            exprs.append(m.group(1))
    return exprs


def concrete(expr: str) -> str:
    """Grafana's variables as Grafana would fill them with 'All'."""
    out = expr.replace("$__rate_interval", "1m")
    for var in ("$namespace", "$pod", "$name"):
        out = out.replace(var, ".*")
    return out


def exported_names() -> set[str]:
    node = Node(NodeConfig(metrics_port=0), simulated_gpus(1, 2**30), clock=ManualClock())
    node.arbiters[0].attach(1, AttachRecord(name="x", memory_limit=2**20))
    names = set()
    for fam in registry_for(node.status).collect():
        names |= {s.name for s in fam.samples}
    return names


def test_dashboard_names_only_exported_metrics():
    names = exported_names()
    for e in dashboard_exprs():
        for used in re.findall(r"\bgpushare_[a-z_]+", e):
            assert used in names, f"{used} in {e!r} is not exported"


def test_dashboard_has_namespace_and_pod_variables():
    d = json.loads(DASHBOARD.read_text())
    assert {v["name"] for v in d["templating"]["list"]} >= {"namespace", "pod"}
    titles = " ".join(p["title"].lower() for p in d["panels"])
    for word in ("share", "wait", "memory", "swap", "quantum"):
        assert word in titles


@needs_prometheus
def test_dashboard_promql_parses(tmp_path):
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"gpushare:dashboard_{i}", "expr": concrete(e)}
                    for i, e in enumerate(dashboard_exprs())
                ],
            }
        ]
    }
    f = tmp_path / "rules.yml"
    f.write_text(json.dumps(rules))  # JSON is YAML
    r = subprocess.run(["promtool", "check", "rules", str(f)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def _query(port: int, q: str) -> dict:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": q})
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


@pytest.mark.slow
@needs_prometheus
def test_prometheus_scrapes_lease_seconds_by_pod(node_factory, tmp_path, monkeypatch):
    mport, pport = free_port(), free_port()
    # This process, as the kernel would show it inside a pod (a /proc root of our own)
    proc = tmp_path / "proc"
    proc.mkdir()
    uid = "6d3e1f20-1a2b-4c3d-9e8f-0a1b2c3d4e5f"
    slice_ = f"kubepods-burstable-pod{uid.replace('-', '_')}.slice"
    monkeypatch.setenv("POD_UID", uid)
    node = node_factory(
        *sim("16GiB", metrics_port=mport, metrics_address="127.0.0.1", proc_root=proc)
    )
    # and the node beside it in that pod: this process administers it too (status), which
    # the node allows only from the host or its own pod
    cgroup = f"0::/kubepods.slice/kubepods-burstable.slice/{slice_}/cri-containerd-{'ab' * 32}"
    for pid in (os.getpid(), node.proc.pid):
        (proc / str(pid)).mkdir()
        (proc / str(pid) / "cgroup").write_text(cgroup + ".scope\n")
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: gpushare\n    static_configs: [{{targets: ['127.0.0.1:{mport}']}}]\n"
    )
    with open(tmp_path / "prom.log", "wb") as plog:
        prom = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={cfg}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{pport}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=plog,
        )
    monkeypatch.setenv("POD_NAME", "trainer-7")
    monkeypatch.setenv("POD_NAMESPACE", "research")
    try:
        s = gpushare.attach("2GiB", socket=node.socket, name="trainer")
        with s.gpu():
            time.sleep(1.2)  # GPU work: a lease of 1.2 s to be scraped
        held = next(x for x in node.status()["gpus"][0]["sessions"] if x["id"] == s.id)

        def scraped() -> dict | None:  # the whole lease, once Prometheus has scraped it
            try:
                r = _query(pport, 'gpushare_lease_seconds_total{pod="trainer-7"}')
            except OSError:  # not listening yet
                return None
            res = r["data"]["result"]
            if res and float(res[0]["value"][1]) >= held["lease_seconds_total"] - 1e-6:
                return res[0]
            return None

        try:
            value = wait_until(scraped, timeout=60, what="the lease scraped", every=0.5)
        except AssertionError as e:
            raise AssertionError((tmp_path / "prom.log").read_text()[-2000:]) from e
        assert value["metric"]["namespace"] == "research"
        assert float(value["value"][1]) == pytest.approx(held["lease_seconds_total"], abs=1e-6)
        # every dashboard expression runs on the real server
        for e in dashboard_exprs():
            assert _query(pport, concrete(e))["status"] == "success", e
        # the session's series join to its name (issue 16: "session=4" said nothing)
        joined = _query(
            pport,
            "gpushare_lease_seconds_total * on(instance, gpu, session) group_left(name, user)"
            " gpushare_session_info",
        )["data"]["result"]
        assert [(r["metric"]["name"], r["metric"]["pod"]) for r in joined] == [
            ("trainer", "trainer-7")
        ]
        s.close()

        # gone: its session's series go, its workload's totals stay, by name
        def totals() -> list:
            q = 'gpushare_workload_lease_seconds_total{name="trainer"} and on()'
            q += " absent(gpushare_session_info)"
            try:
                return _query(pport, q)["data"]["result"]
            except OSError:
                return []

        try:
            res = wait_until(totals, timeout=60, what="the totals alone", every=0.5)
        except AssertionError as e:
            raise AssertionError((tmp_path / "prom.log").read_text()[-2000:]) from e
        assert float(res[0]["value"][1]) == pytest.approx(held["lease_seconds_total"], abs=0.05)
        assert res[0]["metric"]["pod"] == "trainer-7"
    finally:
        prom.terminate()
        prom.wait(timeout=20)

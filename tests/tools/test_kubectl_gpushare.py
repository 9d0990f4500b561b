"""The kubectl plugin without a server: its tables from a real node's status body, its
arguments checked before any call (the same check as the node's), and its one-line
errors. Against a real API server and real kubectl: tests/cluster/test_gpusharenode.py."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from gpushare.core.attach import AttachRecord
from gpushare.node.daemon import Node
from gpushare.node.host.gpus import simulated_gpus
from gpushare.node.keep.config import load
from gpushare.node.kube.node_status import status_body
from gpushare.tools.kubectl_gpushare import PluginError, age, pod_ref, status_table, top_table
from tests.node.kube.apiserver import api_status, kubeconfig, serving


def obj(name: str, gpus: int, tq: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="gs-") as d:
        cfg = load(None, None, {"socket": f"{d}/w.sock", "admin_socket": f"{d}/a.sock", "tq": tq})
        node = Node(cfg, simulated_gpus(gpus, 8 * 2**30))
        return {"metadata": {"name": name}, "status": status_body(name, node.status(), [], 1, 1e9)}


def test_status_table_has_a_row_per_gpu_of_every_node():
    out = status_table([obj("a", 2, 20.0), obj("b", 1, 5.0)], 1e9 + 3).splitlines()
    assert out[0].split()[:5] == ["NODE", "GPU", "MODEL", "MEMORY", "TQ"]
    rows = [r.split() for r in out[1:]]
    assert [(r[0], r[1]) for r in rows] == [("a", "0"), ("a", "1"), ("b", "0")]
    assert all(r[2] == "[simulated]" for r in rows)
    assert "20s" in rows[0] and "5s" in rows[2] and rows[0][-1] == "3s"  # updated 3 s ago
    empty = status_table([{"metadata": {"name": "c"}}], 0)
    assert "(no status yet)" in empty


def test_top_table_without_sessions_says_so():
    out = top_table([obj("a", 1, 20.0)], 1e9)
    assert out.startswith("a: 1 GPU, TQ 20s, mode auto") and "no sessions" in out


def test_age_and_pod_ref():
    assert age("", 0) == "never" and age("1970-01-01T00:02:00Z", 150) == "30s"
    assert age("1970-01-01T00:00:00Z", 3 * 3600) == "3h"
    assert pod_ref("ns/train") == ("ns", "train") and pod_ref("train") == ("default", "train")
    with pytest.raises(PluginError, match="NAMESPACE/NAME"):
        pod_ref("ns/")


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["tq", "0", "--node", "x"], "TQ must be positive"),
        (["tq", "abc", "--node", "x"], "tq abc"),
        (["mode", "fastest", "--pod", "ns/p"], "mode must be one of auto, exclusive"),
        (["escalation", "nuke", "--node", "x"], "escalation must be one of log, freeze, kill"),
    ],
)
def test_a_bad_value_is_one_line_before_any_call(args, words):
    r = subprocess.run(
        [sys.executable, "-m", "gpushare.tools.kubectl_gpushare", "--kubeconfig", "/nonexistent",
         *args], capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 1 and words in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr


def test_no_kubeconfig_names_the_fix(tmp_path: Path):
    r = subprocess.run(
        [sys.executable, "-m", "gpushare.tools.kubectl_gpushare", "--kubeconfig",
         str(tmp_path / "none"), "status"], capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 1 and "set KUBECONFIG, or --kubeconfig FILE" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


MALFORMED = [
    {"metadata": {"name": "bad"}, "status": {"gpus": [{"index": 0}]}},  # fields missing
    {"metadata": {"name": "worse"}, "status": {"gpus": "all", "sessions": [1]}},  # types
    {"metadata": {}, "status": []},  # no name, a list for a status
]


@pytest.mark.parametrize("bad", MALFORMED)
def test_one_malformed_node_object_hides_no_other_nodes_table(bad):
    out = status_table([obj("a", 1, 20.0), bad, obj("b", 1, 5.0)], 1e9).splitlines()
    assert [r.split()[0] for r in out[1:]] == ["a", bad["metadata"].get("name", "?"), "b"]
    assert "(malformed status" in out[2] or "(no status yet)" in out[2]
    top = top_table([obj("a", 1, 20.0), bad, obj("b", 1, 5.0)], 1e9)
    assert top.startswith("a: 1 GPU") and "\nb: 1 GPU" in top


@pytest.mark.parametrize("interval", ["-1", "nan", "inf", "0", "1e400", "soon"])
def test_a_bad_top_interval_is_one_line_not_a_traceback(interval):
    r = subprocess.run(
        [sys.executable, "-m", "gpushare.tools.kubectl_gpushare", "--kubeconfig", "/nonexistent",
         "top", "--interval", interval], capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert "--interval" in r.stderr and "Traceback" not in r.stderr


@pytest.fixture
def server():
    with serving() as s:
        yield s


def plugin(kubeconfig_file: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpushare.tools.kubectl_gpushare", "--kubeconfig",
         kubeconfig_file, *args], capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("code", "details", "args", "words"),
    [
        # no CRD: the manifests to apply
        (404, {}, ["status"], ["no GPUShareNode kind", "kubectl apply -k"]),
        # a viewer's call refused: the viewer's ClusterRole; a setting's: the editor's
        (403, {}, ["status"], ["forbidden", "ClusterRole gpushare-viewer"]),
        (403, {}, ["tq", "9", "--node", "n"], ["forbidden", "ClusterRole gpushare-viewer"]),
        (401, {}, ["top", "--once"], ["unauthorized", "your kubeconfig's credentials"]),
        (429, {}, ["status"], ["throttling", "try again in 5 s"]),
        # a pod that is not there: where to look
        (404, {"name": "p", "kind": "pods"}, ["tq", "9", "--pod", "ns/p"],
         ["no pod p in namespace ns", "kubectl get pods -n ns"]),
    ],
)  # fmt: skip
def test_the_api_refusing_is_one_line_naming_the_fix(server, tmp_path, code, details, args, words):
    answer, port = server
    answer.status, answer.body = code, api_status(code, "said so", details)
    answer.headers = {"Retry-After": "5"} if code == 429 else {}
    r = plugin(kubeconfig(tmp_path, port), *args)
    assert r.returncode == 1 and len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith("kubectl gpushare: ") and "Traceback" not in r.stderr
    for w in words:
        assert w in r.stderr, r.stderr


def test_a_server_not_there_says_check_cluster_info(tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = plugin(kubeconfig(tmp_path, port), "status")
    assert r.returncode == 1 and len(r.stderr.splitlines()) == 1, r.stderr
    assert "cannot reach the API server" in r.stderr and "kubectl cluster-info" in r.stderr


def test_top_shows_each_sessions_memory_request_beside_its_limit():
    with tempfile.TemporaryDirectory(prefix="gs-") as d:
        cfg = load(None, None, {"socket": f"{d}/w.sock", "admin_socket": f"{d}/a.sock"})
        node = Node(cfg, simulated_gpus(1, 8 * 2**30))
        node.arbiters[0].attach(
            1, AttachRecord(name="lends", memory_limit=4 * 2**30, memory_request=2**30)
        )
        o = {"metadata": {"name": "a"}, "status": status_body("a", node.status(), [], 1, 1e9)}

    def cells() -> dict[str, str]:
        head, row = top_table([o], 1e9).split("\n\n", 1)[1].splitlines()
        return dict(zip(head.split(), re.split(r" {3,}", row), strict=True))

    row = cells()
    assert (row["REQUEST"], row["LIMIT"]) == ("1.0 GiB", "4.0 GiB"), row
    # a node's object from before the request was published: "-", not a malformed row
    del o["status"]["sessions"][0]["memoryRequest"]
    assert (cells()["REQUEST"], cells()["LIMIT"]) == ("-", "4.0 GiB")

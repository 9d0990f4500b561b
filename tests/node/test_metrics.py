"""The exporter's names, types, labels and values, and utilization attribution."""

from __future__ import annotations

import json
import socket
import time
import types
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpushare.core.attribution import Attribution
from gpushare.core.clock import ManualClock
from gpushare.node.config import NodeConfig
from gpushare.node.daemon import Node
from gpushare.node.gpus import simulated_gpus
from gpushare.node.metrics import registry_for
from gpushare.node.utilization import NvmlUtilization
from gpushare.status import to_json_object
from tests.support import sim

G = 2**30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def scripted():
    """A node (not serving) driven through a scenario on a manual clock."""
    clock = ManualClock()
    node = Node(NodeConfig(metrics_port=0), simulated_gpus(1, 80 * G), clock=clock)
    a = node.arbiters[0]
    a.configure(tq_s=10, mode="exclusive")
    a.attach(1, name="train", limit=50 * G)
    a.attach(2, name="infer", limit=50 * G)
    a.acquire(1)
    a.report(1, resident=50 * G, swapped=0)
    clock.advance(1.0)
    a.acquire(2)
    clock.advance(9.0)
    a.tick()  # quantum over: revoke 1, whose revoke asks 20 GiB out
    a.release(1, resident=30 * G, swapped=20 * G, again=False, swapped_out=20 * G, seconds=0.4)
    clock.advance(0.5)
    node.utilization[0].credit(0.8, 10.0, [1])
    return node, registry_for(node.status)


def test_session_series_names_types_and_values(scripted):
    node, reg = scripted
    labels = {
        "gpu": "0",
        "gpu_uuid": node.gpus[0].uuid,
        "namespace": "",
        "pod": "",
        "container": "",
        "session": "1",
    }
    v = reg.get_sample_value
    assert v("gpushare_lease_seconds_total", labels) == pytest.approx(10.0)
    assert v("gpushare_grants_total", labels) == 1
    assert v("gpushare_revokes_total", labels) == 1
    assert v("gpushare_swap_bytes_total", {**labels, "direction": "out"}) == 20 * G
    assert v("gpushare_swap_seconds_total", {**labels, "direction": "out"}) == pytest.approx(0.4)
    assert v("gpushare_resident_bytes", labels) == 30 * G
    assert v("gpushare_swapped_bytes", labels) == 20 * G
    assert v("gpushare_memory_limit_bytes", labels) == 50 * G
    assert v("gpushare_utilization_seconds_total", labels) == pytest.approx(8.0)
    two = {**labels, "session": "2"}
    # session 2 waited 9 s, then was granted: one observation in the 10 s bucket
    assert v("gpushare_wait_seconds_count", two) == 1
    assert v("gpushare_wait_seconds_sum", two) == pytest.approx(9.0)
    assert v("gpushare_wait_seconds_bucket", {**two, "le": "5.0"}) == 0
    assert v("gpushare_wait_seconds_bucket", {**two, "le": "10.0"}) == 1
    assert v("gpushare_session_state", {**two, "state": "holding"}) == 1


def test_gpu_series_carry_the_simulated_label(scripted):
    node, reg = scripted
    gl = {"gpu": "0", "gpu_uuid": node.gpus[0].uuid, "simulated": "true"}
    v = reg.get_sample_value
    assert v("gpushare_gpu_info", {**gl, "name": node.gpus[0].name}) == 1
    assert v("gpushare_tq_seconds", gl) == 10
    assert v("gpushare_mode", {**gl, "mode": "exclusive"}) == 1
    assert v("gpushare_mode", {**gl, "mode": "auto"}) == 0
    assert v("gpushare_gpu_memory_bytes", gl) == 80 * G
    assert v("gpushare_sessions", {**gl, "state": "holding"}) == 1
    assert v("gpushare_sessions", {**gl, "state": "idle"}) == 1
    assert (
        v(
            "gpushare_build_info",
            {"version": "0.1.0", "python": __import__("platform").python_version()},
        )
        == 1
    )


def test_conventions_hold_for_every_family(scripted):
    _, reg = scripted
    for fam in reg.collect():
        assert fam.name.startswith("gpushare_")
        for smp in fam.samples:
            assert "pid" not in smp.labels
            if fam.type == "counter" and smp.name.endswith(("_total", "_created")):
                continue
            assert fam.type != "counter", smp.name
        if "ratio" in fam.name:
            assert all(0 <= s.value <= 1 for s in fam.samples)


def test_live_node_serves_metrics_over_http(node_factory):
    port = free_port()
    node = node_factory(
        *sim(
            "10GiB",
            mode="exclusive",
            tq="0.3",
            metrics_port=str(port),
            metrics_address="127.0.0.1",
            sim_bandwidth="1e12",
        )
    )
    env = {"POD_NAME": "trainer-0", "POD_NAMESPACE": "ml", "CONTAINER_NAME": "main"}
    import os

    procs = [
        node.workload(
            "batch",
            "--memory",
            "6GiB",
            "--seconds",
            "2",
            "--name",
            f"b{i}",
            env={**os.environ, **env, "POD_NAME": f"trainer-{i}"},
        )
        for i in range(2)
    ]
    time.sleep(1.5)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for pr in procs:
        pr.communicate(timeout=30)
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert fams["gpushare_lease_seconds"].type == "counter"
    assert fams["gpushare_wait_seconds"].type == "histogram"
    assert fams["gpushare_resident_bytes"].type == "gauge"
    # These processes claim pods but the kernel puts them in none: no pod labels
    assert {s.labels["pod"] for s in fams["gpushare_lease_seconds"].samples} == {""}
    assert sum(s.value for s in fams["gpushare_lease_seconds"].samples) > 0.5
    swapped = [
        s.value
        for s in fams["gpushare_swap_bytes"].samples
        if s.labels["direction"] == "out" and s.name.endswith("_total")
    ]
    assert sum(swapped) > 0  # 12 GiB on a 10 GiB GPU: they swapped


def test_exclusive_sample_goes_to_the_holder():
    a = Attribution()
    a.credit(0.5, 2.0, [7])
    assert a.by_session == {7: 1.0} and a.shared == 0 and a.last_ratio == 0.5


def test_shared_period_uses_per_process_samples_and_marks_the_rest_shared():
    a = Attribution()
    a.credit(0.9, 1.0, [1, 2], per_process={100: 0.5, 200: 0.3}, pid_of={1: 100, 2: 200})
    assert a.by_session == pytest.approx({1: 0.5, 2: 0.3})
    assert a.shared == pytest.approx(0.1)
    b = Attribution()
    b.credit(0.9, 1.0, [1, 2])  # no per-process samples: all shared, none guessed
    assert b.by_session == {} and b.shared == pytest.approx(0.9)


def test_idle_gpu_credits_no_one():
    a = Attribution()
    a.credit(0.3, 1.0, [])
    assert a.by_session == {} and a.shared == 0


def test_nvml_sampler_reads_device_and_process_utilization():
    class NotSupported(Exception):
        pass

    calls = []

    def proc_util(handle, since):
        calls.append(since)
        if len(calls) > 1:
            raise NotSupported("Not Supported")
        return [
            types.SimpleNamespace(pid=100, smUtil=40, timeStamp=5),
            types.SimpleNamespace(pid=200, smUtil=30, timeStamp=9),
        ]

    nvml = types.SimpleNamespace(
        nvmlDeviceGetHandleByIndex=lambda i: f"h{i}",
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=75, memory=10),
        nvmlDeviceGetProcessUtilization=proc_util,
    )
    s = NvmlUtilization(nvml, 0)
    assert s.device() == 0.75
    assert s.processes() == {100: 0.4, 200: 0.3}
    assert s.processes() == {}  # unsupported: no samples, no error
    assert calls == [0, 9]  # asks only for samples newer than the last seen


def test_status_json_carries_the_figures_metrics_need(scripted):
    node, _ = scripted
    st = json.loads(json.dumps(to_json_object(node.status())))
    g = st["gpus"][0]
    assert g["utilization_ratio"] == 0.8
    s = {x["id"]: x for x in g["sessions"]}
    assert s[2]["wait_seconds_p95"] == pytest.approx(9.0)

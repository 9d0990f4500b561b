"""The exporter's names, types, labels and values, and utilization attribution."""

from __future__ import annotations

import asyncio
import json
import socket
import types
import urllib.request

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpushare import protocol as p
from gpushare.core.attach import AttachRecord
from gpushare.core.attribution import Attribution
from gpushare.core.clock import ManualClock
from gpushare.node.daemon import Node
from gpushare.node.host.gpus import simulated_gpus
from gpushare.node.keep.config import NodeConfig
from gpushare.node.observe.metrics import registry_for
from gpushare.node.observe.utilization import NvmlUtilization
from gpushare.status import SessionStatus, to_json_object
from tests.node.harness import in_process
from tests.support import sim, wait_until

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
    a.set_config({"tq_s": 10, "mode": "exclusive"})
    a.attach(1, AttachRecord(name="train", memory_limit=50 * G))
    a.attach(2, AttachRecord(name="infer", memory_limit=50 * G))
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

    # They run until the exporter has shown both their turns (however slow the machine
    # is to start them), then are stopped.
    procs = [
        node.workload(
            "batch",
            "--memory",
            "6GiB",
            "--seconds",
            "60",
            "--name",
            f"b{i}",
            env={**os.environ, **env, "POD_NAME": f"trainer-{i}"},
        )
        for i in range(2)
    ]

    def scraped() -> dict | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                text = r.read().decode()
        except OSError:
            return None
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        leases = fams.get("gpushare_lease_seconds")
        done = leases and sum(s.value for s in leases.samples) > 0.5 and swapped_out(fams)
        return fams if done else None

    try:
        fams = wait_until(scraped, timeout=60, what="0.5 s of lease and a swap, scraped")
    finally:
        for pr in procs:
            pr.terminate()
            pr.communicate(timeout=30)
    assert fams["gpushare_lease_seconds"].type == "counter"
    assert fams["gpushare_wait_seconds"].type == "histogram"
    assert fams["gpushare_resident_bytes"].type == "gauge"
    # These processes claim pods but the kernel puts them in none: no pod labels
    assert {s.labels["pod"] for s in fams["gpushare_lease_seconds"].samples} == {""}
    assert sum(s.value for s in fams["gpushare_lease_seconds"].samples) > 0.5
    assert swapped_out(fams) > 0  # 12 GiB on a 10 GiB GPU: they swapped


def swapped_out(fams: dict) -> float:
    if "gpushare_swap_bytes" not in fams:
        return 0.0
    return sum(
        s.value
        for s in fams["gpushare_swap_bytes"].samples
        if s.labels["direction"] == "out" and s.name.endswith("_total")
    )


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


def test_each_session_has_an_info_series_with_its_name_and_user(scripted):
    node, reg = scripted
    import pwd

    user = pwd.getpwuid(0).pw_name  # the scripted sessions have no connection: uid 0
    base = {"gpu": "0", "gpu_uuid": node.gpus[0].uuid, "namespace": "", "pod": ""}
    base["container"] = ""
    v = reg.get_sample_value
    assert v("gpushare_session_info", {**base, "session": "1", "name": "train", "user": user}) == 1
    assert v("gpushare_session_info", {**base, "session": "2", "name": "infer", "user": user}) == 1
    info = [s for f in reg.collect() for s in f.samples if s.name == "gpushare_session_info"]
    assert len(info) == 2 and all("pid" not in s.labels for s in info)
    # every per-session series joins to exactly one info series on (gpu, session)
    keys = {(s.labels["gpu"], s.labels["session"]) for s in info}
    for fam in reg.collect():
        for smp in fam.samples:
            if "session" in smp.labels:
                assert (smp.labels["gpu"], smp.labels["session"]) in keys, smp.name


@in_process(mode="exclusive", tq=5)
async def test_a_workloads_totals_outlive_its_sessions(node):
    # Two short jobs named "job" one after the other, and a "train" still attached: the
    # jobs' series are gone with their sessions, their totals by name are not.
    train = await node.workload(memory_limit=G, name="train")
    for _ in range(2):
        w = await node.workload(memory_limit=G, name="job")
        await w.send(p.Acquire())
        await w.expect(p.Grant)
        await asyncio.sleep(2)  # virtual time: a lease of 2 s
        w.close()
        await node.until(lambda w=w: w.session not in node.node.conns)
    st = node.node.status()
    assert [s.name for s in st.gpus[0].sessions] == ["train"]
    by_name = {w.name: w for w in st.gpus[0].workloads}
    job = by_name["job"]
    assert (job.sessions, job.sessions_total, job.grants_total) == (0, 2, 2)
    assert job.lease_seconds_total == pytest.approx(4.0, abs=0.01)
    assert (by_name["train"].sessions, by_name["train"].sessions_total) == (1, 1)
    reg = registry_for(node.node.status)
    wl = {"gpu": "0", "gpu_uuid": node.node.gpus[0].uuid, "namespace": "", "pod": ""}
    wl |= {"container": "", "name": "job"}
    v = reg.get_sample_value
    assert v("gpushare_workload_lease_seconds_total", wl) == pytest.approx(4.0, abs=0.01)
    assert v("gpushare_workload_sessions_total", wl) == 2
    assert v("gpushare_workload_grants_total", wl) == 2
    assert v("gpushare_workload_swap_bytes_total", {**wl, "direction": "out"}) == 0
    assert v("gpushare_lease_seconds_total", {**wl, "session": "2"}) is None  # gone
    # the status JSON carries the same totals
    assert to_json_object(st)["gpus"][0]["workloads"][0]["name"] == "job"
    train.close()


def test_workload_totals_are_bounded():
    from gpushare.node.keep.totals import Totals

    t = Totals(limit=3)
    for i in range(5):
        s = msgspec.convert(
            {**_session_fields(), "name": f"job-{i}", "grants_total": 1}, SessionStatus
        )
        t.retire(s)
    assert [w.name for w in t.workloads([])] == ["job-2", "job-3", "job-4"]


def _session_fields() -> dict:
    fields = {}
    for f in msgspec.structs.fields(SessionStatus):
        t = f.type
        fields[f.name] = (
            0
            if t in (int, float)
            else ""
            if t is str
            else False
            if t is bool
            else []
            if getattr(t, "__origin__", None) is list
            else {}
        )
    return fields


def test_the_ranks_of_a_job_carry_their_gang_and_rank_and_the_gang_its_regroups():
    clock = ManualClock()
    node = Node(NodeConfig(metrics_port=0), simulated_gpus(1, 80 * G), clock=clock)
    a = node.arbiters[0]
    a.set_config({"tq_s": 1, "mode": "exclusive"})
    for sid, job in ((1, "job7@uid:1000"), (2, "job7@uid:1000"), (3, "")):
        a.attach(
            sid,
            AttachRecord(name=f"s{sid}", memory_limit=10 * G, gang=job, gang_size=2 if job else 0),
        )
        a.acquire(sid)
    clock.advance(1)
    a.tick()  # the gang is revoked; rank 1 parks, rank 2 is blocked in a collective
    a.release(1, resident=0, swapped=0, again=True)
    clock.set(a.next_deadline())
    a.tick()  # the regroup: rank 1 goes on to its next safe point
    reg = registry_for(node.status)
    gang = [s for f in reg.collect() for s in f.samples if s.name == "gpushare_session_gang_info"]
    assert sorted((s.labels["session"], s.labels["gang"], s.value) for s in gang) == [
        ("1", "job7@uid:1000", 1.0),
        ("2", "job7@uid:1000", 1.0),
    ]  # the solo session has none
    assert {s.labels["rank"] for s in gang} == {"-1"}  # no client said its rank here
    base = {"gpu": "0", "gpu_uuid": node.gpus[0].uuid, "simulated": "true", "gang": "job7@uid:1000"}
    assert reg.get_sample_value("gpushare_gang_regroups_total", base) == 1

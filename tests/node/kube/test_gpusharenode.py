"""The node's GPUShareNode without an API server: the spec read and checked by the one
validation, the status' body from a real node's snapshot, and :class:`NodeObject` on a
real node (in this process, on a real loop) against an API double that records what the
node would send: the spec applied through the admin path, a bad one refused and the
settings kept, the write rate bounded under a burst, a missing CRD said once.
The same against a real kube-apiserver: tests/cluster/test_gpusharenode.py."""

from __future__ import annotations

import asyncio
import logging
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpushare import protocol as p
from gpushare.core.attach import AttachRecord
from gpushare.node.daemon import Node
from gpushare.node.host.gpus import simulated_gpus
from gpushare.node.keep.config import load
from gpushare.node.kube.gpusharenode import NodeObject
from gpushare.node.kube.node_api import Absent
from gpushare.node.kube.node_status import desired, shape, status_body
from gpushare.settings import SettingsError
from tests.support import REPO

G = 2**30


def test_spec_reads_node_wide_then_per_gpu_values():
    got = desired({"tq": 20, "mode": "exclusive", "gpu": {"1": {"tq": 5, "policy": "weighted"}}}, 2)
    assert got == [
        {"tq_s": 20.0, "mode": "exclusive"},
        {"tq_s": 5.0, "mode": "exclusive", "policy": "weighted"},
    ]
    assert desired({}, 3) == [{}, {}, {}] and desired(None, 1) == [{}]


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ({"tq": -1}, ["spec: TQ must be positive", "not -1"]),
        ({"tq": 1e9}, ["spec: TQ must be", "86400"]),
        ({"mode": "fastest"}, ["spec: mode must be one of auto, exclusive"]),
        ({"gpu": {"1": {"escalation": "nuke"}}}, ["spec.gpu.1: escalation must be one of"]),
        ({"gpu": {"4": {"tq": 3}}}, ["spec.gpu.4: no GPU 4 on this node (it has 2: 0..1)"]),
        ({"gpu": {"x": {"tq": 3}}}, ["spec.gpu.x: not a GPU index"]),
        ({"tqs": 3}, ["spec.tqs: not a setting"]),
        ({"gpu": {"0": {"grace": 3}}}, ["spec.gpu.0.grace: not a setting"]),
        ({"tq": True}, ["spec: TQ must be"]),
    ],
)
def test_a_bad_spec_is_refused_naming_its_field(spec, words):
    with pytest.raises(SettingsError) as e:
        desired(spec, 2)
    assert all(w in str(e.value) for w in words), str(e.value)


class FakeApi:
    """What the node would send to the API, recorded; ``absent`` plays a server without
    the CRD."""

    def __init__(self, spec: dict[str, Any] | None = None, absent: bool = False) -> None:
        self.obj: dict[str, Any] | None = None
        self.spec = spec
        self.absent = absent
        self.writes: list[dict[str, Any]] = []
        self.events: list[tuple[str, Mapping[str, Any]]] = []
        self.gets = 0

    def get(self, name: str) -> dict[str, Any] | None:
        self.gets += 1
        if self.absent:
            raise Absent("the API server has no GPUShareNode kind (the CRD ...)")
        if self.obj is None and self.spec is not None:
            self.obj = {"metadata": {"name": name, "uid": "u1", "generation": 1}, "spec": self.spec}
        return self.obj

    def create(self, name: str) -> dict[str, Any]:
        self.made = getattr(self, "made", 0) + 1
        uid = f"u{self.made}"
        self.obj = {"metadata": {"name": name, "uid": uid, "generation": 1}, "spec": {}}
        return self.obj

    def patch_status(self, name: str, status: Mapping[str, Any]) -> dict[str, Any]:
        if self.obj is None:
            raise LookupError(name)  # deleted (kubectl delete gsn)
        self.writes.append(dict(status))
        return {}

    def event(self, namespace: str, body: Mapping[str, Any]) -> None:
        self.events.append((namespace, body))

    def watch(self, name: str) -> Iterator[tuple[str, dict[str, Any]]]:
        return iter(())  # the test hands the changes to on_object itself

    def edit(self, o: NodeObject, spec: dict[str, Any]) -> None:
        """The spec edited (as kubectl patch would): a new generation, seen by the node."""
        assert self.obj is not None
        meta = self.obj["metadata"]
        self.obj = {"metadata": {**meta, "generation": meta["generation"] + 1}, "spec": spec}
        o.on_object(self.obj)


def make_node(d: Path, gpus: int = 2) -> Node:
    cfg = load(None, None, {"socket": str(d / "w.sock"), "admin_socket": str(d / "a.sock"),
                            "tq": 30.0})  # fmt: skip
    return Node(cfg, simulated_gpus(gpus, 16 * G))


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 60))


@pytest.fixture
def folder() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="gs-") as d:
        yield Path(d)


def test_status_body_from_a_real_nodes_snapshot(folder):
    node = make_node(folder)
    body = status_body("gpu-1", node.status(), [], 3, 1.7e9)
    assert body["node"] == "gpu-1" and body["observedGeneration"] == 3
    assert body["updated"].endswith("Z")
    s = body["summary"]
    assert s["gpus"] == 2 and s["tq"] == "30s" and s["mode"] == "auto" and s["simulated"]
    assert s["holders"] == 0 and s["waiting"] == 0 and s["swapped"].startswith("0")
    assert [g["index"] for g in body["gpus"]] == [0, 1]
    assert body["gpus"][0]["memoryBytes"] == 16 * G and body["gpus"][0]["simulated"] is True
    node.arbiters[1].set_config({"tq_s": 5.0})
    other = status_body("gpu-1", node.status(), [], 3, 1.7e9 + 5)
    assert other["summary"]["tq"] == "30s,5s"
    assert shape(other) != shape(body)
    # the figures alone (the time written) do not change the shape
    assert shape(status_body("gpu-1", node.status(), [], 3, 1.7e9 + 9)) == shape(other)


async def _with_object(node: Node, api: FakeApi, **kw: Any) -> NodeObject:
    o = NodeObject(
        "gpu-1",
        arbiters=node.arbiters,
        status=node.status,
        set_config=node.admin.set_config,
        refused=node.live.refused,
        events=node.events,
        api=lambda: api,
        **kw,
    ).start()
    return o


async def until(pred: Any, timeout: float = 20.0) -> None:
    async with asyncio.timeout(timeout):
        while not pred():
            await asyncio.sleep(0.01)  # a look every 10 ms, the object's loop running


def test_spec_applies_through_the_admin_path_and_a_bad_one_is_refused(folder):
    node = make_node(folder)

    async def body() -> None:
        api = FakeApi(spec={"tq": 20, "gpu": {"1": {"mode": "exclusive"}}})
        o = await _with_object(node, api, min_interval=0.05)
        await until(lambda: api.writes)
        assert [a.settings.tq_s for a in node.arbiters] == [20.0, 20.0]
        assert [a.settings.mode for a in node.arbiters] == ["auto", "exclusive"]
        cond = api.writes[-1]["conditions"][0]
        assert cond["type"] == "SettingsApplied" and cond["status"] == "True"
        assert [e["gpu"] for e in node.events.select() if e["event"] == "config"] == [0, 1]
        # a bad value: refused whole (TQ 7 would be fine: it is not applied either)
        api.edit(o, {"tq": 7, "mode": "x"})
        await until(lambda: api.writes[-1]["conditions"][0]["status"] == "False")
        c = api.writes[-1]["conditions"][0]
        assert c["reason"] == "Refused" and "mode must be one of" in c["message"]
        assert c["observedGeneration"] == 2
        assert [a.settings.tq_s for a in node.arbiters] == [20.0, 20.0]  # kept
        refusals = [e for e in node.events.select() if e["event"] == "config_refused"]
        assert len(refusals) == 1 and refusals[0]["source"] == "GPUShareNode gpu-1"
        await until(lambda: any(b["reason"] == "SettingsRefused" for _, b in api.events))
        ns, ev = next((n, b) for n, b in api.events if b["reason"] == "SettingsRefused")
        assert ev["type"] == "Warning" and ev["involvedObject"]["kind"] == "GPUShareNode"
        assert ev["involvedObject"]["uid"] == "u1" and "mode must be" in ev["message"]
        assert ns == "default"  # as a Node's: a cluster-scoped object's Events
        # what stays in force is the last spec that held: still set back after a ctl change
        node.admin.set_config(p.SetConfig(tq_s=3.0))
        await until(lambda: [a.settings.tq_s for a in node.arbiters] == [20.0, 20.0])
        # the spec wins over a change made another way (ctl), once it holds again
        api.edit(o, {"tq": 12})
        await until(lambda: node.arbiters[0].settings.tq_s == 12.0)
        node.admin.set_config(p.SetConfig(tq_s=3.0))
        await until(lambda: [a.settings.tq_s for a in node.arbiters] == [12.0, 12.0])
        await o.stop()

    run(body())


def test_writes_are_bounded_under_a_burst_of_changes(folder):
    node = make_node(folder, gpus=1)

    async def body() -> None:
        api = FakeApi()
        o = await _with_object(node, api, min_interval=0.2, refresh=10.0, heartbeat=60.0)
        await until(lambda: api.writes)
        start, loop = len(api.writes), asyncio.get_running_loop()
        t0 = loop.time()
        for i in range(200):  # 200 changes of settings in about 2 s
            node.admin.set_config(p.SetConfig(tq_s=1.0 + i % 7))
            await asyncio.sleep(0.01)  # the burst's pace: 200 changes in about 2 s
        # the last change written (not a fixed 0.5 s, which a busy machine may not keep)
        await until(lambda: api.writes[-1]["gpus"][0]["tq"] == node.arbiters[0].settings.tq_s)
        seconds = loop.time() - t0
        writes = len(api.writes) - start
        assert 1 <= writes <= seconds / 0.2 + 2, (writes, seconds)
        assert api.writes[-1]["gpus"][0]["tq"] == node.arbiters[0].settings.tq_s  # the last
        # and nothing changing: nothing written (before the refresh period)
        quiet = len(api.writes)
        await asyncio.sleep(1.0)  # a quiet second (five min_intervals): nothing to write
        assert len(api.writes) == quiet
        await o.stop()

    run(body())


def test_without_the_crd_the_node_says_so_once_and_runs_on(folder, caplog):
    caplog.set_level(logging.INFO, logger="gpushare")
    node = make_node(folder, gpus=1)

    async def body() -> None:
        api = FakeApi(absent=True)
        o = await _with_object(node, api, min_interval=0.05, absent_retry=0.1)
        await until(lambda: api.gets >= 3)
        assert not api.writes
        said = [r for r in caplog.records if "no GPUShareNode kind" in r.getMessage()]
        assert len(said) == 1 and said[0].levelno == logging.WARNING
        assert "the node runs on without it" in said[0].getMessage()
        reply = node.admin.set_config(p.SetConfig(tq_s=4.0))  # the node works as before
        assert isinstance(reply, p.ConfigReply) and node.arbiters[0].settings.tq_s == 4.0
        api.absent = False  # the CRD installed meanwhile: it publishes from then on
        await until(lambda: api.writes)
        assert api.writes[-1]["gpus"][0]["tq"] == 4.0
        await o.stop()

    run(body())


def test_a_deleted_object_is_made_again_and_its_old_spec_let_go(folder):
    node = make_node(folder, gpus=1)

    async def body() -> None:
        api = FakeApi()
        o = await _with_object(node, api, min_interval=0.05)
        await until(lambda: api.writes)
        for _ in range(3):
            api.edit(o, {"tq": 9})  # generation 4
        await until(lambda: node.arbiters[0].settings.tq_s == 9.0)
        api.obj = None  # kubectl delete gsn: the next write finds it gone
        node.admin.set_config(p.SetConfig(mode="exclusive"))
        await until(lambda: getattr(api, "made", 0) == 2 and api.writes[-1]["pid"])
        await until(lambda: api.writes[-1]["gpus"][0]["mode"] == "exclusive")
        assert o.uid == "u2" and o.generation == 1 and o.desired == [{}]
        node.admin.set_config(p.SetConfig(tq_s=4.0))  # the old spec (tq 9) no longer holds
        # written as it is: the object has looked since, and an old spec held would have
        # set TQ 9 back instead (not a fixed 0.3 s, which a busy machine may not keep)
        await until(lambda: api.writes[-1]["gpus"][0]["tq"] == 4.0)
        assert node.arbiters[0].settings.tq_s == 4.0
        await o.stop()

    run(body())


def sessions_schema() -> dict[str, Any]:
    """The CRD's schema of ``status.sessions[]``, as deploy/kubernetes/base/crd.yaml says."""
    crd = yaml.safe_load((REPO / "deploy/kubernetes/base/crd.yaml").read_text())
    (version,) = crd["spec"]["versions"]
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]
    items: dict[str, Any] = status["properties"]["sessions"]["items"]
    return items["properties"]


def test_a_sessions_memory_request_is_published_apart_from_its_limit(folder):
    node = make_node(folder)
    node.arbiters[0].attach(1, AttachRecord(name="lends", memory_limit=4 * G, memory_request=G))
    node.arbiters[1].attach(2, AttachRecord(name="whole", memory_limit=2 * G))  # none given
    body = status_body("gpu-1", node.status(), [], 1, 1.7e9)
    by_name = {s["name"]: s for s in body["sessions"]}
    lends, whole = by_name["lends"], by_name["whole"]
    assert (lends["memoryRequestBytes"], lends["memoryLimitBytes"]) == (G, 4 * G)
    assert (lends["memoryRequest"], lends["memoryLimit"]) == ("1.0 GiB", "4.0 GiB")
    assert whole["memoryRequestBytes"] == whole["memoryLimitBytes"] == 2 * G  # its limit
    # a request changed (a member joined) is the shape: written at once, not at refresh
    assert "memoryRequestBytes" in shape(body)


def test_the_crd_declares_every_session_field_the_node_writes_with_its_type(folder):
    """The API server prunes or refuses what the schema types otherwise: each field of a
    published session (a fraction's too) is declared, with the type its value has."""
    node = make_node(folder)
    node.arbiters[0].attach(1, AttachRecord(name="a", memory_limit=4 * G, memory_request=G))
    (entry,) = status_body("gpu-1", node.status(), [], 1, 1.7e9)["sessions"]
    entry = {**entry, "fraction": 0.5, "fractionSource": "kubernetes", "podUID": "u"}
    schema = sessions_schema()
    types = {bool: "boolean", int: "integer", float: "number", str: "string"}
    for key, value in entry.items():
        assert key in schema, f"status.sessions[].{key} is not in the CRD"
        assert schema[key]["type"] == types[type(value)], key
    assert "request" in schema["memoryRequestBytes"]["description"]

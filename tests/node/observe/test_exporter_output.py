"""The exporter's text, written by gpushare, against the exporter it replaced
(prometheus_client's families and ``generate_latest``, kept in
``tests/node/observe/exporter_before.py``): for each snapshot, every family that one had is
there with the same help, type, series, labels and values, byte for byte, also when a
scrape reuses the lines of sessions that did not change since the last one."""

from __future__ import annotations

import gzip
import math
import os
import random
import threading
import urllib.error
import urllib.request

import msgspec
import pytest
from prometheus_client import generate_latest
from prometheus_client.utils import floatToGoString

from gpushare.core.attach import AttachRecord
from gpushare.core.clock import ManualClock
from gpushare.node.daemon import Node
from gpushare.node.host.gpus import simulated_gpus
from gpushare.node.keep.config import NodeConfig
from gpushare.node.observe.metric_tables import _SESSIONS, value
from gpushare.node.observe.metrics import Exposition
from gpushare.node.observe.metrics_http import CONTENT_TYPE, bind, serve_on
from gpushare.status import NodeStatus, SessionStatus, WorkloadStatus
from tests.node.observe import exporter_before

G = 2**30


def families(text: bytes) -> dict[str, str]:
    """The text's families by name: each one's HELP, TYPE and sample lines."""
    out: dict[str, str] = {}
    name = ""
    for line in text.decode().splitlines(keepends=True):
        if line.startswith("# HELP "):
            name = line.split()[2]
            out[name] = ""
        out[name] += line
    return out


def check_against_before(exp: Exposition, st: NodeStatus) -> None:
    before = families(generate_latest(exporter_before.registry_for(lambda: st)))
    now = families(exp.render(st))
    assert before, "the reference wrote nothing"
    for name, block in before.items():
        assert now.get(name) == block, name


def scripted_node() -> tuple[Node, ManualClock]:
    """Two GPUs, sessions in every state, swaps, waits in several buckets, utilization."""
    clock = ManualClock()
    node = Node(NodeConfig(metrics_port=0), simulated_gpus(2, 80 * G), clock=clock)
    a, b = node.arbiters
    a.set_config({"tq_s": 10, "mode": "exclusive"})
    b.set_config({"policy": "weighted"})
    for sid in range(1, 5):
        a.attach(sid, AttachRecord(name=f"s{sid}", memory_limit=30 * G, weight=0.25 * sid))
    b.attach(7, AttachRecord(name="other", memory_limit=int(1.5 * G), weight=0.5))
    a.acquire(1)
    a.report(1, resident=30 * G, swapped=0)
    clock.advance(0.0004)
    a.acquire(2)
    a.acquire(3)
    clock.advance(10.0)
    a.tick()  # 1 revoked
    a.release(1, resident=10 * G, swapped=20 * G, swapped_out=20 * G, seconds=0.37, again=True)
    clock.advance(2.5)
    a.swap_done(2, direction="in", nbytes=3 * G, seconds=0.1234, resident=3 * G, swapped=0)
    b.acquire(7)
    clock.advance(123.456789)
    node.utilization[0].credit(0.8, 10.0, [2])
    node.utilization[1].credit(0.3, 1.0, [7, 8])
    return node, clock


def odd(st: NodeStatus, rng: random.Random) -> NodeStatus:
    """The snapshot with label values and figures a scrape must write exactly: quotes,
    backslashes, newlines and non-ASCII in names; large, tiny and odd numbers."""
    names = ['ml"team', "a\\b", "line\nbreak", "ünïcode", "", "plain-pod-0"]
    gpus = []
    for g in st.gpus:
        sessions = [
            msgspec.structs.replace(
                s,
                name=rng.choice(names),
                uid=rng.choice([0, os.getuid(), 987654]),  # 987654: no such user
                pod=rng.choice(names),
                namespace=rng.choice(names),
                container=rng.choice(names),
                lease_seconds_total=rng.choice([0.0, 1e-9, 12345678.9, 1e22, 0.1 + 0.2]),
                resident_bytes=rng.choice([0, 999_999, 1_000_000, 80 * G, 2**60]),
                utilization_seconds_total=rng.choice([math.inf, 2.5e-7, 7.0]),
            )
            for s in g.sessions
        ]
        workloads = [
            msgspec.structs.replace(
                w,
                name=rng.choice(names),
                pod=rng.choice(names),
                lease_seconds_total=rng.choice([0.0, 12345678.9, 1e22]),
                swap_in_bytes_total=rng.choice([0, 2**60]),
            )
            for w in g.workloads
        ]
        workloads.append(WorkloadStatus(name=rng.choice(names), sessions_total=rng.randrange(9)))
        gpus.append(
            msgspec.structs.replace(
                g, name=rng.choice(names), sessions=sessions, workloads=workloads
            )
        )
    return msgspec.structs.replace(st, gpus=gpus)


def test_the_text_is_the_one_it_replaced_for_each_snapshot():
    node, clock = scripted_node()
    rng = random.Random(7)
    exp = Exposition()  # one, as in the node: later scrapes reuse unchanged sessions
    check_against_before(exp, node.status())
    check_against_before(exp, node.status())  # nothing changed: every line reused
    check_against_before(Exposition(), odd(node.status(), rng))
    for _ in range(20):  # the node moves on between scrapes, by a step or two
        a = node.arbiters[rng.randrange(2)]
        sids = list(a.sessions)
        step = rng.randrange(5)
        if step == 0 and sids:
            a.detach(rng.choice(sids))
        elif step == 1:
            sid = max([*node.arbiters[0].sessions, *node.arbiters[1].sessions, 0]) + 1
            a.attach(sid, AttachRecord(name=f"n{sid}", memory_limit=G))
            a.acquire(sid)
        elif step == 2 and a.holders:
            h = a.holders[0]
            a.release(h, resident=G // 2, swapped=0, again=rng.random() < 0.5)
        elif step == 3:
            clock.advance(rng.choice([0.0005, 0.3, 7.0, 31.0]))
            a.tick()
        else:
            node.utilization[a.gpu].credit(rng.random(), 1.0, list(a.holders))
        check_against_before(exp, node.status())
        check_against_before(exp, odd(node.status(), rng))


def changed(v: object) -> object:
    if isinstance(v, bool):
        return not v
    if isinstance(v, int | float):
        return v + 1
    if isinstance(v, str):
        return v + "x" if v not in ("idle", "holding") else {"idle": "holding"}.get(v, "idle")
    if isinstance(v, list):
        return [v[0] + 1, *v[1:]]
    return msgspec.structs.replace(v, pod="changed")  # type: ignore[type-var]


@pytest.mark.parametrize("field", msgspec.structs.fields(SessionStatus), ids=lambda f: f.name)
def test_a_change_of_any_one_figure_of_a_session_is_written(field):
    """A scrape reuses a session's lines only when nothing it shows changed: changed
    alone, each field of the status shows in the text as the reference writes it."""
    node, _ = scripted_node()
    exp = Exposition()
    st = node.status()
    exp.render(st)
    g = st.gpus[0]
    s = g.sessions[1]
    s2 = msgspec.structs.replace(s, **{field.name: changed(getattr(s, field.name))})
    sessions = [s2 if x is s else x for x in g.sessions]
    st2 = msgspec.structs.replace(
        st, gpus=[msgspec.structs.replace(g, sessions=sessions), *st.gpus[1:]]
    )
    check_against_before(exp, st2)


@pytest.mark.parametrize("field", msgspec.structs.fields(WorkloadStatus), ids=lambda f: f.name)
def test_a_change_of_any_one_figure_of_a_workload_is_written(field):
    node, _ = scripted_node()
    exp = Exposition()
    st = node.status()
    g = st.gpus[0]
    assert g.workloads
    exp.render(st)
    w = g.workloads[0]
    w2 = msgspec.structs.replace(w, **{field.name: changed(getattr(w, field.name))})
    g2 = msgspec.structs.replace(g, workloads=[w2, *g.workloads[1:]])
    check_against_before(exp, msgspec.structs.replace(st, gpus=[g2, *st.gpus[1:]]))


def test_no_gpus_and_no_sessions():
    node, _ = scripted_node()
    st = node.status()
    empty = msgspec.structs.replace(
        st, gpus=[msgspec.structs.replace(g, sessions=[]) for g in st.gpus]
    )
    check_against_before(Exposition(), empty)
    check_against_before(Exposition(), msgspec.structs.replace(st, gpus=[]))


def test_a_session_gone_is_forgotten_and_its_id_on_another_gpu_is_its_own():
    node, _ = scripted_node()
    exp = Exposition()
    exp.render(node.status())
    node.arbiters[0].detach(1)
    node.arbiters[1].attach(1, AttachRecord(name="again", memory_limit=G))  # the same id, elsewhere
    check_against_before(exp, node.status())
    kept = exp._last[id(_SESSIONS)]
    assert {k[2] for k in kept} == {1, 2, 3, 4, 7}
    assert {k[0] for k in kept if k[2] == 1} == {1}


@pytest.mark.parametrize(
    "v",
    [
        0,
        1,
        999_999,
        1_000_000,
        10_000_000,
        53_687_091_200,
        2**53,
        10**15 - 1,
        10**15,
        2**63,
        0.0,
        -0.0,
        -1.5,
        1e-300,
        0.1 + 0.2,
        1234567.0,
        12345678.9,
        1e16,
        1e22,
        math.inf,
        -math.inf,
        math.nan,
    ],
)
def test_values_are_written_as_prometheus_client_writes_them(v):
    assert value(v) == floatToGoString(v)


def test_random_values_are_written_as_prometheus_client_writes_them():
    rng = random.Random(3)
    for _ in range(20_000):
        v = rng.choice([rng.randrange(10**16), rng.random() * 10 ** rng.randrange(-8, 20)])
        assert value(v) == floatToGoString(v), v


def test_served_plain_and_gzipped_as_prometheus_client_served_it():
    node, _ = scripted_node()
    exp = Exposition()
    # The exporter process's server (metrics_http.serve_on), on a thread of this process.
    server = serve_on(bind(0, "127.0.0.1"), lambda: exp.render(node.status()))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_port
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            assert r.headers["Content-Type"] == CONTENT_TYPE
            plain = r.read()
        req = urllib.request.Request(url, headers={"Accept-Encoding": "gzip"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.headers["Content-Encoding"] == "gzip"
            assert gzip.decompress(r.read()) == plain
        assert plain == exp.render(node.status())
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/favicon.ico", timeout=10) as r:
            assert r.read() == b""
        post = urllib.request.Request(url, data=b"x", method="POST")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(post, timeout=10)
        assert e.value.code == 405
    finally:
        server.shutdown()
        server.server_close()

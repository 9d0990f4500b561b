"""Fuzzing the running daemon over its real sockets: random bytes and random message
sequences, on both sockets; and lies in well-formed messages (valid frames with hostile
values: negative, huge, NaN, infinite, the wrong state, other sessions' ids and leases),
in process on virtual time. After every case the node is alive, its invariants hold
and a bystander session is served as before."""

from __future__ import annotations

import math
import socket
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gpushare
from gpushare import protocol as p
from tests.node.harness import Peer, in_process
from tests.profiles import examples
from tests.support import NodeProcess, sim

ints = st.integers(min_value=-(2**63), max_value=2**63 - 1)
floats = st.floats(allow_nan=True, allow_infinity=True)
text = st.text(max_size=40)
opt = st.none

workload_msgs = st.one_of(
    st.builds(
        p.Hello,
        version=st.one_of(st.just(1), ints),
        name=text,
        memory_limit=st.one_of(opt(), ints),
        weight=st.one_of(opt(), floats),
        portion=st.one_of(opt(), floats),
        gpu=st.one_of(opt(), ints),
        backend=text,
        pod=text,
        pod_uid=text,
        resident=ints,
        swapped=ints,
        holding=st.booleans(),
        session=st.one_of(st.just(0), ints),
        lease=st.one_of(st.just(0), ints),
        token=text,
    ),
    st.builds(p.Acquire),
    st.builds(
        p.Release,
        resident=ints,
        swapped=ints,
        again=st.booleans(),
        swapped_out=ints,
        seconds=floats,
    ),
    st.builds(
        p.SwapDone,
        direction=st.sampled_from(["in", "out"]),
        bytes=ints,
        seconds=floats,
        resident=ints,
        swapped=ints,
        error=text,
    ),
    st.builds(p.Report, resident=ints, swapped=ints),
    st.builds(
        p.SetConfig,
        gpu=st.one_of(opt(), ints),
        tq_s=st.one_of(opt(), floats),
        mode=st.one_of(opt(), text),
        policy=st.one_of(opt(), text),
    ),
    st.builds(p.EndSession, session=ints),
    st.builds(p.Grant, lease=ints, swap_in=ints, quantum_s=floats),
)
admin_msgs = st.one_of(
    st.builds(p.StatusRequest),
    st.builds(
        p.SetConfig,
        gpu=st.one_of(opt(), st.integers(-2, 3)),
        tq_s=st.one_of(opt(), floats),
        mode=st.one_of(opt(), text, st.just("auto")),
        policy=st.one_of(opt(), text),
        escalation=st.one_of(opt(), text),
    ),
    st.builds(p.EndSession, session=st.integers(-5, 100)),
    st.builds(p.Acquire),
    st.builds(p.Hello, version=ints),
)


@pytest.fixture(scope="module")
def fuzz_node():
    with tempfile.TemporaryDirectory(prefix="gs-fz-") as d:
        node = NodeProcess(
            Path(d), *sim("16GiB", gpus="2", tq="0.2", mode="exclusive", log_level="error")
        )
        node.start()
        bystander = gpushare.attach("1GiB", socket=node.socket, name="bystander")
        yield node, bystander
        bystander.close()
        node.stop()


def _send(path: str, data: bytes) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(2)
    try:
        s.connect(path)
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        while s.recv(65536):
            pass
    except OSError:
        pass  # the node may close first: that is allowed
    finally:
        s.close()


def _still_serving(node: NodeProcess, bystander: gpushare.Session) -> None:
    assert node.proc is not None and node.proc.poll() is None
    with bystander.gpu():
        assert bystander.holding
    for g in node.status()["gpus"]:
        assert len(g["holders"]) <= 1 and g["used_bytes"] <= g["usable_bytes"]


fuzz = settings(
    max_examples=examples(150),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.mark.parametrize("which", ["socket", "admin"])
@fuzz
@given(data=st.binary(max_size=512))
def test_random_bytes_on_either_socket(fuzz_node, which, data):
    node, by = fuzz_node
    _send(getattr(node, which), data)
    _still_serving(node, by)


@fuzz
@given(msgs=st.lists(workload_msgs, max_size=8), hello_first=st.booleans())
def test_random_message_sequences_on_the_workload_socket(fuzz_node, msgs, hello_first):
    node, by = fuzz_node
    head = [p.Hello(version=1, memory_limit=2**20)] if hello_first else []
    _send(node.socket, b"".join(p.encode(m) for m in [*head, *msgs]))
    _still_serving(node, by)


@fuzz
@given(msgs=st.lists(admin_msgs, max_size=6))
def test_random_message_sequences_on_the_admin_socket(fuzz_node, msgs):
    node, by = fuzz_node
    msgs = [m for m in msgs if not (isinstance(m, p.EndSession) and m.session == by.id)]
    _send(node.admin, b"".join(p.encode(m) for m in msgs))
    _still_serving(node, by)


# --- lies in well-formed messages, in process ---------------------------------------------

int64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
sizes = st.one_of(int64, st.integers(0, 8 * 2**30), st.sampled_from([0, 2**30, 2**62]))
hostile = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([-1.0, 1e308, 0.5])
)
lies = st.one_of(
    st.builds(p.Acquire),
    st.builds(
        p.Release, resident=sizes, swapped=sizes, again=st.booleans(), swapped_out=sizes,
        seconds=hostile, swapping_out=sizes,
    ),
    st.builds(
        p.SwapDone, direction=st.sampled_from(["in", "out"]), bytes=sizes, seconds=hostile,
        resident=sizes, swapped=sizes, error=st.sampled_from(["", "x" * 5000]),
    ),
    st.builds(p.Report, resident=sizes, swapped=sizes),
)  # fmt: skip
hellos = st.builds(
    p.Hello, version=st.just(1), name=st.text(max_size=300),
    memory_limit=st.one_of(st.none(), sizes),
    weight=st.one_of(st.none(), hostile), portion=st.one_of(st.none(), hostile),
    resident=sizes, swapped=sizes, holding=st.booleans(), session=st.sampled_from([0, 1, 2, 99]),
    lease=st.sampled_from([0, 1, 2, 2**62]), token=st.sampled_from(["", "0" * 32]),
    gang_size=st.sampled_from([0, 2, -1, 10**9]), rank=st.sampled_from([-1, 0, 5]),
)  # fmt: skip


@settings(max_examples=examples(150), deadline=None, suppress_health_check=list(HealthCheck))
@given(hello=hellos, msgs=st.lists(lies, max_size=12))
@in_process(memory="16GiB", mode="exclusive", tq=1, grace=1, escalation="kill")
async def test_lies_in_well_formed_messages_harm_no_one(node, hello, msgs):
    by = await node.workload(memory_limit=2**30, name="bystander")
    await by.send(p.Acquire())
    await by.expect(p.Grant)
    liar = await Peer.connect(node.socket)
    await liar.send(hello, *msgs)
    await node.settle()
    await node.until(lambda: True)
    for g in node.node.status().gpus:
        assert len(g.holders) <= 1 and g.used_bytes <= g.usable_bytes
        for x in g.sessions:
            assert min(x.resident_bytes, x.swapped_bytes) >= 0
            assert x.resident_bytes + x.swapped_bytes <= x.memory_limit_bytes
            assert math.isfinite(x.swap_out_seconds_total + x.swap_in_seconds_total)
    # the bystander is served: it holds, or gets the GPU back once the liar's turn ends
    await by.send(p.Release(resident=0, swapped=0))
    await by.send(p.Acquire())
    await by.expect(p.Grant, timeout=120)
    liar.close()

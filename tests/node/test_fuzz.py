"""Fuzzing the running daemon over its real sockets: random bytes and random message
sequences, on both sockets. After every case the node is alive and a bystander session
is served as before."""

from __future__ import annotations

import socket
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gpushare
from gpushare import protocol as p
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


fuzz = settings(
    max_examples=150,
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

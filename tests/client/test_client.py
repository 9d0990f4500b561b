"""The client runtime in this process, against a real node daemon."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

import pytest

import gpushare
from gpushare.client.transport import Link
from gpushare.errors import DaemonUnavailableError, GpushareError, OutOfMemoryError
from tests.support import sim, wait_until

G = 2**30


@pytest.fixture
def node(node_factory):
    return node_factory(
        *sim("16GiB", mode="exclusive", tq="0.2", idle_release="0.3", sim_bandwidth="1e12")
    )


def state_of(node, sid):
    for s in node.status()["gpus"][0]["sessions"]:
        if s["id"] == sid:
            return s["state"]
    return None


def test_no_daemon_names_the_fix(short_tmp):
    with pytest.raises(DaemonUnavailableError, match="start it with 'gpushare node'"):
        gpushare.attach("1GiB", socket=str(short_tmp / "nothing.sock"))


def test_limit_beyond_the_gpu_is_refused(node):
    with pytest.raises(gpushare.AttachRefusedError, match=r"17\.0 GiB is more than GPU 0's") as e:
        gpushare.attach("17GiB", socket=node.socket)
    assert e.value.code == "attach" and isinstance(e.value, GpushareError)


def test_memory_from_environment(node, monkeypatch):
    monkeypatch.setenv("GPUSHARE_SOCKET", node.socket)
    monkeypatch.setenv("GPU_PORTION", "0.25")
    with gpushare.attach() as s:
        assert s.memory_limit == 4 * G and s.weight == 0.25
    monkeypatch.setenv("GPUSHARE_MEMORY", "3GiB")
    with gpushare.attach() as s:
        assert s.memory_limit == 3 * G


@pytest.mark.parametrize("memory", ["1e30", 10**30])
def test_a_limit_beyond_any_gpu_is_a_value_error_naming_memory(node, memory):
    # issue 25: the encoder's OverflowError came out of attach, as a traceback
    with pytest.raises(ValueError, match=r"^memory=.*more than any GPU has"):
        gpushare.attach(memory, socket=node.socket)


def test_bad_gpu_portion_is_refused(monkeypatch):
    monkeypatch.setenv("GPU_PORTION", "1.5")
    with pytest.raises(ValueError, match="GPU_PORTION"):
        gpushare.attach()


def test_memory_limit_enforced_and_outside_lease_refused(node):
    with gpushare.attach("2GiB", socket=node.socket) as s:
        with pytest.raises(GpushareError, match="outside a lease"):
            s.backend.allocate(G)
        with s.gpu():
            m = s.backend.allocate(2 * G)
            with pytest.raises(OutOfMemoryError, match="memory limit"):
                s.backend.allocate(1)
            m.fill(5)
        st = next(x for x in node.status()["gpus"][0]["sessions"] if x["id"] == s.id)
        assert st["resident_bytes"] == 2 * G


def test_checkpoint_yields_to_a_waiter_and_comes_back(node):
    a = gpushare.attach("10GiB", socket=node.socket, name="a")
    b = gpushare.attach("10GiB", socket=node.socket, name="b")
    got_b = threading.Event()
    try:
        with a.gpu():
            ma = a.backend.allocate(10 * G)
            ma.fill(1)

            def run_b():
                with b.gpu():
                    got_b.set()

            t = threading.Thread(target=run_b)
            t.start()
            deadline = time.monotonic() + 10
            while not got_b.is_set() and time.monotonic() < deadline:
                a.checkpoint()  # yields here once revoked, and blocks until granted again
                time.sleep(0.01)  # a's GPU work between safe points
            t.join(10)
            assert got_b.is_set()
            assert ma.verify(1)  # swapped out for b, back intact
        assert a.grants >= 2
    finally:
        a.close()
        b.close()


def test_checkpoint_fast_path_has_no_effect_when_nobody_waits(node):
    with gpushare.attach("1GiB", socket=node.socket) as s, s.gpu():
        lease = s._lease.lease
        for _ in range(1000):
            s.checkpoint()
        assert s._lease.lease == lease and s.grants == 1


def test_implicit_burst_ends_after_idle_release(node):
    with gpushare.attach("1GiB", socket=node.socket) as s:
        s.checkpoint()  # GPU work outside gpu(): opens a burst
        assert s.holding and state_of(node, s.id) == "holding"
        wait_until(lambda: state_of(node, s.id) == "idle", timeout=5, what="idle release")
        assert not s.holding
        s.checkpoint()
        assert s.holding


def test_threads_share_one_burst(node):
    with gpushare.attach("1GiB", socket=node.socket) as s:
        inside = []
        barrier = threading.Barrier(4)

        def work():
            with s.gpu():
                inside.append(s.holding)
                barrier.wait(5)

        ts = [threading.Thread(target=work) for _ in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(10)
        assert inside == [True] * 4 and s.grants == 1
        wait_until(lambda: state_of(node, s.id) == "idle", what="release at the last exit")


def test_session_refuses_use_in_a_forked_child(node):
    with gpushare.attach("1GiB", socket=node.socket) as s:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # child
            try:
                with s.gpu():
                    os.write(w, b"used")
            except GpushareError as e:
                os.write(w, b"refused" if "call gpushare.attach() in the child" in str(e) else b"?")
            s.close()
            os._exit(0)
        os.waitpid(pid, 0)
        assert os.read(r, 100) == b"refused"
        with s.gpu():  # the parent's session still works
            assert s.holding


def test_node_away_too_long_is_a_clear_error(node):
    s = gpushare.attach("1GiB", socket=node.socket, reconnect_timeout=0.5)
    node.stop()
    wait_until(lambda: s._link.state is Link.AWAY, what="the client to notice")
    t0 = time.monotonic()
    with pytest.raises(DaemonUnavailableError, match=r"away for 0\.5 s"), s.gpu():
        pass
    assert time.monotonic() - t0 < 5
    s.close()


def test_interrupted_wait_withdraws_from_the_queue(node):
    import signal

    holder = gpushare.attach("1GiB", socket=node.socket, name="holder")
    waiter = gpushare.attach("1GiB", socket=node.socket, name="waiter")

    def interrupt(*_):
        raise TimeoutError("gave up waiting")

    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        with holder.gpu():
            signal.setitimer(signal.ITIMER_REAL, 0.3)
            with pytest.raises(TimeoutError), waiter.gpu():
                pass
            signal.setitimer(signal.ITIMER_REAL, 0)
            assert state_of(node, waiter.id) == "idle"
        # the lease is not handed to the session that gave up
        time.sleep(0.2)  # a quiet period: a lease handed to it would show by now
        assert node.status()["gpus"][0]["holders"] == []
        with waiter.gpu():  # and it can still ask again
            assert waiter.holding
    finally:
        signal.signal(signal.SIGALRM, old)
        holder.close()
        waiter.close()


def test_python_c_is_named_for_what_it_is(node):
    code = (
        "import sys, gpushare;"
        f" s = gpushare.attach('1GiB', socket={node.socket!r}); print(s.name); s.close()"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert re.fullmatch(r"python-c-\d+", r.stdout.strip()), r.stdout

"""A session's family through a node restart (core/families.py): the node SIGKILLed
with a member attached rebuilds the family from its records (the ids, the split limits,
one gang), and the member's memory goes back to its session when it leaves."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import pytest

from gpushare import protocol as p
from gpushare.node.serve import workload_server
from tests.node.harness import InProcessNode, Workload, in_process
from tests.support import sim, wait_until

G = 2**30

MEMBER = """
import sys
from gpushare.client.session import attach_with
m = attach_with(memory_limit=3 * 2**30, socket=sys.argv[1], family=int(sys.argv[2]), name="member")
print(m.id, m.memory_limit, flush=True)
sys.stdin.read()
m.close()
"""

HEAD = """
import subprocess, sys, time
import gpushare
s = gpushare.attach("8GiB", socket=sys.argv[1], name="head")
member = subprocess.Popen(
    [sys.executable, "-c", sys.argv[2], sys.argv[1], str(s.id)],
    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
)
mid, mlimit = member.stdout.readline().split()
t = time.monotonic()
while s.memory_limit == 8 * 2**30 and time.monotonic() - t < 30:
    time.sleep(0.02)  # a look every 20 ms until the node says the new limit (30 s at most)
print(s.id, mid, mlimit, s.memory_limit, flush=True)
sys.stdin.readline()  # after the restart: the member leaves
member.stdin.close()
member.wait()
t = time.monotonic()
while s.memory_limit != 8 * 2**30 and time.monotonic() - t < 30:
    time.sleep(0.02)  # a look every 20 ms, as above
print(s.memory_limit, flush=True)
sys.stdin.readline()  # attached until the test has read the node's status
"""


def _sessions(node) -> dict[int, dict]:
    return {s["id"]: s for s in node.status()["gpus"][0]["sessions"]}


def test_a_family_survives_a_node_killed_and_its_memory_goes_back(node_factory):
    node = node_factory(*sim("16GiB", mode="exclusive"))
    head = subprocess.Popen(
        [sys.executable, "-c", HEAD, node.socket, MEMBER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert head.stdout is not None and head.stdin is not None
        hid, mid, mlimit, hlimit = map(int, head.stdout.readline().split())
        assert (mlimit, hlimit) == (3 * G, 5 * G)  # the head was told its part
        before = _sessions(node)
        assert before[mid]["family"] == hid and before[hid]["family"] == 0
        gang = before[mid]["gang"]
        assert gang.startswith(f"session:{hid}@") and before[hid]["gang"] == gang

        node.proc.send_signal(signal.SIGKILL)
        node.proc.wait()
        node.start()

        def back() -> dict[int, dict] | None:
            now = _sessions(node)
            return now if {hid, mid} <= set(now) else None

        after = wait_until(back, 60, "the head and its member back with their ids")
        assert after[mid]["family"] == hid
        assert after[mid]["gang"] == gang and after[hid]["gang"] == gang  # one gang again
        assert after[mid]["memory_limit_bytes"] == 3 * G
        assert after[hid]["memory_limit_bytes"] == 5 * G  # not 8: nothing counted twice

        head.stdin.write("\n")
        head.stdin.flush()
        assert int(head.stdout.readline()) == 8 * G  # the member left: its part is back
        assert _sessions(node)[hid]["memory_limit_bytes"] == 8 * G
    finally:
        head.kill()
        head.wait()


# --- the node's checks and records, in process (every peer is this process: the /proc
# check that a member descends from its session's process is taken as passed) ---------


@pytest.fixture
def descendants(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(workload_server, "descends", lambda pid, ancestor, root: True)


async def _refused(node: InProcessNode, **hello: object) -> p.Error:
    peer = Workload(*await asyncio.open_unix_connection(node.socket))
    await peer.send(p.Hello(version=p.PROTOCOL_VERSION, **hello))
    err: p.Error = await peer.expect(p.Error)
    assert "\n" not in err.message
    return err


@in_process(mode="auto")
async def test_a_members_gang_fields_do_not_put_its_session_in_a_job(
    node: InProcessNode, descendants: None
) -> None:
    head = await node.workload(memory_limit=8 * G, name="head")
    m = await node.workload(
        memory_limit=2 * G, family=head.session, gang="job", gang_size=2, rank=0, world_size=4
    )
    key = f"session:{head.session}@uid:{os.getuid()}"
    gangs = node.node.status().gpus[0].gangs
    assert [(g.gang, sorted(g.sessions), g.spans_nodes) for g in gangs] == [
        (key, sorted([head.session, m.session]), False)
    ]


@in_process()
async def test_a_member_of_a_member_is_refused(node: InProcessNode, descendants: None) -> None:
    head = await node.workload(memory_limit=8 * G, name="head")
    m = await node.workload(memory_limit=2 * G, family=head.session)
    err = await _refused(node, memory_limit=G, family=m.session)
    assert err.code == "attach" and f"a process of session {head.session}'s" in err.message
    assert set(node.node.arbiters[0].sessions) == {head.session, m.session}


@in_process()
async def test_a_node_killed_once_the_session_heard_its_new_limit_gives_both_their_ids_back(
    node: InProcessNode, descendants: None
) -> None:
    head = await node.workload(memory_limit=8 * G, name="head")
    await node.settle()  # the head on record
    rec = node.node.recovery
    # From here a SIGKILL: no save later than the ones made at once, none at the stop.
    rec.save_soon = lambda delay=0.1: None  # type: ignore[method-assign]
    rec.hold = lambda: setattr(rec, "_held", True)  # type: ignore[method-assign]
    m = await node.workload(memory_limit=3 * G, family=head.session, name="member")
    limits = await head.expect(p.Limits)
    # the request filled in too, as the welcome's is: never 0 for "the limit" (issue 37)
    assert (limits.memory_limit, limits.memory_request) == (5 * G, 5 * G)
    await node.restart()
    back = await node.workload(session=head.session, memory_limit=5 * G, name="head")
    member = await node.workload(
        session=m.session, memory_limit=3 * G, family=head.session, name="member"
    )
    assert (back.session, member.session) == (head.session, m.session)
    s = node.node.arbiters[0].sessions
    assert s[m.session].rank.family == head.session
    assert s[m.session].rank.gang == s[head.session].rank.gang != ""


@in_process()
async def test_a_member_is_told_busy_while_its_session_holds(
    node: InProcessNode, descendants: None
) -> None:
    head = await node.workload(memory_limit=8 * G, name="head")
    await head.send(p.Acquire())
    await head.expect(p.Grant)
    err = await _refused(node, memory_limit=G, family=head.session)
    assert err.code == "busy" and "holds the GPU" in err.message
    assert set(node.node.arbiters[0].sessions) == {head.session}

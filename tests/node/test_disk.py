"""The node and its disk (issue 42; issue 38 item 3), in process on virtual time: no
grant waits for a records write (they are on a thread of their own, one at a time, in
order); a new session's record is on disk before it is welcomed, so a session whose
record cannot be written is refused at attach, never found missing after a restart; and
the journal's lines written while a whole write is in flight count whichever way it
ends."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

from gpushare import protocol as p
from gpushare.node.host.procs import ref_of
from gpushare.node.keep.recovery import JOURNALS, STATE_FILE, Recovery, SessionRecord
from gpushare.node.keep.safefs import SafeDir
from tests.node.harness import G, InProcessNode, Peer, Workload, in_process


def _full(*args: object, **kw: object) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


async def _back(node: InProcessNode, was: Workload) -> Workload:
    w = await node.workload(
        session=was.session, memory_limit=was.welcome.memory_limit, name=was.welcome.name
    )
    assert w.session == was.session
    return w


async def _refused(node: InProcessNode, name: str) -> p.Error:
    peer = await Peer.connect(node.socket)
    await peer.send(p.Hello(version=p.PROTOCOL_VERSION, memory_limit=G, name=name))
    m = await peer.recv()
    assert isinstance(m, p.Error), m
    peer.close()
    return m


def _names(node: InProcessNode) -> list[str]:
    return sorted(s.name for g in node.node.status().gpus for s in g.sessions)


@in_process(memory="80GiB", mode="exclusive", tq=5)
async def test_a_grant_does_not_wait_for_a_records_write_on_a_busy_disk(node, monkeypatch):
    # Seen (issue 42): the records were written, flushed, on the node's loop: while
    # another process filled the disk, every grant, revoke and status waited behind it.
    a = await node.workload(memory_limit=G, name="a")
    rec = node.node.recovery
    real = rec.dir.write
    entered, gate = threading.Event(), threading.Event()

    def busy_disk(*args: object, **kw: object) -> None:  # a flush that takes its time
        entered.set()
        gate.wait(30)
        real(*args, **kw)

    monkeypatch.setattr(rec.dir, "write", busy_disk)
    timer = threading.Timer(3.0, gate.set)  # on the loop (before), this frees it
    timer.start()
    try:
        await a.send(p.Acquire())
        first = await a.expect(p.Grant)  # its record is written 0.1 s after the grant
        await node.until(entered.is_set)
        await a.send(p.Release(resident=0, swapped=0), p.Acquire())
        second = await a.expect(p.Grant)
        status = await node.ask(p.StatusRequest())
        assert not gate.is_set(), "the grant and the status waited for the records' flush"
        assert second.lease > first.lease and isinstance(status, p.StatusReply)
    finally:
        gate.set()
        timer.cancel()
    await node.until(lambda: not rec._writing)
    monkeypatch.undo()
    await node.restart()  # the records written in the background are whole and current
    a2 = await _back(node, a)
    assert a2.session == a.session


@in_process(memory="80GiB")
async def test_a_session_whose_record_cannot_be_written_is_refused_at_attach(node, monkeypatch):
    # Seen (issue 38, item 3): a session that attached after the disk filled got an id
    # whose record could not be written (ids are reserved a block at a time); after a
    # restart it was refused `busy` until its client gave up, its memory lost.
    a = await node.workload(memory_limit=G, name="a")
    await node.settle()
    d = node.node.recovery.dir
    monkeypatch.setattr(d, "write", _full)
    m = await _refused(node, "b")
    assert m.code == "busy" and d.path in m.message, m
    assert "free space" in m.message and "recovery_dir" in m.message and "\n" not in m.message
    assert _names(node) == ["a"]  # nothing attached, nothing left on record for it
    assert not node.node.recovery.pending
    await node.restart()  # the disk still full: the records as they were
    monkeypatch.setattr(node.node.recovery.dir, "write", _full)
    a2 = await _back(node, a)  # on record: back, the window closes
    assert not node.node.recovery.open
    m = await _refused(node, "c")  # a newcomer: refused for the same clear reason
    assert m.code == "busy" and "free space" in m.message, m
    monkeypatch.undo()  # room again: newcomers attach at once, no restart needed
    c = await node.workload(memory_limit=G, name="c")
    assert c.session > a2.session and _names(node) == ["a", "c"]
    await node.restart()
    await _back(node, c)  # on record before it was welcomed
    await _back(node, a2)


@in_process(memory="80GiB")
async def test_attaches_arriving_together_are_welcomed_each_on_record(node, monkeypatch):
    # Each waits for a whole write taken after it asked; those that arrive while one is
    # in flight share the next.
    rec = node.node.recovery
    real = rec.dir.write
    writes: list[int] = []

    def counted(*args: object, **kw: object) -> None:
        writes.append(1)
        real(*args, **kw)

    monkeypatch.setattr(rec.dir, "write", counted)
    peers = []
    for i in range(20):
        peer = await Peer.connect(node.socket)
        await peer.send(p.Hello(version=p.PROTOCOL_VERSION, memory_limit=G, name=f"w{i}"))
        peers.append(peer)
    welcomes = [await peer.expect(p.Welcome) for peer in peers]
    assert len({w.session for w in welcomes}) == 20
    assert 1 <= len(writes) <= 20, len(writes)  # one at most for each
    on_disk = rec.dir.read(STATE_FILE)
    assert on_disk is not None
    for w in welcomes:  # each on disk before it was welcomed
        assert f'"id":{w.session},'.encode() in on_disk


def _me(sid: int, lease: int = 0) -> SessionRecord:
    me = ref_of(os.getpid(), "/proc")
    assert me is not None
    return SessionRecord(id=sid, gpu=0, pid=me.pid, start_time=me.start_time, uid=me.uid,
                         limit=G, name=f"s{sid}", lease=lease)  # fmt: skip


def _records(tmp_path: Path, live: list[SessionRecord]) -> Recovery:
    r = Recovery(SafeDir(tmp_path), 1, lambda: live, lambda: "/proc")
    r.load()
    return r


def test_a_grant_journalled_while_a_whole_write_is_in_flight_counts_either_way(tmp_path):
    live = [_me(1)]
    r = _records(tmp_path, live)
    r.granted(0, 1, 1)  # the first lease moves the floor: a whole write
    snap = r._snapshot()  # taken: on the records' thread now
    r.granted(0, 1, 2)  # meanwhile, a line of the write in flight's generation
    # killed before the write reached the disk: the line comes after the file there
    assert _records(tmp_path, []).previous[1].lease == 2
    assert r._write(*snap)  # on disk: the journal of the generation before emptied
    assert _records(tmp_path, []).previous[1].lease == 2  # this line kept
    live[0] = _me(1)  # lease 2 released since
    assert r.save()
    assert _records(tmp_path, []).previous[1].lease == 0  # released stays released
    assert all((tmp_path / j).read_bytes() == b"" for j in JOURNALS)

"""What must be on disk before a session hears it (a family's new limits; what a freeze
stops), in process on virtual time: written on the records' thread, that session's
frames held back until it is done, in order, and everyone else's going at once (issue
42: the write was made on the loop, so every grant waited for the disk)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator

import msgspec
import pytest

from gpushare import protocol as p
from gpushare.node.host.procs import ProcRef
from gpushare.node.keep.recovery import STATE_FILE, Saved, SessionRecord
from gpushare.node.serve import workload_server
from tests.node.harness import G, InProcessNode, in_process


@pytest.fixture
def descendants(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(workload_server, "descends", lambda pid, ancestor, root: True)


def _on_disk(node: InProcessNode, sid: int) -> SessionRecord | None:
    raw = node.node.recovery.dir.read(STATE_FILE)
    saved = msgspec.json.decode(raw, type=Saved) if raw else Saved()
    return next((r for r in saved.sessions if r.id == sid), None)


class SlowDisk:
    """The first records write that ``slow(saved)`` picks waits on :attr:`gate` (a flush
    behind another process's gigabytes): set by a timer after ``seconds`` of wall time,
    so that a loop blocked on it (before) comes free and the test fails, not hangs."""

    def __init__(self, node: InProcessNode, slow: Callable[[Saved], bool], seconds: float):
        self.dir = node.node.recovery.dir
        self.real = self.dir.write
        self.slow = slow
        self.entered, self.gate = threading.Event(), threading.Event()
        self.timer = threading.Timer(seconds, self.gate.set)

    def write(self, name: str, data: bytes, **kw: object) -> None:
        slow = name == STATE_FILE and not self.entered.is_set()
        if slow and self.slow(msgspec.json.decode(data, type=Saved)):
            self.entered.set()
            self.gate.wait(30)
        self.real(name, data, **kw)  # type: ignore[arg-type]

    def __enter__(self) -> SlowDisk:
        self.dir.write = self.write  # type: ignore[method-assign]
        self.timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.gate.set()
        self.timer.cancel()
        self.dir.write = self.real  # type: ignore[method-assign]


def _has(sid: int, pred: Callable[[SessionRecord], bool]) -> Callable[[Saved], bool]:
    return lambda saved: any(r.id == sid and pred(r) for r in saved.sessions)


@in_process(memory="80GiB", mode="exclusive", tq=600)
async def test_a_familys_new_limits_wait_for_their_record_and_no_other_grant_does(
    node: InProcessNode, descendants: None
) -> None:
    head = await node.workload(memory_limit=8 * G, name="head")
    other = await node.workload(memory_limit=G, name="other")
    await node.settle()
    rec = node.node.recovery
    with SlowDisk(node, _has(head.session, lambda r: r.limit == 5 * G), 3.0) as disk:
        member = await node.workload(memory_limit=3 * G, family=head.session, name="member")
        await node.until(disk.entered.is_set)  # the head's new limit: being written
        await other.send(p.Acquire())
        await other.expect(p.Grant)
        assert not disk.gate.is_set(), "another session's grant waited for the records"
        await head.send(p.Acquire())
        await node.until(lambda: node.node.arbiters[0].queue)
        await other.send(p.Release(resident=0, swapped=0))  # the head's turn: its grant
        await node.until(lambda: node.events("grant")[-1]["session"] == head.session)
        with pytest.raises(TimeoutError):  # held back behind its limits, not yet told
            await head.recv(timeout=0.5)
        assert not disk.gate.is_set()
        disk.gate.set()
        first = await head.recv()
        on_disk = _on_disk(node, head.session)  # what a node killed now would find
        assert isinstance(first, p.Limits) and first.memory_limit == 5 * G
        assert on_disk is not None and on_disk.limit == 5 * G
        assert isinstance(await head.expect(p.Grant), p.Grant)  # after it, in order
    await node.until(lambda: not rec._writing)
    member.close()


def _freeze_watch(node: InProcessNode, sid: int) -> Iterator[list[bool]]:
    """At each SIGSTOP: whether the session's record on disk names it as stopped."""
    seen: list[bool] = []
    real = node.node.dispatch.signaller

    def signaller(ref: ProcRef, sig: int) -> None:
        if sig == signal.SIGSTOP:
            r = _on_disk(node, sid)
            seen.append(r is not None and (ref.pid, ref.start_time) in r.stopped)
        real(ref, sig)

    node.node.dispatch.signaller = signaller
    try:
        yield seen
    finally:
        node.node.dispatch.signaller = real


@in_process(mode="exclusive", tq=1, grace=1, escalation="freeze")
async def test_a_freeze_stops_only_what_is_on_disk_and_the_next_grant_goes_at_once(
    node: InProcessNode,
) -> None:
    a = await node.workload(memory_limit=G, name="stuck")
    await a.send(p.Acquire())
    await a.expect(p.Grant)
    b = await node.workload(memory_limit=G, name="next")
    await node.settle()
    watch = _freeze_watch(node, a.session)
    seen = next(watch)
    with SlowDisk(node, _has(a.session, lambda r: bool(r.stopped)), 3.0) as disk:
        await b.send(p.Acquire())
        await b.expect(p.Grant)  # a never yields: frozen, its lease handed on
        assert not disk.gate.is_set(), "the next grant waited for the freeze's record"
        await node.until(disk.entered.is_set)  # the freeze's record: being written
        assert seen == []  # not stopped before it is on disk
        disk.gate.set()
        await node.until(lambda: seen)
    assert seen == [True]  # a node that restarts now continues it
    watch.close()


@in_process(mode="exclusive", tq=1, grace=1, escalation="freeze")
async def test_a_session_ended_before_its_freeze_is_on_disk_is_never_stopped(
    node: InProcessNode,
) -> None:
    a = await node.workload(memory_limit=G, name="stuck")
    await a.send(p.Acquire())
    await a.expect(p.Grant)
    b = await node.workload(memory_limit=G, name="next")
    await node.settle()
    with SlowDisk(node, _has(a.session, lambda r: bool(r.stopped)), 3.0) as disk:
        await b.send(p.Acquire())
        await b.expect(p.Grant)
        await node.ask(p.EndSession(session=a.session, reason="maintenance"))
        assert await a.closed()
        disk.gate.set()
        await node.until(lambda: not node.node.recovery._writing)
        await node.settle()
    assert signal.SIGSTOP not in [sig for _, sig in node.signals]
    assert not node.node.dispatch._freezing

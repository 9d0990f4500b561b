"""The event log's writer (node/keep/events.py): its lines written on a thread of their
own, in order, so that a slow disk delays no grant (issue 42: each event's line was
written, and the log rotated, on the node's loop); a queue it cannot keep up with drops
lines from the log, counted and said once, never from the ring."""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from pathlib import Path
from typing import IO, Any

import pytest

from gpushare import protocol as p
from gpushare.node.keep import events
from gpushare.node.keep.events import EventBus
from tests.node.harness import G, InProcessNode, in_process

# The in-process node's log: a file of this process's (the harness's folder is made later).
LOG = Path(tempfile.gettempdir()) / f"gs-events-writer-{os.getpid()}.jsonl"


class SlowFile:
    """The log's file, whose writes wait on :attr:`gate` (a disk behind another process's
    flush) once the first has begun; set by a timer after ``seconds`` of wall time, so a
    loop blocked on it (before) comes free and the test fails, not hangs."""

    def __init__(self, real: IO[Any], seconds: float) -> None:
        self.real = real
        self.entered, self.gate = threading.Event(), threading.Event()
        self.timer = threading.Timer(seconds, self.gate.set)
        self.timer.start()

    def write(self, data: Any) -> int:
        self.entered.set()
        self.gate.wait(30)
        return int(self.real.write(data))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def free(self) -> None:
        self.gate.set()
        self.timer.cancel()


def _kinds(path: Path) -> list[str]:
    return [json.loads(line)["event"] for line in path.read_text().splitlines()]


@in_process(memory="80GiB", mode="exclusive", tq=600, event_log=str(LOG))
async def test_a_slow_event_log_delays_no_grant_and_keeps_every_line_in_order(
    node: InProcessNode,
) -> None:
    try:
        bus = node.node.events
        a = await node.workload(memory_limit=G, name="a")
        await node.settle()
        slow = bus._file = SlowFile(bus._file, 3.0)  # type: ignore[assignment]
        try:
            await a.send(p.Acquire())
            first = await a.expect(p.Grant)
            await node.until(slow.entered.is_set)  # its event's line: being written
            b = await node.workload(memory_limit=G, name="b")
            await a.send(p.Release(resident=0, swapped=0), p.Acquire())
            second = await a.expect(p.Grant)
            status = await node.ask(p.StatusRequest())
            assert not slow.gate.is_set(), "the grants waited for the event log's disk"
            assert second.lease > first.lease and isinstance(status, p.StatusReply)
        finally:
            slow.free()
        bus.flush()
        assert _kinds(LOG) == [e["event"] for e in bus.backlog]  # each, in order
        assert bus.dropped == 0
        b.close()
    finally:
        LOG.unlink(missing_ok=True)


def test_a_writer_that_cannot_keep_up_drops_log_lines_counted_and_said_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="gpushare.node.events")
    monkeypatch.setattr(events, "WRITE_QUEUE", 5)
    log = tmp_path / "events.jsonl"
    bus = EventBus(str(log))
    slow = bus._file = SlowFile(bus._file, 30.0)  # type: ignore[assignment]
    bus.publish({"event": "grant", "n": 0})
    assert slow.entered.wait(10)  # the writer holds line 0; five more fit behind it
    for n in range(1, 50):
        bus.publish({"event": "grant", "n": n})
    assert bus.dropped == 50 - 6
    assert len(bus.backlog) == 50  # the ring has them all
    said = [r for r in caplog.records if "still get them" in r.getMessage()]
    assert len(said) == 1 and str(log) in said[0].getMessage()
    slow.free()
    bus.close()
    assert [json.loads(x)["n"] for x in log.read_text().splitlines()] == list(range(6))
    assert "44 lines dropped" in caplog.text


def test_close_writes_every_line_queued_and_rotates_on_the_writer(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    bus = EventBus(str(log), rotate_bytes=4096)
    slow = bus._file = SlowFile(bus._file, 0.2)  # type: ignore[assignment]
    for n in range(300):  # ~30 bytes a line: rotated a few times
        bus.publish({"event": "grant", "n": n})
    bus.close()  # waits for the writer: nothing queued is lost
    slow.free()
    kept = [json.loads(x)["n"] for x in log.read_text().splitlines()]
    older = [json.loads(x)["n"] for x in (tmp_path / "events.jsonl.1").read_text().splitlines()]
    assert kept and older and older + kept == list(range(older[0], 300))
    assert log.stat().st_size <= 4096 + 64 and bus.dropped == 0

"""The node's event log (node/keep/events.py): one JSON object a line, across restarts."""

from __future__ import annotations

import json

from gpushare.node.keep.events import EventBus


def test_a_line_a_killed_node_left_unended_is_not_joined_to_the_next(tmp_path):
    log = tmp_path / "events.jsonl"
    log.write_text('{"event":"grant","session":1}\n{"ts":17,"gpu":0,"event":')  # SIGKILL here
    bus = EventBus(str(log))
    bus.publish({"event": "recovery", "phase": "begin"})
    bus.close()
    lines = log.read_text().splitlines()
    assert lines[1] == '{"ts":17,"gpu":0,"event":'  # the torn line, alone on its line
    assert json.loads(lines[2]) == {"event": "recovery", "phase": "begin"}
    assert json.loads(lines[0])["session"] == 1


def test_a_log_that_ends_its_lines_is_appended_to_as_it_is(tmp_path):
    log = tmp_path / "events.jsonl"
    for n in (1, 2):  # two node runs, and an empty file at first
        bus = EventBus(str(log))
        bus.publish({"event": "attach", "session": n})
        bus.close()
    assert [json.loads(x)["session"] for x in log.read_text().splitlines()] == [1, 2]

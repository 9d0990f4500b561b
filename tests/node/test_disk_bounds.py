"""Every figure the node reads back from disk is bounded above as well as below (issue
38): a journal line, a record, a lease floor or a next id past what the wire carries is
dropped with a log line, and the GPU goes on granting, across restarts. In process, on
virtual time, over the node's real files."""

from __future__ import annotations

import json
import logging

from gpushare import protocol as p
from gpushare.node.keep.recovery import JOURNAL_FILE, STATE_FILE
from tests.node.harness import G, InProcessNode, in_process

HUGE = 2**64  # what the wire (msgpack, 64 bits) cannot carry


async def stopped_then_started(node: InProcessNode, edit) -> None:
    """Stop the node, let ``edit(state dict) -> journal text`` change its files, start
    another on them."""
    await node.node.stop()
    state_path = node.dir / STATE_FILE
    state = json.loads(state_path.read_bytes())
    journal = edit(state)
    state_path.write_text(json.dumps(state))
    (node.dir / JOURNAL_FILE).write_text(journal)
    node.node = node._make()
    await node.node.start()


async def grant_works(node: InProcessNode, name: str) -> p.Grant:
    w = await node.workload(memory_limit=G, name=name)
    await w.send(p.Acquire())
    grant = await w.expect(p.Grant)
    assert 0 < grant.lease < 2**63
    w.close()  # gone: no record of it for the next node to wait for
    await node.until(lambda: not node.node.status().gpus[0].sessions)
    return grant


@in_process(mode="exclusive")
async def test_a_journal_line_with_a_lease_past_64_bits_does_not_stop_the_gpu(node, caplog):
    first = await grant_works(node, "before")

    def edit(state):
        return f"{state['generation']} 0 1 {HUGE}\n{state['generation']} 0 1 {-5}\n"

    with caplog.at_level(logging.WARNING, logger="gpushare.node"):
        await stopped_then_started(node, edit)
        after = await grant_works(node, "after")
    assert after.lease > first.lease
    assert "lease journal: 2 lines with figures out of bounds dropped" in caplog.text
    await node.restart()  # and the floor it saved is sane: the next node grants too
    assert (await grant_works(node, "again")).lease > after.lease


@in_process(mode="exclusive")
async def test_records_floors_and_ids_past_their_bounds_are_dropped_not_fatal(node, caplog):
    first = await grant_works(node, "before")

    def edit(state):
        state["lease_floor"] = [HUGE]
        state["next_session"] = HUGE * HUGE
        state["generation"] = -HUGE
        state["sessions"] = [
            {"id": 7, "gpu": 0, "pid": 1, "start_time": 1, "uid": 0, "limit": HUGE,
             "name": "huge"},
            {"id": HUGE, "gpu": 0, "pid": 1, "start_time": 1, "uid": 0, "limit": G,
             "name": "id"},
            {"id": 8, "gpu": 0, "pid": 1, "start_time": 1, "uid": 0, "limit": G,
             "name": "lease", "lease": HUGE},
        ]  # fmt: skip
        return ""

    with caplog.at_level(logging.WARNING, logger="gpushare.node"):
        await stopped_then_started(node, edit)
        after = await grant_works(node, "after")
    assert after.lease > 0
    for words in ("session record 7 dropped: limit", "session record 18446744073709551616",
                  "session record 8 dropped: lease", "lease floor of GPU 0",
                  "next session id", "records' generation"):  # fmt: skip
        assert words in caplog.text, words
    assert not node.node.status().gpus[0].recovering
    assert first.lease  # (the lease numbers start again from the records: none left)

"""What ``gpushare ctl status`` says (issue 25), against a node in process on virtual
time: a waiting session's wait as it goes on, and memory in use told apart from what is
resident."""

from __future__ import annotations

import asyncio
import io
import re

from gpushare import protocol as p
from gpushare.tools.ctl import show_status
from tests.node.harness import G, InProcessNode, in_process


def shown(node: InProcessNode) -> str:
    text = io.StringIO()
    show_status(node.node.status(), text)
    return text.getvalue()


@in_process(mode="exclusive", tq=60)
async def test_a_waiting_session_shows_its_wait_as_it_goes_on(node: InProcessNode) -> None:
    a = await node.workload(memory_limit=10 * G, name="a")
    b = await node.workload(memory_limit=2 * G, name="b")
    await a.send(p.Acquire())
    await a.expect(p.Grant)
    await b.send(p.Acquire())
    await asyncio.sleep(15)  # virtual: b has waited 15 s, behind a's 60 s quantum
    rows = {line.split()[1]: line for line in shown(node).splitlines() if line[:6].strip()}
    assert re.search(r"\bwaiting 1[45]\.\d s\b", rows["b"]), rows["b"]
    assert " holding " in rows["a"]
    await asyncio.sleep(10)  # virtual: 10 s more
    (row,) = [line for line in shown(node).splitlines() if " b " in line]
    assert re.search(r"\bwaiting 2[45]\.\d s\b", row), row


@in_process(mode="exclusive", tq=60)
async def test_the_header_says_holders_are_counted_at_their_limits(node: InProcessNode) -> None:
    a = await node.workload(memory_limit=10 * G, name="a")
    await a.send(p.Acquire())
    await a.expect(p.Grant)
    header = shown(node).splitlines()[0]
    # 10 GiB in use while the row says RESIDENT 0 B: the header says why
    assert "in use 10.0 GiB of 16.0 GiB (holders counted at their bounds; resident 0 B)" in header

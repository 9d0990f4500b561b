"""The typed events and the contract's table of them (docs/contract.md "Events") say the
same: every kind the code has is a row there, with every field the code writes."""

from __future__ import annotations

import re
from pathlib import Path

from gpushare.core.actions import EventAction
from gpushare.core.arbiter import Arbiter
from gpushare.core.attach import AttachRecord
from gpushare.core.clock import ManualClock
from gpushare.core.events import KINDS, Grant, Release, record
from gpushare.settings import GpuSettings

CONTRACT = Path(__file__).parents[2] / "docs" / "contract.md"
GiB = 2**30


def contract_rows() -> dict[str, set[str]]:
    """Each event kind of the contract's table, and the names its fields column quotes."""
    text = CONTRACT.read_text()
    table = text.split("## Events", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, set[str]] = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        for kind in re.findall(r"`(\w+)`", cells[0]):
            rows[kind] = set(re.findall(r"`(\w+)`", cells[1]))
    return rows


def test_every_kind_is_a_row_of_the_contract_with_its_fields() -> None:
    rows = contract_rows()
    assert {k.kind for k in KINDS} == set(rows), "kinds in code and contract differ"
    for k in KINDS:
        names = {f for f in k.__dataclass_fields__ if f not in ("session", "kind")}
        assert names <= rows[k.kind], f"{k.kind}: not in the contract: {names - rows[k.kind]}"


def test_a_field_that_is_not_set_is_not_written() -> None:
    rec = record(Release(session=3, lease=7, seconds=0.5, reason="burst_end"), ts=1.0, gpu=0)
    assert rec == {
        "ts": 1.0,
        "gpu": 0,
        "event": "release",
        "session": 3,
        "lease": 7,
        "seconds": 0.5,
        "reason": "burst_end",
    }
    g = Grant(session=1, lease=1, wait_seconds=0, swap_in_bytes=0, quantum_s=1, shared=False)
    assert "turn" not in record(g, ts=0, gpu=1) and record(g, ts=0, gpu=1)["shared"] is False


def test_what_the_arbiter_emits_is_what_the_contract_names(clock: ManualClock) -> None:
    # A handoff with a swap, a turn, a window and a config change: every record's kind is a
    # row, and each of its fields is named there.
    rows = contract_rows()
    a = Arbiter(0, 10 * GiB, clock, GpuSettings(tq_s=1, mode="exclusive"))
    out = a.attach(1, AttachRecord(name="a", memory_limit=6 * GiB))
    out += a.attach(2, AttachRecord(name="b", memory_limit=6 * GiB))
    out += a.acquire(1) + a.report(1, resident=6 * GiB, swapped=0) + a.acquire(2)
    clock.advance(1.5)
    out += a.tick()
    out += a.release(1, resident=0, swapped=6 * GiB, again=True, swapped_out=6 * GiB, seconds=1)
    out += a.set_config({"tq_s": 2.0}) + a.detach(2)
    recs = [x.record for x in out if isinstance(x, EventAction)]
    assert {r["event"] for r in recs} >= {"attach", "grant", "revoke", "release", "swap_out"}
    for r in recs:
        extra = set(r) - {"ts", "gpu", "event", "session"} - rows[r["event"]]
        assert not extra, f"{r['event']}: {extra}"

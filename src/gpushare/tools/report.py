"""Per-session figures from an event stream (the demo's table, the benchmarks)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class SessionFigures:
    id: int
    name: str = ""
    gpu: int = 0
    lease_s: float = 0.0
    grants: int = 0
    revokes: int = 0
    waits: list[float] = field(default_factory=list)
    swap_outs: int = 0
    swap_ins: int = 0
    swap_out_bytes: int = 0
    swap_in_bytes: int = 0
    swap_s: float = 0.0


@dataclass
class Figures:
    sessions: dict[int, SessionFigures]
    start: float
    end: float

    @property
    def span_s(self) -> float:
        return max(self.end - self.start, 1e-9)


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """Events from a JSON-lines log; a torn last line (a node killed mid-write) is skipped."""
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def figures(events: Iterable[dict[str, Any]]) -> Figures:
    sessions: dict[int, SessionFigures] = {}
    start, end = float("inf"), float("-inf")
    for e in events:
        start, end = min(start, e["ts"]), max(end, e["ts"])
        sid = e.get("session")
        if sid is None:
            continue
        f = sessions.setdefault(sid, SessionFigures(sid, gpu=e["gpu"]))
        kind = e["event"]
        if kind == "attach":
            f.name = e.get("name", "")
        elif kind == "grant":
            f.grants += 1
            f.waits.append(e["wait_seconds"])
        elif kind == "release":
            f.lease_s += e["seconds"]
        elif kind == "revoke":
            f.revokes += 1
        elif kind == "swap_out" and not e.get("error"):
            f.swap_outs += 1
            f.swap_out_bytes += e["bytes"]
            f.swap_s += e["seconds"]
        elif kind == "swap_in" and not e.get("error"):
            f.swap_ins += 1
            f.swap_in_bytes += e["bytes"]
            f.swap_s += e["seconds"]
    if start > end:
        start = end = 0.0
    return Figures(sessions, start, end)


@dataclass
class Switches:
    """Handoffs that moved memory: from a revoke to the next session swapped in."""

    seconds: list[float]
    overlapped: int  # grants made while the last holder still swapped out (with a room)


def switches(events: Iterable[dict[str, Any]]) -> Switches:
    evs = list(events)
    ins = [e for e in evs if e["event"] == "swap_in" and e.get("bytes") and not e.get("error")]
    out = []
    for r in (e for e in evs if e["event"] == "revoke"):
        nxt = next((e for e in ins if e["ts"] > r["ts"] and e["gpu"] == r["gpu"]), None)
        if nxt is not None and nxt["session"] != r["session"]:
            out.append(nxt["ts"] - r["ts"])
    rooms = sum(1 for e in evs if e["event"] == "grant" and e.get("room_bytes"))
    return Switches(out, rooms)

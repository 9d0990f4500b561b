"""``gpushare top``: a live view of GPUs and sessions over the admin socket.

This module holds what every form of the view shares: the share of GPU time per session
(:class:`ShareTracker`), the rows and their sort orders, the plain-text frame
(``--once``, and whenever stdin or stdout is not a terminal) and the JSON frame
(``--once --json``). The live view in a terminal is :mod:`gpushare.tools.top_ui`, drawn
with urwid (the ``cli`` extra): colour, sort keys, scrolling, a session's details,
resizing.
"""

from __future__ import annotations

import json
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, TextIO

from gpushare.errors import GpushareError
from gpushare.status import NodeStatus, SessionStatus
from gpushare.tools.admin import AdminClient

WINDOW_S = 60.0
BAR = 12
NAME_W = 18  # the plain frame's name column at 80 columns (longer names end in "…")


class ShareTracker:
    """Share of GPU time per session over the last minute, from successive snapshots."""

    def __init__(self, window: float = WINDOW_S) -> None:
        self.window = window
        self.hist: deque[tuple[float, dict[tuple[int, int], float]]] = deque()

    def update(self, t: float, status: NodeStatus) -> dict[tuple[int, int], float]:
        now = {(g.index, s.id): s.lease_seconds_total for g in status.gpus for s in g.sessions}
        self.hist.append((t, now))
        while len(self.hist) > 2 and t - self.hist[1][0] >= self.window:
            self.hist.popleft()
        t0, then = self.hist[0]
        shares = {}
        for g in status.gpus:
            for s in g.sessions:
                k = (g.index, s.id)
                if s.attached_seconds <= self.window or k not in then or t - t0 < 0.2:
                    # attached within the window (or no history yet): since it attached
                    shares[k] = s.lease_seconds_total / max(s.attached_seconds, 1e-9)
                else:  # over the history this view has, up to the window
                    shares[k] = (now[k] - then[k]) / (t - t0)
        return shares


@dataclass
class Row:
    """One session as every form of the view shows it."""

    gpu: int
    id: int
    who: str  # namespace/pod when the kernel confirms one, else the session's name
    name: str
    state: str
    share: float
    wait_seconds_p95: float
    resident_bytes: int
    swapped_bytes: int
    memory_limit_bytes: int
    swap_out_total: int
    swap_in_total: int


_STATE_ORDER = {"holding": 0, "yielding": 1, "waiting": 2, "idle": 3}
# Sort orders: the key, then whether the largest comes first.
SORTS: dict[str, tuple[Callable[[Row], Any], bool]] = {
    "share": (lambda r: r.share, True),
    "name": (lambda r: (r.who.lower(), r.id), False),
    "state": (lambda r: (_STATE_ORDER.get(r.state, 9), r.id), False),
    "wait": (lambda r: r.wait_seconds_p95, True),
    "memory": (lambda r: r.resident_bytes + r.swapped_bytes, True),
    "id": (lambda r: r.id, False),
}


def rows(
    status: NodeStatus,
    shares: dict[tuple[int, int], float],
    sort: str = "id",
    reverse: bool = False,
) -> dict[int, list[Row]]:
    """Each GPU's rows, sorted."""
    key, largest_first = SORTS[sort]
    out = {}
    for g in status.gpus:
        rs = [
            Row(
                gpu=g.index,
                id=s.id,
                who=who(s),
                name=s.name,
                state=s.state,
                share=shares.get((g.index, s.id), 0.0),
                wait_seconds_p95=s.wait_seconds_p95,
                resident_bytes=s.resident_bytes,
                swapped_bytes=s.swapped_bytes,
                memory_limit_bytes=s.memory_limit_bytes,
                swap_out_total=s.swap_out_total,
                swap_in_total=s.swap_in_total,
            )
            for s in g.sessions
        ]
        out[g.index] = sorted(rs, key=key, reverse=largest_first != reverse)
    return out


def who(s: SessionStatus) -> str:
    if s.pod:
        who = f"{s.namespace}/{s.pod}" if s.namespace else s.pod
        return who if s.identity_verified else f"{who}?"  # ?: the workload's word
    claimed = s.claimed.pod
    return f"{claimed}?" if claimed else s.name  # ?: claimed, not verified


def cut(text: str, width: int) -> str:
    """``text`` in ``width`` columns: whole, or cut with a mark (never silently)."""
    return text if len(text) <= width else text[: max(width - 1, 0)] + "…"


def bar(resident: int, swapped: int, limit: int, width: int = BAR) -> str:
    r = round(width * resident / limit) if limit else 0
    w = min(round(width * swapped / limit) if limit else 0, width - r)
    return "[" + "#" * r + "~" * w + "." * (width - r - w) + "]"


def gib(r: Row) -> str:
    return f"{r.resident_bytes / 2**30:.1f}/{r.memory_limit_bytes / 2**30:.1f}"


def gpu_line(status: NodeStatus, index: int) -> str:
    g = next(x for x in status.gpus if x.index == index)
    sim = " [SIMULATED]" if g.simulated else ""
    return (
        f"GPU {g.index} {g.name}{sim} {g.mode}/{g.policy} TQ {g.tq_s:g}s"
        f" mem {g.used_bytes / 2**30:.0f}/{g.usable_bytes / 2**30:.0f}G"
    )


def holders_line(status: NodeStatus, index: int) -> str:
    """Who holds and who waits; the ranks of a distributed job (a gang: one holder)
    together, as ``job [rank, rank]`` (a parked rank, yielded before its peers, in
    parentheses)."""
    g = next(x for x in status.gpus if x.index == index)
    by_id = {s.id: s for s in g.sessions}

    def names(ids: list[int]) -> str:
        out: list[str | list[str]] = []  # a name, or a gang's ranks (filled in below)
        jobs: dict[str, list[str]] = {}
        for i in ids:
            s = by_id.get(i)
            if s is None or not s.gang:
                out.append(str(i) if s is None else who(s))
                continue
            if s.gang not in jobs:  # where the job first shows
                jobs[s.gang] = [s.gang.split("@")[0]]
                out.append(jobs[s.gang])
            jobs[s.gang].append(f"({who(s)})" if s.parked else who(s))
        return ", ".join(x if isinstance(x, str) else f"{x[0]} [{', '.join(x[1:])}]" for x in out)

    return f"holder: {names(g.holders) or '-'}   queue: {names(g.queue) or '-'}"


HEADER = (
    f"{'SESSION':<{NAME_W}} {'STATE':<9} {'SHARE':>6} {'WAITp95':>7}"
    f" {'MEM #res ~swp':<{BAR + 2}} {'GiB res/lim':>11} {'OUT/IN':>7}"
)


def render(status: NodeStatus, shares: dict[tuple[int, int], float], width: int) -> list[str]:
    """The plain-text frame (``--once``): fits ``width`` columns (at least 80); a name too
    long for its column ends in "…"."""
    width = max(width, 80)
    name_w = NAME_W + width - 80
    lines = [f"gpushare top  {time.strftime('%H:%M:%S')}  node pid {status.node.pid}"]
    by_gpu = rows(status, shares)
    for g in status.gpus:
        lines += ["", cut(gpu_line(status, g.index), width)]
        lines.append(cut("  " + holders_line(status, g.index), width))
        lines.append(cut(f"  {'SESSION':<{name_w}}" + HEADER[NAME_W:], width))
        for r in by_gpu[g.index]:
            lines.append(
                f"  {cut(r.who, name_w):<{name_w}} {r.state:<9} {r.share:>6.1%}"
                f" {r.wait_seconds_p95:>6.2f}s"
                f" {bar(r.resident_bytes, r.swapped_bytes, r.memory_limit_bytes)}"
                f" {gib(r):>11} {r.swap_out_total:>3}/{r.swap_in_total:<3}"
            )
        if not g.sessions:
            lines.append("  no sessions")
    return lines


def frame_json(status: NodeStatus, shares: dict[tuple[int, int], float]) -> dict[str, Any]:
    """``top --once --json``: the frame's figures, SHARE included (the status JSON has the
    rest: ``ctl status --json``)."""
    by_gpu = rows(status, shares)
    return {
        "time": time.time(),
        "node": {"pid": status.node.pid},
        "gpus": [
            {
                "index": g.index,
                "name": g.name,
                "simulated": g.simulated,
                "mode": g.mode,
                "policy": g.policy,
                "tq_s": g.tq_s,
                "used_bytes": g.used_bytes,
                "usable_bytes": g.usable_bytes,
                "holders": g.holders,
                "queue": g.queue,
                "sessions": [asdict(r) for r in by_gpu[g.index]],
            }
            for g in status.gpus
        ],
    }


def run_top(
    path: str | None,
    once: bool,
    interval: float = 0.5,
    out: TextIO = sys.stdout,
    as_json: bool = False,
) -> int:
    terminal = sys.stdin.isatty() and out.isatty()
    if as_json and not once:
        raise GpushareError("--json prints one frame: use it with --once")
    with AdminClient(path) as client:
        st = client.status()
        if once or not terminal:
            # A pipe or a file is not a screen: one frame, as `top -b -n 1` prints
            shares = ShareTracker().update(time.monotonic(), st)
            if as_json:
                out.write(json.dumps(frame_json(st, shares), indent=2) + "\n")
            else:
                import shutil

                width = shutil.get_terminal_size((80, 24)).columns if terminal else 80
                out.write("\n".join(render(st, shares, width)) + "\n")
            if not once:
                print(
                    "gpushare top: not a terminal: one frame printed (--once);"
                    " run it in a terminal for the live view",
                    file=sys.stderr,
                )
            return 0
        try:
            from gpushare.tools.top_ui import live
        except ImportError:
            raise GpushareError(
                "the live view needs urwid: pip install 'gpushare[cli]' (or --once for one frame)"
            ) from None
        return live(client, interval)

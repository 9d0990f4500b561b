"""What every form of ``gpushare top`` shows, as data: the share of GPU time per session
(:class:`ShareTracker`), the rows (:class:`Row`) and their sort orders (:data:`SORTS`),
and the pieces of text both the plain frame (:mod:`gpushare.tools.top`) and the live
view (:mod:`gpushare.tools.top_ui`) draw. Both import this module, neither the other's
internals (the live view is only started by ``top``)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpushare.status import NodeStatus, SessionStatus

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
    memory_request_bytes: int
    reclaimed_bytes_total: int
    swap_out_total: int
    swap_in_total: int
    # its interactive turns' figures (docs/scheduling.md 3): the JSON frame and the
    # live view's details show them
    turn_credit_seconds: float = 0.0
    usual_burst_seconds: float = 0.0


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
                memory_request_bytes=s.memory_request_bytes or s.memory_limit_bytes,
                reclaimed_bytes_total=s.reclaimed_bytes_total,
                swap_out_total=s.swap_out_total,
                swap_in_total=s.swap_in_total,
                turn_credit_seconds=s.turn_credit_seconds,
                usual_burst_seconds=s.usual_burst_seconds,
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


def bar(resident: int, swapped: int, limit: int, width: int = BAR, request: int = 0) -> str:
    """Resident (#), swapped (~) and free (.) of the limit; a request below the limit
    is a | where the bar's free part crosses it (what is beyond it is lent)."""
    r = round(width * resident / limit) if limit else 0
    w = min(round(width * swapped / limit) if limit else 0, width - r)
    cells = list("#" * r + "~" * w + "." * (width - r - w))
    q = round(width * request / limit) if limit and 0 < request < limit else 0
    if 0 < q < width and cells[q] == ".":
        cells[q] = "|"
    return "[" + "".join(cells) + "]"


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

"""``gpushare timeline``: who held each GPU when, from the event log (a Gantt chart)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WIDTH_IN, DPI = 12.0, 100
ROW_IN, MARGIN_IN = 0.4, 1.6


@dataclass
class Lane:
    gpu: int
    session: int
    name: str
    leases: list[tuple[float, float]] = field(default_factory=list)
    swaps: list[tuple[float, float, str]] = field(default_factory=list)  # start, dur, dir


def lanes(events: Iterable[dict[str, Any]]) -> tuple[list[Lane], float, float]:
    """Leases and swaps per session, from events sorted by time."""
    out: dict[tuple[int, int], Lane] = {}
    open_lease: dict[tuple[int, int], float] = {}
    t0, t1 = float("inf"), float("-inf")
    for e in sorted(events, key=lambda e: e["ts"]):
        t0, t1 = min(t0, e["ts"]), max(t1, e["ts"])
        if "session" not in e:
            continue
        k = (e["gpu"], e["session"])
        lane = out.setdefault(k, Lane(e["gpu"], e["session"], f"session {e['session']}"))
        kind = e["event"]
        if kind == "attach":
            lane.name = e.get("name") or lane.name
        elif kind == "grant":
            open_lease[k] = e["ts"]
        elif kind in ("release", "detach") and k in open_lease:
            lane.leases.append((open_lease.pop(k), e["ts"]))
        elif kind in ("swap_out", "swap_in") and e.get("bytes"):
            dur = e.get("seconds", 0.0)
            lane.swaps.append((e["ts"] - dur, dur, kind[5:]))
    for k, start in open_lease.items():  # still holding at the end of the log
        out[k].leases.append((start, t1))
    if t0 > t1:
        t0 = t1 = 0.0
    return sorted(out.values(), key=lambda ln: (ln.gpu, ln.session)), t0, t1


def figure_size_px(rows: int) -> tuple[int, int]:
    return int(WIDTH_IN * DPI), int((MARGIN_IN + ROW_IN * max(rows, 1)) * DPI)


def plot(events: Iterable[dict[str, Any]], out: str | Path, title: str = "") -> tuple[int, int]:
    """Write the chart as PNG; returns its size in pixels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, t0, t1 = lanes(events)
    w, h = figure_size_px(len(rows))
    fig, ax = plt.subplots(figsize=(w / DPI, h / DPI), dpi=DPI)
    colors = plt.get_cmap("tab10")
    for i, ln in enumerate(rows):
        ax.broken_barh(
            [(a - t0, b - a) for a, b in ln.leases],
            (i - 0.35, 0.7),
            facecolors=colors(i % 10),
            label=None,
        )
        for start, dur, d in ln.swaps:
            ax.broken_barh(
                [(start - t0, max(dur, (t1 - t0) / 500))],
                (i + 0.38, 0.12),
                facecolors="black" if d == "out" else "grey",
            )
    ax.set_yticks(range(len(rows)), [f"GPU {ln.gpu}: {ln.name}" for ln in rows])
    ax.set_ylim(-0.6, max(len(rows), 1) - 0.4)
    ax.invert_yaxis()
    ax.set_xlim(0, max(t1 - t0, 1e-3))
    ax.set_xlabel("seconds (bars: leases; ticks below: swap out black, swap in grey)")
    ax.set_title(title or "gpushare: who held each GPU when")
    ax.grid(axis="x", alpha=0.3)
    fig.subplots_adjust(left=0.2, right=0.98, top=1 - 0.45 / (h / DPI), bottom=0.7 / (h / DPI))
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
    return w, h

"""``gpushare timeline``: who held each GPU when, from the event log (a Gantt chart).

One lane per session, labelled with its name and session id (five programs named
``mnist`` are five lanes told apart), on a wall-clock axis. By default the last
:data:`DEFAULT_WINDOW_S` of the log are drawn, and a lease is at least
:data:`MIN_BAR` of the axis wide, so a lease of a fraction of a second still shows.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

WIDTH_IN, DPI = 12.0, 100
ROW_IN, MARGIN_IN = 0.4, 1.6
DEFAULT_WINDOW_S = 300.0  # the last five minutes: sub-second leases stay readable
MIN_BAR = 1 / 300  # of the axis: about 3 pixels


@dataclass
class Lane:
    gpu: int
    session: int
    name: str
    leases: list[tuple[float, float]] = field(default_factory=list)
    swaps: list[tuple[float, float, str]] = field(default_factory=list)  # start, dur, dir

    @property
    def label(self) -> str:
        """``GPU 0  mnist #3``: the name a person knows, the id that tells lanes apart."""
        return f"GPU {self.gpu}  {self.name} #{self.session}"


def lanes(
    events: Iterable[dict[str, Any]], window_s: float = 0.0
) -> tuple[list[Lane], float, float]:
    """Leases and swaps per session, from events sorted by time; with ``window_s``, only
    the last ``window_s`` seconds of them (leases cut at the window's start)."""
    out: dict[tuple[int, int], Lane] = {}
    open_lease: dict[tuple[int, int], float] = {}
    t0, t1 = float("inf"), float("-inf")
    for e in sorted(events, key=lambda e: e["ts"]):
        t0, t1 = min(t0, e["ts"]), max(t1, e["ts"])
        if e.get("session") is None:
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
    rows = sorted(out.values(), key=lambda ln: (ln.gpu, ln.session))
    if window_s > 0 and t1 - t0 > window_s:
        t0 = t1 - window_s
        rows = _cut(rows, t0)
    return rows, t0, t1


def _cut(rows: list[Lane], t0: float) -> list[Lane]:
    """The lanes from ``t0`` on: leases cut at it, those with nothing left after it gone."""
    for ln in rows:
        ln.leases = [(max(a, t0), b) for a, b in ln.leases if b >= t0]
        ln.swaps = [s for s in ln.swaps if s[0] + s[1] >= t0]
    return [ln for ln in rows if ln.leases or ln.swaps]


def bars(spans: Iterable[tuple[float, float]], t0: float, t1: float) -> list[tuple[float, float]]:
    """(start, width) in seconds for each span, at least :data:`MIN_BAR` of the axis."""
    least = max(t1 - t0, 1e-3) * MIN_BAR
    return [(a, max(b - a, least)) for a, b in spans]


def figure_size_px(rows: int) -> tuple[int, int]:
    return int(WIDTH_IN * DPI), int((MARGIN_IN + ROW_IN * max(rows, 1)) * DPI)


def figure(rows: list[Lane], t0: float, t1: float, title: str = "", whole_s: float = 0.0) -> Figure:
    """The chart: lanes on a wall-clock axis (local time)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    # x: seconds since the local midnight before t0, so ticks fall on round clock times
    midnight = datetime.fromtimestamp(t0).replace(hour=0, minute=0, second=0, microsecond=0)
    origin = midnight.timestamp()

    def x(ts: float) -> float:
        return ts - origin

    w, h = figure_size_px(len(rows))
    fig, ax = plt.subplots(figsize=(w / DPI, h / DPI), dpi=DPI)
    colors = plt.get_cmap("tab10")
    for i, ln in enumerate(rows):
        ax.broken_barh(
            [(x(a), width) for a, width in bars(ln.leases, t0, t1)],
            (i - 0.35, 0.7),
            facecolors=colors(i % 10),
        )
        swaps = bars(((s, s + d) for s, d, _ in ln.swaps), t0, t1)
        for (start, width), (_, _, d) in zip(swaps, ln.swaps, strict=True):
            ax.broken_barh(
                [(x(start), width)],
                (i + 0.38, 0.12),
                facecolors="black" if d == "out" else "grey",
            )
    ax.set_yticks(range(len(rows)), [ln.label for ln in rows])
    ax.set_ylim(-0.6, max(len(rows), 1) - 0.4)
    ax.invert_yaxis()
    ax.set_xlim(x(t0), x(max(t1, t0 + 1e-3)))
    tenths = t1 - t0 < 30  # ticks less than a second apart: say which part of it

    def clock(num: float, _pos: object = None) -> str:
        t = datetime.fromtimestamp(origin + num)
        return t.strftime("%H:%M:%S") + (f".{t.microsecond // 100_000}" if tenths else "")

    ax.xaxis.set_major_locator(MaxNLocator(nbins=10, steps=[1, 2, 3, 5, 6, 10]))
    ax.xaxis.set_major_formatter(FuncFormatter(clock))
    zone = datetime.fromtimestamp(t0).astimezone().tzname() or "local"
    ax.set_xlabel(
        f"time ({zone}; {datetime.fromtimestamp(t0):%Y-%m-%d})   bars: leases;"
        " ticks below: swap out black, swap in grey"
    )
    shown = _span(t1 - t0)
    if whole_s > (t1 - t0) * 1.01:
        shown = f"the last {shown} of {_span(whole_s)}; --window to change"
    ax.set_title(title or f"gpushare: who held each GPU when ({shown})")
    ax.grid(axis="x", alpha=0.3)
    fig.subplots_adjust(left=0.2, right=0.98, top=1 - 0.45 / (h / DPI), bottom=0.7 / (h / DPI))
    return fig


def _span(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 120 else f"{seconds:.1f} s"


def plot(
    events: Iterable[dict[str, Any]],
    out: str | Path,
    title: str = "",
    window_s: float = DEFAULT_WINDOW_S,
) -> tuple[int, int]:
    """Write the chart as PNG (the last ``window_s`` seconds; 0: all); its size in pixels."""
    import matplotlib.pyplot as plt

    evs = list(events)
    rows, t0, t1 = lanes(evs, window_s)
    whole = max(e["ts"] for e in evs) - min(e["ts"] for e in evs) if evs else 0.0
    fig = figure(rows, t0, t1, title, whole)
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
    return figure_size_px(len(rows))

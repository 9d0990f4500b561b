"""``gpushare top``'s live view in a terminal, drawn with urwid (the ``cli`` extra, never
imported by a workload): colour by state, sort keys, scrolling, a session's details, and
a layout that follows the terminal's size.

Keys: arrows, PgUp/PgDn, Home/End move and scroll; Enter shows the focused session's
details (Esc, Enter or Backspace go back); ``s`` sorts by the next column, ``1``-``6``
by one column, ``r`` reverses; ``h`` or ``?`` help; ``q`` quits.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import msgspec
import urwid

from gpushare.errors import GpushareError
from gpushare.status import NodeStatus, SessionStatus
from gpushare.tools.admin import AdminClient
from gpushare.tools.top_model import (
    BAR,
    SORTS,
    Row,
    ShareTracker,
    bar,
    gib,
    gpu_line,
    holders_line,
    rows,
)
from gpushare.units import format_size

PALETTE = [
    ("header", "black", "light gray"),
    ("footer", "black", "light gray"),
    ("gpu", "white,bold", ""),
    ("sim", "yellow,bold", ""),
    ("colhead", "light gray,underline", ""),
    ("holding", "light green,bold", ""),
    ("yielding", "light magenta", ""),
    ("waiting", "yellow", ""),
    ("idle", "light gray", ""),
    ("resident", "light green", ""),
    ("swapped", "yellow", ""),
    ("focus", "black", "light cyan"),
    ("error", "light red,bold", ""),
]
SORT_KEYS = list(SORTS)  # s cycles through them in this order; 1-6 pick one
BACK_KEYS = ("esc", "enter", "backspace", "left")  # from a session's details to the list
# Fixed columns after the name: (title, width, right-aligned)
COLUMNS = [
    ("ID", 4, True),
    ("STATE", 9, False),
    ("SHARE", 6, True),
    ("WAITp95", 7, True),
    ("MEM #res ~swp", BAR + 2, False),
    ("GiB res/lim", 11, True),
    ("OUT/IN", 7, False),
]
HELP = """\
gpushare top: a live view of the node's GPUs and sessions

  Up/Down, PgUp/PgDn, Home/End   move through the sessions (the list scrolls)
  Enter                          the focused session's details (Esc goes back)
  s                              sort by the next column: share, name, state, wait,
                                 memory, id;  1-6 pick one;  r reverses
  h or ?                         this help (any key goes back)
  q                              quit

SHARE: the session's share of GPU time over the last minute (since it attached, when
younger). MEM: # resident on the GPU, ~ swapped to host memory, . free, of its limit;
| its request, where below the limit (beyond it, memory is lent while free).
A name too long for its column ends in "…": widen the terminal, or press Enter.
"""


class SessionRow(urwid.WidgetWrap[urwid.AttrMap[urwid.Columns]]):
    """A selectable line: one session."""

    def __init__(self, r: Row) -> None:
        self.row = r
        name = urwid.Text(r.who, wrap="ellipsis")
        resident = (
            round(BAR * r.resident_bytes / r.memory_limit_bytes) if r.memory_limit_bytes else 0
        )
        swapped = min(
            round(BAR * r.swapped_bytes / r.memory_limit_bytes) if r.memory_limit_bytes else 0,
            BAR - resident,
        )
        mem = bar(
            r.resident_bytes, r.swapped_bytes, r.memory_limit_bytes, request=r.memory_request_bytes
        )
        mem_markup: list[Any] = [
            "[",
            ("resident", mem[1 : 1 + resident]),
            ("swapped", mem[1 + resident : 1 + resident + swapped]),
            mem[1 + resident + swapped :],
        ]
        cells: list[Any] = [
            f"{r.id}",
            (r.state, r.state),
            f"{r.share:.1%}",
            f"{r.wait_seconds_p95:.2f}s",
            mem_markup,
            gib(r),
            f"{r.swap_out_total}/{r.swap_in_total}",
        ]
        cols: list[Any] = [("weight", 1, name)]
        for (_, width, right), cell in zip(COLUMNS, cells, strict=True):
            cols.append(("fixed", width, urwid.Text(cell, align="right" if right else "left")))
        focus = {name: "focus" for name, *_ in PALETTE}  # one highlight, whole line
        focus[None] = "focus"  # type: ignore[index]
        super().__init__(urwid.AttrMap(urwid.Columns(cols, dividechars=1), None, focus))

    def selectable(self) -> bool:
        return True

    def keypress(self, size: tuple[()] | tuple[int] | tuple[int, int], key: str) -> str | None:
        return key


def header_columns(what: str) -> urwid.Columns:
    cols: list[Any] = [("weight", 1, urwid.Text(what))]
    for title, width, right in COLUMNS:
        cols.append(("fixed", width, urwid.Text(title, align="right" if right else "left")))
    return urwid.Columns(cols, dividechars=1)


def gpu_heading(st: NodeStatus, index: int) -> list[urwid.Widget]:
    """A GPU's lines above its sessions: its figures (a simulated GPU said so in colour),
    who holds it, and the column titles."""
    line = gpu_line(st, index)
    sim = " [SIMULATED]"
    markup: list[Any] = (
        [("gpu", line.split(sim)[0]), ("sim", sim), ("gpu", line.split(sim)[1])]
        if sim in line
        else [("gpu", line)]
    )
    return [
        urwid.Text(markup),
        urwid.Text("  " + holders_line(st, index)),
        urwid.AttrMap(header_columns("SESSION"), "colhead"),
    ]


def detail_lines(g: int, s: SessionStatus) -> list[urwid.Widget]:
    """Every field of the session's status, sizes also in binary units."""
    out: list[urwid.Widget] = [
        urwid.Text(("gpu", f"GPU {g}  session {s.id}  {s.name}")),
        urwid.Text(("colhead", "Esc, Enter or Backspace: back to the list")),
        urwid.Divider(),
    ]
    for key, value in msgspec.structs.asdict(s).items():
        if isinstance(value, msgspec.Struct):
            value = msgspec.to_builtins(value)
        shown = f"{value}"
        if key.endswith("_bytes") and isinstance(value, int):
            shown = f"{value}  ({format_size(value)})"
        elif isinstance(value, float):
            shown = f"{value:.3f}"
        style = s.state if key == "state" else None
        out.append(urwid.Text([f"{key:<30} ", (style, shown) if style else shown]))
    return out


class TopView:
    def __init__(self, client: AdminClient, interval: float) -> None:
        self.client = client
        self.interval = interval
        self.tracker = ShareTracker()
        self.sort = "share"
        self.reverse = False
        self.detail: tuple[int, int] | None = None  # (gpu, session) shown in detail
        self.fresh = False  # the detail view was just opened: from its top
        self.helping = False
        self.error = ""
        self.status: NodeStatus | None = None
        self.shares: dict[tuple[int, int], float] = {}
        self.header = urwid.Text("")
        self.footer = urwid.Text("")
        self.walker: urwid.SimpleFocusListWalker[Any] = urwid.SimpleFocusListWalker([])
        self.listbox = urwid.ListBox(self.walker)
        self.frame = urwid.Frame(
            self.listbox,
            header=urwid.AttrMap(self.header, "header"),
            footer=urwid.AttrMap(self.footer, "footer"),
        )

    # --- data ---------------------------------------------------------------------

    def refresh(self) -> None:
        self.status = self.client.status()
        self.shares = self.tracker.update(time.monotonic(), self.status)
        self.draw()

    def tick(self, loop: urwid.MainLoop, _data: object = None) -> None:
        try:
            self.refresh()
        except GpushareError as e:
            self.error = str(e)
            raise urwid.ExitMainLoop() from None
        loop.set_alarm_in(self.interval, self.tick)

    # --- drawing ------------------------------------------------------------------

    def focused(self) -> tuple[int, int] | None:
        w = self.walker.get_focus()[0] if self.walker else None
        return (w.row.gpu, w.row.id) if isinstance(w, SessionRow) else None

    def chosen(self) -> tuple[int, int] | None:
        """The session Enter opens: the focused row, or the first row below a focused heading.

        Home scrolls to position 0 (the GPU's heading); Enter there, before the next refresh moves
        the focus back onto a row, still means the row the user sees first.
        """
        if not self.walker:
            return None
        at = self.walker.focus or 0
        for w in self.walker[at:]:
            if isinstance(w, SessionRow):
                return (w.row.gpu, w.row.id)
        return None

    def draw(self) -> None:
        st = self.status
        if st is None:
            return
        arrow = "↑" if self.reverse else "↓"
        self.header.set_text(
            f"gpushare top  {time.strftime('%H:%M:%S')}  node pid {st.node.pid}"
            f"  sort: {self.sort} {arrow}"
        )
        if self.helping:
            self.footer.set_text(" any key: back   q: quit")
            self._show([urwid.Text(HELP)])
        elif not self._draw_detail(st):
            self._draw_list(st)

    def _draw_detail(self, st: NodeStatus) -> bool:
        """The detailed session's fields; False where none is shown (or it detached)."""
        if self.detail is None:
            return False
        g, sid = self.detail
        s = next((x for gs in st.gpus if gs.index == g for x in gs.sessions if x.id == sid), None)
        if s is None:
            self.detail = None  # it detached: back to the list
            return False
        self.footer.set_text(" Esc: back   Up/Down: scroll   q: quit")
        fresh, self.fresh = self.fresh, False
        self._show(detail_lines(g, s), 0 if fresh else None, keep=not fresh)
        return True

    def _draw_list(self, st: NodeStatus) -> None:
        """Each GPU with its sessions, the focus kept on the session it was on."""
        self.footer.set_text(" Enter: details   s/1-6: sort   r: reverse   h: help   q: quit")
        keep = self.focused()
        widgets: list[urwid.Widget] = []
        focus_at = first = None
        for index, rs in rows(st, self.shares, self.sort, self.reverse).items():
            widgets += gpu_heading(st, index)
            for r in rs:
                if keep == (r.gpu, r.id):
                    focus_at = len(widgets)
                if first is None:
                    first = len(widgets)
                widgets.append(SessionRow(r))
            if not rs:
                widgets.append(urwid.Text("  no sessions"))
            widgets.append(urwid.Divider())
        if focus_at is None:  # nothing focused yet (or it left): the first row, from the top
            self.walker[:] = widgets
            self.listbox.set_focus(first or 0, coming_from="above")
            return
        self._show(widgets, focus_at)

    def _show(
        self, widgets: list[urwid.Widget], focus_at: int | None = None, keep: bool = False
    ) -> None:
        old = self.walker.focus if keep and self.walker else None
        self.walker[:] = widgets
        if focus_at is not None:
            self.walker.set_focus(focus_at)
        elif old is not None and old < len(widgets):
            self.walker.set_focus(old)

    # --- keys ---------------------------------------------------------------------

    def key(self, key: str | tuple[str, int, int, int]) -> bool | None:
        if not isinstance(key, str):
            return None
        if key in ("q", "Q"):
            raise urwid.ExitMainLoop()
        if self.helping:
            self.helping = False
        elif self.detail is not None:
            if key in BACK_KEYS:
                self.detail = None
        else:
            action = self._list_actions().get(key)
            if action is None:
                return None
            action()
        self.draw()
        return True

    def _list_actions(self) -> dict[str, Callable[[], None]]:
        """What each key does on the list of sessions (any other is not the view's)."""
        by_column = {
            str(n): functools.partial(self._sort_by, name) for n, name in enumerate(SORT_KEYS, 1)
        }
        return {
            "h": self._open_help,
            "?": self._open_help,
            "enter": self._open_detail,
            "s": self._next_sort,
            "r": self._reverse,
            **by_column,
        }

    def _open_help(self) -> None:
        self.helping = True

    def _open_detail(self) -> None:
        self.detail, self.fresh = self.chosen(), True

    def _next_sort(self) -> None:
        self._sort_by(SORT_KEYS[(SORT_KEYS.index(self.sort) + 1) % len(SORT_KEYS)])

    def _sort_by(self, name: str) -> None:
        self.sort = name

    def _reverse(self) -> None:
        self.reverse = not self.reverse


def live(client: AdminClient, interval: float) -> int:
    view = TopView(client, interval)
    view.refresh()
    loop = urwid.MainLoop(view.frame, PALETTE, unhandled_input=view.key, handle_mouse=False)
    loop.set_alarm_in(interval, view.tick)
    try:
        loop.run()
    except KeyboardInterrupt:
        return 130
    if view.error:
        raise GpushareError(view.error)
    return 0

"""``gpushare top``: a live view of GPUs and sessions over the admin socket.

This module is the command: the plain-text frame (``--once``, and whenever stdin or
stdout is not a terminal), the JSON frame (``--once --json``), and the live view in a
terminal, :mod:`gpushare.tools.top_ui`, drawn with urwid (the ``cli`` extra): colour,
sort keys, scrolling, a session's details, resizing. What both forms show (the shares,
the rows, their sort orders) is :mod:`gpushare.tools.top_model`.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from typing import Any, TextIO

from gpushare.errors import GpushareError
from gpushare.status import NodeStatus
from gpushare.tools.admin import AdminClient
from gpushare.tools.top_model import (
    BAR,
    NAME_W,
    Row,
    ShareTracker,
    bar,
    cut,
    gib,
    gpu_line,
    holders_line,
    rows,
)

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
            mem = bar(
                r.resident_bytes,
                r.swapped_bytes,
                r.memory_limit_bytes,
                request=r.memory_request_bytes,
            )
            lines.append(
                f"  {cut(r.who, name_w):<{name_w}} {r.state:<9} {r.share:>6.1%}"
                f" {r.wait_seconds_p95:>6.2f}s"
                f" {mem}"
                f" {gib(r):>11} {r.swap_out_total:>3}/{r.swap_in_total:<3}"
            )
        if not g.sessions:
            lines.append("  no sessions")
        lines += turn_lines(by_gpu[g.index], width)
    return lines


def turn_lines(gpu_rows: list[Row], width: int) -> list[str]:
    """Its interactive turns' figures, one line per session that has any: the frame's
    columns are full at 80, and these say why a server takes turns or does not."""
    return [
        cut(
            f"  turns  {r.who}: credit {r.turn_credit_seconds:.2f} s,"
            f" usual burst {r.usual_burst_seconds:.2f} s",
            width,
        )
        for r in gpu_rows
        if r.turn_credit_seconds or r.usual_burst_seconds
    ]


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

"""``gpushare top``: a live view of GPUs and sessions over the admin socket."""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import sys
import termios
import time
import tty
from collections import deque
from collections.abc import Iterator
from typing import TextIO

from gpushare.status import NodeStatus, SessionStatus
from gpushare.tools.admin import AdminClient

WINDOW_S = 60.0
BAR = 12


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


def _bar(resident: int, swapped: int, limit: int, width: int = BAR) -> str:
    r = round(width * resident / limit) if limit else 0
    w = min(round(width * swapped / limit) if limit else 0, width - r)
    return "[" + "#" * r + "~" * w + "." * (width - r - w) + "]"


def render(status: NodeStatus, shares: dict[tuple[int, int], float], width: int) -> list[str]:
    width = max(width, 80)
    lines = [
        f"gpushare top  {time.strftime('%H:%M:%S')}  node pid {status.node.pid}   q quits"[:width]
    ]
    for g in status.gpus:
        sim = " [SIMULATED]" if g.simulated else ""
        lines.append("")
        lines.append(
            f"GPU {g.index} {g.name}{sim} {g.mode}/{g.policy} TQ {g.tq_s:g}s"
            f" mem {g.used_bytes / 2**30:.0f}/{g.usable_bytes / 2**30:.0f}G"[:width]
        )
        names = {s.id: _who(s) for s in g.sessions}
        holders = ", ".join(names.get(i, str(i)) for i in g.holders) or "-"
        queue = ", ".join(names.get(i, str(i)) for i in g.queue) or "-"
        lines.append(f"  holder: {holders}   queue: {queue}"[:width])
        lines.append(
            f"  {'SESSION':<18} {'STATE':<9} {'SHARE':>6} {'WAITp95':>7}"
            f" {'MEM #res ~swp':<{BAR + 2}} {'GiB res/lim':>11} {'OUT/IN':>7}"[:width]
        )
        for s in g.sessions:
            share = shares.get((g.index, s.id), 0.0)
            gib = f"{s.resident_bytes / 2**30:.1f}/{s.memory_limit_bytes / 2**30:.1f}"
            lines.append(
                f"  {names[s.id][:18]:<18} {s.state:<9} {share:>6.1%}"
                f" {s.wait_seconds_p95:>6.2f}s"
                f" {_bar(s.resident_bytes, s.swapped_bytes, s.memory_limit_bytes)}"
                f" {gib:>11} {s.swap_out_total:>3}/{s.swap_in_total:<3}"[:width]
            )
        if not g.sessions:
            lines.append("  no sessions")
    return lines


def _who(s: SessionStatus) -> str:
    if s.pod:
        who = f"{s.namespace}/{s.pod}" if s.namespace else s.pod
        return who if s.identity_verified else f"{who}?"  # ?: the workload's word
    claimed = s.claimed.pod
    return f"{claimed}?" if claimed else s.name  # ?: claimed, not verified


def frames(client: AdminClient) -> Iterator[list[str]]:
    tracker = ShareTracker()
    while True:
        st = client.status()
        shares = tracker.update(time.monotonic(), st)
        yield render(st, shares, shutil.get_terminal_size((80, 24)).columns)


def run_top(path: str | None, once: bool, interval: float = 0.5, out: TextIO = sys.stdout) -> int:
    with AdminClient(path) as client:
        gen = frames(client)
        if once:
            out.write("\n".join(next(gen)) + "\n")
            return 0
        with _cbreak(sys.stdin) as interactive:
            out.write("\x1b[?1049h\x1b[?25l")  # alternate screen, hide cursor
            try:
                for lines in gen:
                    out.write("\x1b[H\x1b[2J" + "\n".join(lines) + "\n")
                    out.flush()
                    if _wait_key(interval, interactive) == "q":
                        return 0
            finally:
                out.write("\x1b[?25h\x1b[?1049l")
                out.flush()
    return 0


@contextlib.contextmanager
def _cbreak(f: TextIO) -> Iterator[bool]:
    if not f.isatty():
        yield False
        return
    fd = f.fileno()
    old = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield True
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, old)


def _wait_key(timeout: float, interactive: bool) -> str:
    if not interactive:
        time.sleep(timeout)
        return ""
    r, _, _ = select.select([sys.stdin], [], [], timeout)
    return os.read(sys.stdin.fileno(), 1).decode(errors="replace").lower() if r else ""

"""No switch without a reason (docs/scheduling.md 1): a quantum waits for its holder.

When a holder's burst ends inside its quantum and nobody's turn is due, the rest of the
quantum waits a short *window* for it to ask again (a training loop's next step, a
notebook's next line) instead of handing the GPU over. The window is at most
``anticipate_s``, within the quantum, and four of the session's usual gaps between
bursts; a session whose gaps are long is released at once (as Kiwi does). While the
window is open the session counts at its limit. One session at a time has one.
"""

from __future__ import annotations

import math

from gpushare.core.sessions import SessionState
from gpushare.core.state import GpuState

ANTICIPATE_FLOOR_S = 0.05  # the shortest wait of a quantum for its holder to ask again


class Window:
    def __init__(self, st: GpuState) -> None:
        self.st = st
        self.holder: int | None = None  # the session whose quantum waits for it to ask

    def length(self, s: SessionState, now: float) -> float:
        """How long the rest of ``s``'s quantum waits for it to ask again after its
        burst ended: within its quantum, at most ``anticipate_s``, and four of its usual
        gaps between bursts (at least the floor); none when its gaps are long (a session
        that is done for now is released early)."""
        left = s.lease.quantum_end - now
        if math.isinf(left) or left <= 0 or s.esc.frozen:
            return 0.0
        cap = self.st.settings.anticipate_s
        # Its usual gap, or the last one if shorter: one long pause (a data loader, a
        # start) does not cost the next few bursts their windows.
        sh = s.share
        g = None if sh.gap_ewma is None else min(sh.gap_ewma, sh.gap_last)
        if g is not None and g > cap / 2:
            return 0.0
        return min(left, cap, max(ANTICIPATE_FLOOR_S, 4 * (g or 0.0)))

    def open(self, s: SessionState, until: float) -> None:
        if self.holder is not None:
            self.close(self.st.sessions[self.holder])
        self.holder = s.id
        s.share.window, s.share.window_until = True, until
        self.st.ledger.recount(s)

    def close(self, s: SessionState) -> None:
        s.share.window, s.share.window_until = False, 0.0
        if self.holder == s.id:
            self.holder = None
        self.st.ledger.recount(s)

    def expire(self, now: float) -> None:
        """Its holder did not ask again within the window: the GPU moves on. (The
        window's end is a deadline only while someone waits; otherwise it is seen here,
        at the next input.)"""
        if self.holder is not None:
            w = self.st.sessions[self.holder]
            if w.share.window_until <= now:
                self.close(w)

    def pause(self, now: float) -> None:
        """A turn comes while the window is open: the turn goes first; if the holder asks
        before its window (lengthened by a turn) is over, it goes next with what was left
        of its quantum."""
        if self.holder is None:
            return
        w = self.st.sessions[self.holder]
        w.share.resume_s = max(0.0, w.lease.quantum_end - now)
        w.share.front_until = w.share.window_until + self.st.settings.turn_s
        self.close(w)

    def deadline(self) -> float | None:
        """Its end, while someone waits (nobody waiting: nothing to do then)."""
        if self.holder is not None and self.st.queue:
            return self.st.sessions[self.holder].share.window_until
        return None

    def verify(self) -> list[str]:
        scan = [s.id for s in self.st.sessions.values() if s.share.window]
        kept = [] if self.holder is None else [self.holder]
        return [] if scan == kept else [f"quantum waiting for {kept}, scan {scan}"]

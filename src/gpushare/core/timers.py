"""When the arbiter next has something to do: every rule's next deadline in one place.

The node's timer calls :meth:`Arbiter.tick <gpushare.core.arbiter.Arbiter.tick>` at
:meth:`Timers.next`: the earliest of the holders' quantum ends and revoke deadlines (the
holders are few: read from them), the swap-outs asked of non-holders and the retries
after a failed swap (core/deadlines.py keeps those as running totals, as they grow with
the sessions), the claims told to yield (core/claims.py), the window (core/window.py),
the gangs' regroups (core/gangs.py), the compute buckets (core/caps.py), the turns
(core/turns.py) and a grower's wait for its neighbour's quantum (core/admission.py).
A rule with a new deadline adds it here: the module sits just below the arbiter
(core-layers), so it may read any rule's, admission's too. :meth:`Timers.verify`
checks that earliest against a scan of every session.
"""

from __future__ import annotations

import math

from gpushare.core.admission import Admission
from gpushare.core.caps import Caps
from gpushare.core.claims import Claims
from gpushare.core.gangs import Gangs
from gpushare.core.sessions import State
from gpushare.core.state import GpuState
from gpushare.core.turns import Turns
from gpushare.core.window import Window


class Timers:
    def __init__(
        self,
        st: GpuState,
        admission: Admission,
        claims: Claims,
        window: Window,
        gangs: Gangs,
        caps: Caps,
        turns: Turns,
    ) -> None:
        self.st, self.admission, self.claims, self.window = st, admission, claims, window
        self.gangs, self.caps, self.turns = gangs, caps, turns

    def next(self) -> float | None:
        """When the rules next have something to do (monotonic seconds), if ever."""
        times = self._but_retries()
        if self._retry_matters():
            # a plan (or a filling holder) waiting on a failed swap: look again at retry
            retry = self.st.deadlines.next_retry(self.st.sessions)
            if retry is not None:
                times.append(retry)
        return min(times, default=None)

    def _retry_matters(self) -> bool:
        st = self.st
        return bool(st.queue) or any(st.sessions[h].memory.room for h in st.holders)

    def _but_retries(self) -> list[float]:
        """Every deadline but the swap retries' (those are kept in a heap)."""
        st = self.st
        times = []
        for sid in st.holders:
            s = st.sessions[sid]
            if s.state is State.HOLDING:
                if not math.isinf(s.lease.quantum_end):  # a filling holder's quantum waits
                    times.append(s.lease.quantum_end)
            elif not s.esc.escalated:
                times.append(s.lease.revoke_deadline)
        # non-holders: a swap-out asked of them, a claimed lease they were told to yield
        times += st.deadlines.swap_outs(st.sessions)
        times += self.claims.deadlines()
        w = self.window.deadline()
        if w is not None:
            times.append(w)
        times += self.gangs.deadlines()
        times += self.caps.deadlines()
        times += self.turns.deadlines()
        times += self.admission.deadlines()  # a grower's plan waits for a quantum's end
        return times

    def verify(self) -> list[str]:
        """:meth:`next` against a scan of every session's retry (O(sessions))."""
        st = self.st
        times = self._but_retries()
        if self._retry_matters():
            now = st.deadlines.advanced  # retries due since the rules last ran are due still
            times += [
                s.esc.swap_failed_until
                for s in st.sessions.values()
                if s.esc.swap_failed_until > now
            ]
        scanned, kept = min(times, default=None), self.next()
        return [f"next deadline {kept}, scan {scanned}"] if kept != scanned else []

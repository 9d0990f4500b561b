"""GPU utilization attributed to sessions through the lease (pure, no I/O).

In an exclusive period the whole sample is credited to the one holder: the lease says
who used the GPU. In a shared period, per-process samples are used where the driver
gives them (credited to the session of each pid), and whatever is left is counted as
*shared*, not guessed. The node samples (NVML, or the simulated GPU's model) and feeds
the figures here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass
class Attribution:
    """Utilization-seconds per session and shared, for one GPU (pure, no I/O)."""

    by_session: dict[int, float] = field(default_factory=dict)
    shared: float = 0.0
    last_ratio: float = 0.0

    def credit(
        self,
        ratio: float,
        seconds: float,
        holders: Sequence[int],
        per_process: Mapping[int, float] | None = None,
        pid_of: Mapping[int, int] | None = None,
    ) -> None:
        """One sample: device ``ratio`` (0-1) over ``seconds``, the lease holders then,
        and optionally per-process ratios (pid -> 0-1) with the holders' pids."""
        ratio = min(max(ratio, 0.0), 1.0)
        self.last_ratio = ratio
        if not holders or seconds <= 0:
            return
        if len(holders) == 1:
            sid = holders[0]
            self.by_session[sid] = self.by_session.get(sid, 0.0) + ratio * seconds
            return
        left = ratio
        if per_process and pid_of:
            for sid in holders:
                r = min(per_process.get(pid_of.get(sid, -1), 0.0), left)
                if r > 0:
                    self.by_session[sid] = self.by_session.get(sid, 0.0) + r * seconds
                    left -= r
        self.shared += max(left, 0.0) * seconds

    def forget(self, sid: int) -> None:
        self.by_session.pop(sid, None)

"""Time as an input: the arbiter reads a clock it is given, so tests can drive it."""

from __future__ import annotations

from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (deadlines, durations)."""
        ...

    def wall(self) -> float:
        """Unix seconds (event timestamps)."""
        ...


class ManualClock:
    """A clock that moves only when told to (tests, simulations)."""

    def __init__(self, start: float = 1000.0, wall_start: float = 1_700_000_000.0) -> None:
        self._t = start
        self._wall_offset = wall_start - start

    def monotonic(self) -> float:
        return self._t

    def wall(self) -> float:
        return self._t + self._wall_offset

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a clock does not go back")
        self._t += seconds

    def set(self, t: float) -> None:
        self.advance(t - self._t)

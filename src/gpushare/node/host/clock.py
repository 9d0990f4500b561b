"""The node's real clock (the core reads only the Clock it is given)."""

from __future__ import annotations

import datetime
import time


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()


def now_rfc3339(wall: float) -> str:
    """Unix seconds as Kubernetes writes a time (RFC 3339, UTC, whole seconds)."""
    t = datetime.datetime.fromtimestamp(wall, datetime.UTC).replace(microsecond=0)
    return t.isoformat().replace("+00:00", "Z")

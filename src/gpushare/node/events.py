"""The event stream: a ring buffer for ``ctl events``, live followers, and a JSON-lines log."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections import deque
from typing import Any, TextIO

log = logging.getLogger("gpushare.node.events")

EVENT_KINDS = (
    "attach",
    "detach",
    "grant",
    "revoke",
    "release",
    "swap_out",
    "swap_in",
    "config",
    "escalate",
)


class EventBus:
    def __init__(
        self, log_path: str = "", backlog: int = 50_000, rotate_bytes: int = 64 * 2**20
    ) -> None:
        self.backlog: deque[dict[str, Any]] = deque(maxlen=backlog)
        self.followers: set[asyncio.Queue[dict[str, Any] | None]] = set()
        self.log_path = log_path
        self.rotate_bytes = rotate_bytes
        self._file: TextIO | None = None
        if log_path:
            self._open()

    def _open(self) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
        self._file = open(self.log_path, "a", buffering=1)  # noqa: SIM115  line-buffered, kept open

    def publish(self, rec: dict[str, Any]) -> None:
        self.backlog.append(rec)
        if self._file is not None:
            self._file.write(json.dumps(rec, separators=(",", ":")) + "\n")
            if self._file.tell() > self.rotate_bytes:
                self._file.close()
                os.replace(self.log_path, self.log_path + ".1")
                self._open()
        for q in list(self.followers):
            try:
                q.put_nowait(rec)
            except asyncio.QueueFull:  # a follower that cannot keep up is let go
                self.followers.discard(q)
                q.put_nowait(None) if not q.full() else None

    def select(
        self, since_ts: float | None = None, session: int | None = None
    ) -> list[dict[str, Any]]:
        return [r for r in self.backlog if matches(r, since_ts, session)]

    def follow(self) -> asyncio.Queue[dict[str, Any] | None]:
        q: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(maxsize=10_000)
        self.followers.add(q)
        return q

    def close(self) -> None:
        for q in self.followers:
            if not q.full():
                q.put_nowait(None)
        if self._file is not None:
            self._file.close()
            self._file = None


def matches(rec: dict[str, Any], since_ts: float | None, session: int | None) -> bool:
    if since_ts is not None and rec["ts"] < since_ts:
        return False
    return session is None or rec.get("session") == session

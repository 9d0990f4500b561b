"""The event stream: a ring buffer for ``ctl events`` (bounded by count and by bytes),
live followers, and a JSON-lines log (a file of the node's own, never through a symlink)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections import deque
from typing import Any, TextIO

from gpushare.node.keep.safefs import SafeDir, UnsafePath, parent_dir

log = logging.getLogger("gpushare.node.events")

EVENT_KINDS = (
    "attach",
    "detach",
    "grant",
    "revoke",
    "release",
    "swap_out",
    "swap_in",
    "prefetch",
    "config",
    "config_refused",
    "escalate",
    "recovery",
)


FOLLOW_LIMIT = 10_000  # events a live follower may be behind before it is let go
BACKLOG_BYTES = 16 * 2**20  # the ring's bound in bytes, beside its count


def size_of(rec: dict[str, Any]) -> int:
    """About what a record weighs (its text, and a little for each field): cheap enough
    for every event, close enough to bound the ring."""
    return 64 + sum(24 + (len(v) if isinstance(v, str) else 8) for v in rec.values())


class Follower:
    """A live reader of the event stream. One that falls :data:`FOLLOW_LIMIT` events
    behind is let go (the node never waits for a reader) and told so: ``None`` ends its
    queue, and :attr:`dropped` says why."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        # Unbounded, kept under the limit here: the end marker always fits.
        self.queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self.dropped = False

    def put(self, rec: dict[str, Any]) -> bool:
        """Queue one event; False once the follower is behind (it is then ended)."""
        if self.queue.qsize() >= self.limit:
            self.dropped = True
            self.queue.put_nowait(None)
            return False
        self.queue.put_nowait(rec)
        return True


class EventBus:
    def __init__(
        self,
        log_path: str = "",
        backlog: int = 50_000,
        rotate_bytes: int = 64 * 2**20,
        backlog_bytes: int = BACKLOG_BYTES,
    ) -> None:
        self.backlog: deque[dict[str, Any]] = deque()
        self._sizes: deque[int] = deque()
        self.backlog_count, self.backlog_bytes = backlog, backlog_bytes
        self.bytes = 0  # the ring's weight now (size_of)
        self.followers: set[Follower] = set()
        self.follow_limit = FOLLOW_LIMIT
        self.log_path = log_path
        self.rotate_bytes = rotate_bytes
        self._file: TextIO | None = None
        self._dir: SafeDir | None = None
        if log_path:
            self._dir, self._name = parent_dir(log_path)
            self._open()

    def _open(self) -> None:
        assert self._dir is not None
        try:
            fd = self._dir.append(self._name, mode=0o600)
        except UnsafePath:
            raise
        except OSError as e:
            raise UnsafePath(
                f"cannot open the event log {self.log_path}: {e.strerror} (a symlink is"
                " never followed): remove it or choose another path"
            ) from None
        self._file = os.fdopen(fd, "a", buffering=1)  # line-buffered, kept open

    def publish(self, rec: dict[str, Any]) -> None:
        size = size_of(rec)
        self.backlog.append(rec)
        self._sizes.append(size)
        self.bytes += size
        while len(self.backlog) > self.backlog_count or self.bytes > self.backlog_bytes:
            self.backlog.popleft()
            self.bytes -= self._sizes.popleft()
        if self._file is not None and self._dir is not None:
            self._file.write(json.dumps(rec, separators=(",", ":")) + "\n")
            if self._file.tell() > self.rotate_bytes:
                self._file.close()
                self._dir.rename(self._name, self._name + ".1")
                self._open()
        for f in list(self.followers):
            if not f.put(rec):  # a follower that cannot keep up is let go
                self.followers.discard(f)

    def select(
        self, since_ts: float | None = None, session: int | None = None
    ) -> list[dict[str, Any]]:
        return [r for r in self.backlog if matches(r, since_ts, session)]

    def follow(self) -> Follower:
        f = Follower(self.follow_limit)
        self.followers.add(f)
        return f

    def unfollow(self, f: Follower) -> None:
        self.followers.discard(f)

    def end_followers(self) -> None:
        """Every live follower's stream ends (the node stops)."""
        for f in self.followers:
            f.queue.put_nowait(None)
        self.followers.clear()

    def close(self) -> None:
        self.end_followers()
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._dir is not None:
            self._dir.close()


def matches(rec: dict[str, Any], since_ts: float | None, session: int | None) -> bool:
    if since_ts is not None and rec["ts"] < since_ts:
        return False
    return session is None or rec.get("session") == session

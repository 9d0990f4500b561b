"""The event stream: a ring buffer for ``ctl events`` (bounded by count and by bytes),
live followers, and a JSON-lines log (a file of the node's own, never through a symlink).

The ring and the followers are the loop's; the log's lines are written (and the log
rotated) on a thread of its own, so that no grant waits for the disk: they go to it in
order through a bounded queue (:data:`WRITE_QUEUE` lines), which it empties every
:data:`WRITE_EVERY` seconds (a wake-up per event would cost the loop more than the
write: the interpreter lock handed back and forth). A disk so slow that the queue
fills loses lines from the log, never from the ring or the followers: each is counted
(:attr:`EventBus.dropped`), the first said in the log as a warning. Closing the bus
writes what is queued, then closes the file."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
from collections import deque
from typing import IO, Any

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
# Lines the log's writer may be behind (a few MiB) before new ones are dropped: seconds
# of a busy node's events, more than a flush behind another process's gigabytes takes.
WRITE_QUEUE = 20_000
WRITE_EVERY = 0.05  # the writer's round: how long a line may wait for its write


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
        self.dropped = 0  # lines the log's writer could not take (a full queue, an error)
        self._file: IO[bytes] | None = None
        self._size = 0  # the log's bytes
        self._dir: SafeDir | None = None
        self._lines: deque[bytes] = deque()  # appended by the loop, taken by the writer
        self._queued = 0  # lines queued so far (the loop's count)
        self._written = 0  # lines the writer has taken and written (or dropped)
        self._round = threading.Condition()  # the writer's wake-up, and its rounds' end
        self._closing = False
        self._writer: threading.Thread | None = None
        self._said = False  # a dropped line was said in the log
        self._count = threading.Lock()
        if log_path:
            self._dir, self._name = parent_dir(log_path)
            self._open()
            self._writer = threading.Thread(
                target=self._write_lines, name="gpushare-events", daemon=True
            )
            self._writer.start()

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
        self._size = os.fstat(fd).st_size
        self._file = os.fdopen(fd, "ab", buffering=1 << 16)  # flushed when it catches up

    def publish(self, rec: dict[str, Any]) -> None:
        size = size_of(rec)
        self.backlog.append(rec)
        self._sizes.append(size)
        self.bytes += size
        while len(self.backlog) > self.backlog_count or self.bytes > self.backlog_bytes:
            self.backlog.popleft()
            self.bytes -= self._sizes.popleft()
        if self._writer is not None:  # the line made here: the record as it is now
            line = (json.dumps(rec, separators=(",", ":")) + "\n").encode()
            if len(self._lines) >= WRITE_QUEUE:
                self._drop("the event log's writer is behind (a slow disk)")
            else:
                self._lines.append(line)  # a deque's append: safe beside the writer's pops
                self._queued += 1
        for f in list(self.followers):
            if not f.put(rec):  # a follower that cannot keep up is let go
                self.followers.discard(f)

    def _drop(self, why: str) -> None:
        with self._count:  # the loop's and the writer's
            self.dropped += 1
            said, self._said = self._said, True
        if not said:
            log.warning(
                "event log %s: lines dropped from it (%s); the ring and live followers"
                " still get them (said once; the count at close)",
                self.log_path,
                why,
            )

    def _write_lines(self) -> None:
        """The writer thread: every :data:`WRITE_EVERY` seconds (at once when asked),
        each line queued, in order, then the file flushed; rotated past
        ``rotate_bytes``. Closing, it writes what is left and closes the file."""
        while True:
            with self._round:
                closing = self._closing
                if not closing:
                    self._round.wait(WRITE_EVERY)
            n = 0
            while self._lines:
                self._write_line(self._lines.popleft())
                n += 1
            if n and self._file is not None:
                try:
                    self._file.flush()
                except OSError as e:
                    self._drop(f"cannot write it: {e}")
            with self._round:
                self._written += n
                self._round.notify_all()
            if closing and not self._lines:
                self._close_file()
                return

    def _write_line(self, line: bytes) -> None:
        try:
            if self._file is None:
                raise OSError("the log is not open")
            self._file.write(line)
            self._size += len(line)
            if self._size > self.rotate_bytes:
                self._rotate()
        except (OSError, UnsafePath) as e:
            self._drop(f"cannot write it: {e}")

    def _rotate(self) -> None:
        assert self._dir is not None and self._file is not None
        self._file.close()
        self._file = None
        self._dir.rename(self._name, self._name + ".1")
        self._open()

    def _close_file(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None

    def flush(self) -> None:
        """Every line published so far written (a test, a tool)."""
        target = self._queued
        with self._round:
            self._round.notify_all()  # a round now
            while self._written < target and self._writer is not None:
                if not self._writer.is_alive():
                    return
                self._round.wait(WRITE_EVERY)

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
        """Followers ended; the lines queued written, then the log closed."""
        self.end_followers()
        if self._writer is not None:
            with self._round:
                self._closing = True  # after every line queued: the writer writes them
                self._round.notify_all()
            self._writer.join()
            self._writer = None
        self._close_file()
        if self.dropped:
            log.warning("event log %s: %d lines dropped from it", self.log_path, self.dropped)
        if self._dir is not None:
            self._dir.close()


def matches(rec: dict[str, Any], since_ts: float | None, session: int | None) -> bool:
    if since_ts is not None and rec["ts"] < since_ts:
        return False
    return session is None or rec.get("session") == session

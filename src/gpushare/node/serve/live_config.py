"""The configuration in force, and its changes while the node runs: the config file
watched (a ConfigMap update lands this way) and applied from the next quantum, and
``ctl ... --persist`` written down. A bad edit (or a bad ``ctl`` value) is refused: a
log line, a ``config_refused`` event, and the configuration in force kept; the next edit
is read as usual."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from gpushare.core import events as typed
from gpushare.core.arbiter import Arbiter
from gpushare.node.decide.decisions import Decisions
from gpushare.node.keep.config import (
    ConfigError,
    NodeConfig,
    NotRegular,
    check_gpus,
    file_keys,
    load,
    persist,
    read_raw,
    read_regular,
    settings_for,
)
from gpushare.settings import Change, SettingsError, validate

log = logging.getLogger("gpushare.node.live_config")

# Looks in a row that must see a changed config file the same before it is applied: it
# held still for two periods (one look could catch it half-written).
STEADY_LOOKS = 3

# Keys read once at start: a change to them waits for the next start.
RESTART_KEYS = ("socket", "admin_socket", "metrics_port", "sim_gpus", "reserve", "recovery_dir")
# The flag of a key, where it is not --key-with-dashes.
FLAG_OF = {"overlap": "--sequential-switches", "prefetch": "--no-prefetch"}


def _changed(old: NodeConfig, new: NodeConfig, gpu: int) -> dict[str, object]:
    """GPU ``gpu``'s settings that differ in ``new`` (a live change made with ctl stays:
    it is in neither)."""
    before, after = settings_for(old, gpu), settings_for(new, gpu)
    return {k: v for k, v in after.items() if before.get(k) != v}


class NotPersisted(Exception):
    """A live change that could not be written down (the message says why)."""


class LiveConfig:
    def __init__(
        self,
        config: NodeConfig,
        arbiters: list[Arbiter],
        decisions: Decisions,
        path: str = "",
        state_path: str = "",
        flags: dict[str, Any] | None = None,
    ) -> None:
        self.config = config
        self.arbiters = arbiters
        self.decisions = decisions
        self.path = path
        self.state_path = state_path
        self.flags = flags or {}
        self._text = self._read()
        self._file = self._read_file()
        self._said: set[str] = set()  # keys whose overridden edit was said once
        self._seen: list[bytes | None] = []  # a change, as each look since saw it
        self._said_unread = ""  # the last word on a file not read (said once)

    def _read(self) -> bytes | None:
        """The file's bytes; None where there is none, or it is not a regular file (a
        FIFO is never opened to block on, said once)."""
        if not self.path:
            return None
        try:
            text = read_regular(self.path)
        except OSError as e:
            why = str(e) if isinstance(e, NotRegular) else ""
            if why and why != self._said_unread:
                log.error("config %s: %s; keeping the configuration in force", self.path, why)
            self._said_unread = why
            return self._text if why else None  # not a file: as if unchanged
        self._said_unread = ""
        return text

    def _read_file(self) -> dict[str, Any]:
        try:
            return read_raw(self.path)
        except ConfigError:
            return {}

    def _overridden(self, before: dict[str, Any], after: dict[str, Any]) -> None:
        """An edit of the file to a key a flag (or the state file) sets wins nothing:
        said once per key, with the fix, where it used to pass unseen."""
        state = self._read_state()
        for key in sorted(set(before) | set(after)):
            if key == "gpu" or before.get(key) == after.get(key) or key in self._said:
                continue
            flag = FLAG_OF.get(key, "--" + key.replace("_", "-"))
            if key in self.flags:
                why = (
                    f"the command line's {flag} wins over the file: restart the node"
                    f" without {flag} for the file to set it"
                )
            elif key in state:
                why = (
                    f"the state file {self.state_path} (ctl --persist) wins over the file:"
                    f" set it with ctl {key} ... --persist, or take it out of the state file"
                )
            else:
                continue
            self._said.add(key)
            log.warning("config %s: %s changed, not applied: %s", self.path, key, why)

    def _read_state(self) -> dict[str, Any]:
        try:
            return read_raw(self.state_path)
        except ConfigError:
            return {}

    async def watch(self, period: float = 1.0, looks: int = STEADY_LOOKS) -> None:
        """Apply changes to the config file live, looking once a period. A change is
        applied once ``looks`` looks in a row saw the same bytes: a file caught while it
        is written (truncated, half there) is not applied, only what it holds once its
        writer is done."""
        while True:
            await asyncio.sleep(period)
            text = self._read()
            if text == self._text:
                self._seen.clear()
                continue
            if self._seen and self._seen[-1] != text:
                self._seen.clear()  # still moving
            self._seen.append(text)
            if len(self._seen) < looks:
                continue
            self._seen.clear()
            self._text = text
            try:
                self.reload()
            except Exception:  # the watch goes on: the next edit is read as usual
                log.exception("config %s: not applied", self.path)

    def reload(self) -> None:
        """Merge the files and flags again; apply what changed in them, from the next
        quantum. A live change made with ctl stays unless the same key changed."""
        try:
            new = load(self.path, self.state_path, self.flags)
            check_gpus(new, len(self.arbiters))
        except ConfigError as e:
            self.refused(f"file {self.path}", str(e))
            return
        file = self._read_file()
        self._overridden(self._file, file)
        self._file = file
        try:  # every GPU's change checked before any GPU changes
            changes = [
                (arb, validate(**_changed(self.config, new, arb.gpu))) for arb in self.arbiters
            ]
        except SettingsError as e:
            self.refused(f"file {self.path}", str(e))
            return
        for arb, change in changes:
            if change:
                log.info(
                    "config %s changed: GPU %d %s (from the next quantum)",
                    self.path,
                    arb.gpu,
                    file_keys(change),
                )
                self.decisions.act(arb, arb.set_config(change))
        restart = [k for k in RESTART_KEYS if getattr(new, k) != getattr(self.config, k)]
        if restart:
            log.warning(
                "config %s changed %s: takes effect when the node restarts",
                self.path,
                ", ".join(restart),
            )
        self.config = new

    def refused(self, source: str, reason: str) -> None:
        """A live change refused: said in the log and as a ``config_refused`` event; the
        configuration in force is kept."""
        log.error("%s: refused, keeping the configuration in force", reason)
        self.decisions.dispatch.events.publish(
            typed.record(
                typed.ConfigRefused(source=source, reason=reason),
                ts=self.decisions.clock.wall(),
                gpu=None,
            )
        )

    def persist(self, gpu: int | None, change: Change) -> str:
        """Write ``change`` to the state file, or the config file without one; the file
        written, or :class:`NotPersisted`."""
        target = self.state_path or self.path
        if not target:
            raise NotPersisted(
                "changed live but not persisted: the node runs without --config FILE"
                " or --state FILE"
            )
        try:
            persist(target, gpu, change)
            self.config = load(self.path, self.state_path, self.flags)
            self._text = self._read()
        except (OSError, ValueError) as e:
            raise NotPersisted(f"changed live, not persisted: {e}") from None
        log.info("persisted %s to %s", file_keys(change), target)
        return target

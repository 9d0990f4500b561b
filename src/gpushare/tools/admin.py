"""A small synchronous client for the admin socket (used by ``ctl`` and ``demo``)."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from typing import Any

from gpushare import protocol as p
from gpushare.client.env import DEFAULT_ADMIN_SOCKET
from gpushare.errors import DaemonUnavailableError, GpushareError
from gpushare.settings import KEYS, Change
from gpushare.status import NodeStatus

# The settings a set_config request carries (the others change in the config file only).
WIRE_KEYS = ("tq_s", "mode", "policy", "escalation")


def default_admin_socket() -> str:
    return os.environ.get("GPUSHARE_ADMIN_SOCKET") or DEFAULT_ADMIN_SOCKET


class AdminClient:
    def __init__(self, path: str | None = None, timeout: float | None = 10.0) -> None:
        self.path = path or default_admin_socket()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(self.path)
        except PermissionError:
            self._sock.close()
            raise DaemonUnavailableError(
                f"permission denied on {self.path}: administration needs root or the node's user"
            ) from None
        except OSError as e:
            self._sock.close()
            raise DaemonUnavailableError(
                f"cannot reach the node's admin socket {self.path} ({e.strerror or e}):"
                " is 'gpushare node' running? Name its admin socket with --socket"
                " (or GPUSHARE_ADMIN_SOCKET)"
            ) from None
        self._buf = p.FrameBuffer()
        self._pending: list[p.Message] = []

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _recv(self) -> p.Message:
        while not self._pending:
            data = self._sock.recv(65536)
            if not data:
                raise DaemonUnavailableError("the node closed the admin connection")
            self._pending.extend(self._buf.feed(data))
        msg = self._pending.pop(0)
        if isinstance(msg, p.Error):
            raise GpushareError(msg.message)
        return msg

    def request(self, msg: p.Message) -> p.Message:
        self._send(msg)
        return self._recv()

    def _send(self, msg: p.Message) -> None:
        # The node may refuse (and close) as soon as we connect: its error frame is
        # still there to read, and says why better than the broken pipe.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self._sock.sendall(p.encode(msg))

    def status(self) -> NodeStatus:
        try:
            r = self.request(p.StatusRequest())
        except (DaemonUnavailableError, OSError):
            # The node closes an admin connection idle for minutes (a `top` with a long
            # --interval): a status asks nothing twice, so it connects again, once.
            self._reconnect()
            r = self.request(p.StatusRequest())
        assert isinstance(r, p.StatusReply)
        return r.status

    def _reconnect(self) -> None:
        timeout = self._sock.gettimeout()
        self._sock.close()
        fresh = AdminClient(self.path, timeout)
        self._sock, self._buf, self._pending = fresh._sock, fresh._buf, fresh._pending

    def set_config(
        self, change: Change, *, gpu: int | None = None, persist: bool = False
    ) -> p.ConfigReply:
        """``change`` live on GPU ``gpu`` (all: None), written down with ``persist``: the
        ``set_config`` request. The node checks it (and answers a bad value with an
        error); the settings only the config file changes are refused here."""
        others = sorted(set(change) - set(WIRE_KEYS))
        if others:
            raise GpushareError(
                f"{', '.join(KEYS[k] for k in others)}: not changed over the admin socket;"
                " set it in the node's config file (it is applied live, docs/node.md)"
            )
        r = self.request(
            p.SetConfig(
                gpu=gpu,
                persist=persist,
                tq_s=change.get("tq_s"),
                mode=change.get("mode"),
                policy=change.get("policy"),
                escalation=change.get("escalation"),
            )
        )
        assert isinstance(r, p.ConfigReply)
        return r

    def events(
        self, follow: bool = False, since_s: float | None = None, session: int | None = None
    ) -> Iterator[dict[str, Any] | None]:
        """Events; ``None`` marks the end of the backlog (then live ones, if following)."""
        self._send(p.EventsRequest(follow=follow, since_s=since_s, session=session))
        if follow:
            self._sock.settimeout(None)
        while True:
            try:
                msg = self._recv()
            except DaemonUnavailableError:
                raise DaemonUnavailableError(
                    f"the node at {self.path} closed the event stream: it stopped or"
                    " restarted (the events are in its --event-log, if it keeps one)"
                ) from None
            if isinstance(msg, p.EventsEnd):
                yield None
                if not follow:
                    return
            elif isinstance(msg, p.EventMsg):
                yield msg.event

"""A TCP relay between a client and the API server that a test can cut: every open
connection dropped (a watch breaks as it does when a load balancer or the network drops
it) and new ones refused until it is resumed. TLS passes through untouched."""

from __future__ import annotations

import contextlib
import socket
import threading


class TcpProxy:
    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.server.getsockname()[1])
        self.accepting = True
        self.stalling = False
        self.connections_total = 0
        self._open: set[socket.socket] = set()
        self._stalled: set[socket.socket] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="proxy-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return  # closed
            if not self.accepting:
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open |= {client, upstream}
                if self.stalling:
                    self._stalled |= {client, upstream}
                self.connections_total += 1
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                if src in self._stalled:
                    continue  # swallowed
                dst.sendall(data)
        except OSError:
            pass
        self._drop(src, dst)

    def _drop(self, *socks: socket.socket) -> None:
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
            with self._lock:
                self._open.discard(s)

    def cut(self) -> None:
        """Drop every connection and refuse new ones until :meth:`resume`."""
        self.accepting = False
        with self._lock:
            socks = list(self._open)
        self._drop(*socks)

    def stall(self) -> None:
        """Connections stop carrying bytes, without a word to either end (a peer gone, a
        dropped route): the open ones for good, new ones until :meth:`resume`."""
        self.stalling = True
        with self._lock:
            self._stalled |= self._open

    def resume(self) -> None:
        self.accepting, self.stalling = True, False

    def close(self) -> None:
        self.cut()
        self.server.close()

"""The exporter's HTTP side, as prometheus_client's server answers: the WSGI app (the
exposition on any path, gzip when accepted, an empty favicon, OPTIONS, 405), the
listening socket, and wsgiref's threading server on a socket already bound (the node's,
inherited by the exporter's process), its connections bounded.
"""

from __future__ import annotations

import gzip
import io
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler

from prometheus_client.exposition import ThreadingWSGIServer, gzip_accepted

from gpushare.node.host.clock import SystemClock

DEFAULT_PORT = 9423
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


# --- serving ------------------------------------------------------------------------------
# Bounds of the exporter's HTTP server: connections served at once (more are closed as
# they come: 4,000 half-sent requests once held 4,002 threads), and how long one may take
# to send its whole request (a byte now and then kept a slot for ever: 64 such blocked
# every scrape), and then to read the answer.
MAX_CONNECTIONS = 64
HTTP_TIMEOUT_S = 10.0
_CLOCK = SystemClock()  # a request's deadline (the exporter's process: real time)


class _ByDeadline(io.RawIOBase):
    """A socket's reads, all of them together within ``deadline`` (monotonic): each
    waits only for what is left of it, then the connection is timed out."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        super().__init__()
        self.sock, self.deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        left = self.deadline - _CLOCK.monotonic()
        if left <= 0:
            raise TimeoutError(f"request not whole within {HTTP_TIMEOUT_S:g} s")
        self.sock.settimeout(left)
        return self.sock.recv_into(b)


class _Quiet(WSGIRequestHandler):
    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(HTTP_TIMEOUT_S)  # each write on it
        self.rfile.close()  # (the socket stays open: the handler's own)
        self.rfile = io.BufferedReader(
            _ByDeadline(self.connection, _CLOCK.monotonic() + HTTP_TIMEOUT_S)
        )

    def parse_request(self) -> bool:
        ok = super().parse_request()
        self.connection.settimeout(HTTP_TIMEOUT_S)  # the request is in: the answer's time
        return ok

    def log_message(self, format: str, *args: Any) -> None:
        pass


def app(scrape: Callable[[], bytes]) -> Callable[..., list[bytes]]:
    """A WSGI app answering as prometheus_client's does: the exposition on any path (gzip
    when accepted), an empty favicon, OPTIONS, 405 for other methods."""

    last = [(b"", b"")]  # the last text and its gzip: the same text is not compressed again

    def metrics_app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        method = environ["REQUEST_METHOD"]
        headers: list[tuple[str, str]] = []
        body = b""
        if method == "OPTIONS":
            status, headers = "200 OK", [("Allow", "OPTIONS,GET")]
        elif method != "GET":
            status, headers = "405 Method Not Allowed", [("Allow", "OPTIONS,GET")]
            body = f"# HTTP {status}: {method}; use OPTIONS or GET\n".encode()
        elif environ["PATH_INFO"] == "/favicon.ico":
            status = "200 OK"
        else:
            status, body = "200 OK", scrape()
            headers = [("Content-Type", CONTENT_TYPE)]
            if gzip_accepted(environ.get("HTTP_ACCEPT_ENCODING", "")):
                plain, packed = last[0]
                if body is not plain:
                    # the fastest level: the text is repetitive, level 1 takes most of it
                    packed = gzip.compress(body, compresslevel=1)
                    last[0] = (body, packed)
                body = packed
                headers.append(("Content-Encoding", "gzip"))
        start_response(status, headers)
        return [body]

    return metrics_app


def bind(port: int, address: str) -> socket.socket:
    """The exporter's listening socket, IPv4 or IPv6 as the address asks (as
    prometheus_client's server chooses)."""
    info = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, sockaddr = info[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as socketserver does
        sock.bind(sockaddr)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


class _Server(ThreadingWSGIServer):
    """wsgiref's threading server on a socket already listening (the node's, inherited)."""

    def __init__(self, sock: socket.socket) -> None:
        self.address_family = sock.family
        super().__init__(sock.getsockname(), _Quiet, bind_and_activate=False)
        self.socket.close()
        self.socket = sock
        host, port = sock.getsockname()[:2]
        self.server_name, self.server_port = socket.getfqdn(host), port
        self.setup_environ()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.turned_away = 0

    def process_request(self, request: Any, client_address: Any) -> None:
        """A thread per connection, up to :data:`MAX_CONNECTIONS` at once; past that a
        connection is closed at once (a scraper tries again at its next interval)."""
        if not self._slots.acquire(blocking=False):
            self.turned_away += 1
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], OSError):  # a peer gone or timed out: routine
            super().handle_error(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def serve_on(sock: socket.socket, scrape: Callable[[], bytes]) -> _Server:
    """A server answering ``app(scrape)`` on ``sock`` (listening); ``serve_forever`` it."""
    server = _Server(sock)
    server.set_app(app(scrape))
    return server

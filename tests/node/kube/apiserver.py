"""A stand-in API server for the one client's tests: a real HTTP server on a real socket
that answers every request with what a test sets (an API server's Status body, its
headers), and a kubeconfig that points the official client at it."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class Answer:
    """What the server answers every request with (changed by a test), and the paths
    it was asked."""

    def __init__(self) -> None:
        self.status, self.body, self.headers = 200, b"{}", {}
        self.paths: list[str] = []


def api_status(code: int, message: str, details: dict | None = None, reason: str = "") -> bytes:
    return json.dumps({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason, "details": details or {}, "code": code,
    }).encode()  # fmt: skip


@contextlib.contextmanager
def serving() -> Iterator[tuple[Answer, int]]:
    """The server on 127.0.0.1 (an ephemeral port), shut down after."""
    answer = Answer()

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            answer.paths.append(self.path)
            self.send_response(answer.status)
            self.send_header("Content-Type", "application/json")
            for k, v in answer.headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(answer.body)))
            self.end_headers()
            self.wfile.write(answer.body)

        do_GET = do_PATCH = do_POST = _answer

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        yield answer, httpd.server_address[1]
    finally:
        httpd.shutdown()
        httpd.server_close()


def kubeconfig(tmp_path: Path, port: int) -> str:
    f = tmp_path / "kubeconfig"
    f.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "here",
        "clusters": [{"name": "here", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
        "users": [{"name": "me", "user": {"token": "t"}}],
        "contexts": [{"name": "here", "context": {"cluster": "here", "user": "me"}}],
    }))  # fmt: skip
    return str(f)

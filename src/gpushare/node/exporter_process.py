"""The exporter's own process: serves ``/metrics`` so that a scrape costs the node's
event loop one snapshot and nothing else.

The node (node/exporter.py) binds the listening socket and starts this module with it
and one end of a socketpair (the *link*) as inherited descriptors. Here, scrapes are
served by wsgiref's threading server (metrics.app: gzip, 405, OPTIONS, favicon as
before); each asks the node over the link for a snapshot (``ASK``), the node answers
from its loop with the typed status, msgpack-encoded (``HEADER`` then the body; an
empty body: the node could not take one), and the text is written and compressed here,
each session's lines kept between scrapes (metrics.Exposition). Scrapes that arrive
while a snapshot is on its way share it: one request at a time is in flight.

It dies with the node: the link's end of file (the node stopped or died) ends it, and
so does the node's death on its own (PR_SET_PDEATHSIG, Linux). It runs at a lower
priority (nice 10), so that on a small machine a scrape's text and gzip wait for the
node rather than the node for them.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import socket
import struct
import sys
import threading

import msgspec

from gpushare.node import metrics
from gpushare.status import NodeStatus

ASK = b"?"  # the exporter asks for a snapshot
READY = b"!"  # the exporter serves (the node starts counting its restarts again)
HEADER = struct.Struct(">I")  # the length of the snapshot that follows
NICE = 10
WAIT_S = 10.0  # the longest a scrape waits for the node's snapshot
PR_SET_PDEATHSIG = 1


class NodeGone(ConnectionError):
    pass


class Link:
    """Snapshots from the node: ``take`` from any thread, ``run`` reads the answers."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._cv = threading.Condition()
        self._asked = False  # a request is in flight
        self._answers = 0
        self._last: NodeStatus | None = None
        self._closed = False
        self._decode = msgspec.msgpack.Decoder(NodeStatus).decode

    def take(self) -> NodeStatus:
        """A snapshot the node took after this call began, or the one on its way."""
        with self._cv:
            if not self._asked and not self._closed:
                self._asked = True
                self._sock.sendall(ASK)
            seen = self._answers
            if not self._cv.wait_for(lambda: self._answers != seen or self._closed, WAIT_S):
                raise TimeoutError(f"the node sent no snapshot in {WAIT_S:g} s")
            if self._last is None:
                raise NodeGone("the node is gone" if self._closed else "the node sent none")
            return self._last

    def ready(self) -> None:
        self._sock.sendall(READY)

    def run(self) -> None:
        """Reads the node's answers until the link ends (the node stopped or died)."""
        f = self._sock.makefile("rb")
        while True:
            head = f.read(HEADER.size)
            if len(head) < HEADER.size:
                break
            (size,) = HEADER.unpack(head)
            body = f.read(size)
            if len(body) < size:
                break
            st = self._decode(body) if size else None
            with self._cv:
                self._last, self._asked = st, False
                self._answers += 1
                self._cv.notify_all()
        with self._cv:
            self._closed, self._last = True, None
            self._cv.notify_all()


def die_with(parent: int) -> bool:
    """Asks the kernel for SIGKILL when the node dies; False if it already has."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    return os.getppid() == parent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpushare-exporter", description=__doc__)
    ap.add_argument("--listen", type=int, required=True, help="the listening socket's fd")
    ap.add_argument("--link", type=int, required=True, help="the link to the node's fd")
    ap.add_argument("--parent", type=int, required=True, help="the node's pid")
    a = ap.parse_args(argv)
    if not die_with(a.parent):
        return 0  # the node is gone already
    # Ctrl-C in the node's terminal reaches this process too: the node decides, and its
    # end of the link ends this one.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with contextlib.suppress(OSError):
        os.nice(NICE)
    link = Link(socket.socket(fileno=a.link))
    exposition = metrics.Exposition()
    server = metrics.serve_on(
        socket.socket(fileno=a.listen), lambda: exposition.render(link.take())
    )
    with contextlib.suppress(OSError):
        link.ready()
        threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
        link.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())

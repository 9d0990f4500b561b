"""The exporter's own process: serves ``/metrics`` so that a scrape costs the node's
event loop one snapshot and nothing else.

The node (node/observe/exporter.py) binds the listening socket and starts this module with it
and one end of a socketpair (the *link*) as inherited descriptors. Here, scrapes are
served by wsgiref's threading server (metrics_http.app: gzip, 405, OPTIONS, favicon as
before); each asks the node over the link for a snapshot (``ASK``), the node answers
from its loop with the typed status, msgpack-encoded (``HEADER`` then the body; an
empty body: the node could not take one), and the text is written and compressed here,
each session's lines kept between scrapes (metrics.Exposition). Scrapes that arrive
while a snapshot is on its way share it: one request at a time is in flight.

It dies with the node: the link's end of file (the node stopped or died) ends it, and
so does the node's death on its own (PR_SET_PDEATHSIG, Linux). It runs at a lower
priority (nice 10, in short slices where the kernel allows), so that on a small
machine a scrape's text and gzip wait for the node rather than the node for them.
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

from gpushare.node.observe import metrics, metrics_http
from gpushare.status import NodeStatus

ASK = b"?"  # the exporter asks for a snapshot
READY = b"!"  # the exporter serves (the node starts counting its restarts again)
HEADER = struct.Struct(">I")  # the length of the snapshot that follows
NICE = 10
SLICE_NS = 100_000  # the shortest slice the kernel grants (0.1 ms)
SYS_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274}.get(os.uname().machine)
SCHED_ATTR = struct.Struct("=IIQiIQQQII")  # struct sched_attr, version 1
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
        self._last = b""
        self._closed = False

    def take(self) -> bytes:
        """The node's answer to a request sent after this call began, or to the one on
        its way (an encoded NodeStatus)."""
        with self._cv:
            if not self._asked and not self._closed:
                self._asked = True
                self._sock.sendall(ASK)
            seen = self._answers
            if not self._cv.wait_for(lambda: self._answers != seen or self._closed, WAIT_S):
                raise TimeoutError(f"the node sent no snapshot in {WAIT_S:g} s")
            if not self._last:
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
            with self._cv:
                self._last, self._asked = body, False
                self._answers += 1
                self._cv.notify_all()
        with self._cv:
            self._closed, self._last = True, b""
            self._cv.notify_all()


class Texts:
    """The exposition of the node's snapshots; the same snapshot again (the node gives
    its last one to scrapes close together) is the same text, not written again."""

    def __init__(self, link: Link) -> None:
        self._link = link
        self._exposition = metrics.Exposition()
        self._decode = msgspec.msgpack.Decoder(NodeStatus).decode
        self._lock = threading.Lock()
        self._last = (b"", b"")  # (snapshot, text)

    def __call__(self) -> bytes:
        snapshot = self._link.take()
        with self._lock:
            if snapshot != self._last[0]:
                self._last = (snapshot, self._exposition.render(self._decode(snapshot)))
            return self._last[1]


def lower_priority() -> None:
    """Nice 10, and slices of 0.1 ms where the kernel takes a fair task's slice from
    sched_setattr (Linux 6.12 and later, EEVDF): a node that wakes up takes a CPU this
    process holds within 0.1 ms, rather than after its default slice (1-3 ms)."""
    with contextlib.suppress(OSError):
        os.nice(NICE)
    if SYS_SCHED_SETATTR is None:
        return
    with contextlib.suppress(OSError, AttributeError):
        nice = os.getpriority(os.PRIO_PROCESS, 0)
        attr = SCHED_ATTR.pack(SCHED_ATTR.size, os.SCHED_OTHER, 0, nice, 0, SLICE_NS, 0, 0, 0, 0)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall(SYS_SCHED_SETATTR, 0, ctypes.create_string_buffer(attr), 0)  # else nice


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
    lower_priority()
    link = Link(socket.socket(fileno=a.link))
    server = metrics_http.serve_on(socket.socket(fileno=a.listen), Texts(link))
    with contextlib.suppress(OSError):
        link.ready()
        threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
        link.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The Prometheus exporter: the text exposition of a snapshot of the node's state.

Every scrape takes one snapshot (the same object ``ctl status --json`` prints), made in
the daemon's event loop, so the figures of one scrape are consistent with each other;
that is all a scrape asks of the loop. The text is written in the exporter's process
(node/exporter_process.py) by :class:`Exposition`, in Prometheus' text format (0.0.4)
exactly as prometheus_client writes it, without its per-sample objects: a session's
lines are written again only when one of the figures they show changed, and are
otherwise reused from the last scrape, so a scrape of many idle sessions costs little
more than joining strings.

Names: prefix ``gpushare_``, base units, counters end in ``_total``, ratios are 0-1.
Per-session series carry ``gpu``, ``gpu_uuid``, ``namespace``, ``pod``, ``container``,
``session`` (no pid label); GPU-level series carry ``gpu``, ``gpu_uuid`` and
``simulated``. A session's name and user are on one info series per session
(``gpushare_session_info``), joined on ``session`` (Prometheus' advice: names that
change rarely on an info series, not on every series); a workload's totals by name and
pod outlive its sessions (``gpushare_workload_*_total``, node/totals.py). A series is
added by a line in one of the tables below.
"""

from __future__ import annotations

import gzip
import io
import itertools
import math
import platform
import pwd
import socket
import sys
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from operator import attrgetter
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler

from prometheus_client.exposition import ThreadingWSGIServer, gzip_accepted
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector, CollectorRegistry

from gpushare._version import __version__
from gpushare.core.sessions import WAIT_BUCKETS, State
from gpushare.settings import MODES, POLICIES
from gpushare.status import GpuStatus, NodeStatus, SessionStatus

DEFAULT_PORT = 9423
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# --- what is exported -------------------------------------------------------------------
# (metric, help, the GpuStatus figure) for GPU-level gauges
_GPU_GAUGES: list[tuple[str, str, Callable[[GpuStatus], float]]] = [
    ("gpu_memory_bytes", "The GPU's memory.", lambda g: g.memory_bytes),
    (
        "gpu_usable_bytes",
        "The GPU's memory less the reserve: what sessions may use.",
        lambda g: g.usable_bytes,
    ),
    (
        "gpu_used_bytes",
        "Memory in use now, holders counted at their limits.",
        lambda g: g.used_bytes,
    ),
    (
        "gpu_utilization_ratio",
        "The GPU's utilization, last sample (0-1).",
        lambda g: g.utilization_ratio,
    ),
    ("gpu_queue_length", "Sessions waiting for the GPU.", lambda g: len(g.queue)),
    ("gpu_holders", "Sessions holding a lease.", lambda g: len(g.holders)),
    ("tq_seconds", "The time quantum.", lambda g: g.tq_s),
]
# (metric, help, the GpuStatus figure) for GPU-level counters (the name less _total)
_GPU_COUNTERS: list[tuple[str, str, Callable[[GpuStatus], float]]] = [
    (
        "shared_utilization_seconds",
        "GPU busy-seconds in shared periods that no per-process sample attributed.",
        lambda g: g.shared_utilization_seconds_total,
    ),
    ("gpu_grants", "Leases granted on the GPU.", lambda g: g.grants_total),
]
# (metric, the SessionStatus field, help) for per-session counters and gauges
_SESSION_COUNTERS: list[tuple[str, str, str]] = [
    ("lease_seconds", "lease_seconds_total", "Seconds this session held a lease."),
    ("grants", "grants_total", "Leases granted to this session."),
    ("revokes", "revokes_total", "Leases revoked from this session at a quantum's end."),
    ("escalations", "escalations_total", "Escalations applied to this session."),
    ("bursts", "bursts_total", "Bursts (requests for the GPU) this session made."),
    ("turns", "turns_total", "Interactive turns granted to this session."),
    (
        "reclaims",
        "reclaims_total",
        "Bursts this session gave back (memory lent above its request).",
    ),
    (
        "discarded_bytes",
        "discarded_bytes_total",
        "Bytes of discardable memory this session dropped instead of swapping them out.",
    ),
    (
        "reclaimed_bytes",
        "reclaimed_bytes_total",
        "Bytes lent above this session's request that its reclaims took back.",
    ),
    (
        "utilization_seconds",
        "utilization_seconds_total",
        "GPU utilization attributed to this session through its lease, in busy-seconds.",
    ),
]
_SESSION_GAUGES: list[tuple[str, str, str]] = [
    ("resident_bytes", "resident_bytes", "Bytes of this session's memory on the GPU."),
    ("swapped_bytes", "swapped_bytes", "Bytes of this session's GPU memory in host memory."),
    ("memory_limit_bytes", "memory_limit_bytes", "This session's GPU memory limit."),
    (
        "memory_request_bytes",
        "memory_request_bytes",
        "This session's GPU memory request (what the node guarantees and packs by).",
    ),
    ("weight", "weight", "This session's weight under policy weighted."),
    ("turn_credit_seconds", "turn_credit_seconds", "This session's turn credit, GPU seconds."),
    (
        "usual_burst_seconds",
        "usual_burst_seconds",
        "The lower median of this session's recent bursts, GPU seconds (0: none yet).",
    ),
    (
        "measured_use_ratio",
        "measured_use_ratio",
        "The fraction of the last minute or so this session wanted the GPU.",
    ),
]
# (metric, help, the fields out and in) for per-session counters by direction
_SESSION_SWAPS: list[tuple[str, str, str, str]] = [
    ("swaps", "Swaps by direction.", "swap_out_total", "swap_in_total"),
    (
        "swap_bytes",
        "Bytes swapped by direction.",
        "swap_out_bytes_total",
        "swap_in_bytes_total",
    ),
    (
        "swap_seconds",
        "Seconds spent swapping.",
        "swap_out_seconds_total",
        "swap_in_seconds_total",
    ),
]
# Every SessionStatus field the session's lines show (beside its GPU and id): when none
# changed since the last scrape, its lines are the last scrape's.
_SHOWN = attrgetter(
    "namespace",
    "pod",
    "container",
    "name",
    "uid",
    "state",
    "gang",
    "gang_rank",
    "wait_seconds_completed_total",
    "wait_seconds_buckets",
    *(f for _, f, _ in _SESSION_COUNTERS),
    *(f for _, f, _ in _SESSION_GAUGES),
    *(f for _, _, o, i in _SESSION_SWAPS for f in (o, i)),
)
# (metric, the WorkloadStatus field, help) for a workload's counters
_WORKLOAD_COUNTERS: list[tuple[str, str, str]] = [
    ("sessions", "sessions_total", "Sessions this workload attached."),
    ("lease_seconds", "lease_seconds_total", "Seconds its sessions held a lease."),
    ("wait_seconds", "wait_seconds_total", "Seconds its sessions waited for the GPU."),
    ("grants", "grants_total", "Leases granted to its sessions."),
    ("revokes", "revokes_total", "Leases revoked from its sessions."),
    (
        "utilization_seconds",
        "utilization_seconds_total",
        "GPU utilization attributed to its sessions, busy-seconds.",
    ),
]
_WORKLOAD_SHOWN = attrgetter(
    *(f for _, f, _ in _WORKLOAD_COUNTERS), "swap_out_bytes_total", "swap_in_bytes_total"
)
_LE = [repr(float(b)) for b in WAIT_BUCKETS] + ["+Inf"]
_STATES = [st.value for st in State]


# --- the text format, as prometheus_client's generate_latest writes it ------------------
def value(v: float) -> str:
    """A sample's value as Go (and prometheus_client) write it: exponents from 1e7."""
    if v.__class__ is int and 0 <= v < 10**15:  # counts and bytes: the same, sooner
        if v < len(_SMALL):
            return _SMALL[v]
        s = str(v)
        if len(s) <= 6:
            return s + ".0"
        return f"{s[0]}.{s[1:]}".rstrip("0.") + f"e+{len(s) - 1:02d}"
    d = float(v)
    if math.isinf(d):
        return "+Inf" if d > 0 else "-Inf"
    if math.isnan(d):
        return "NaN"
    s = repr(d)
    dot = s.find(".")
    if d > 0 and dot > 6:
        mantissa = f"{s[0]}.{s[1:dot]}{s[dot + 1 :]}".rstrip("0.")
        return f"{mantissa}e+{dot - 1:02d}"
    return s


_SMALL = [f"{i}.0" for i in range(1024)]


def _escape(v: str) -> str:
    return v.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _header(name: str, kind: str, help_: str) -> str:
    doc = help_.replace("\\", r"\\").replace("\n", r"\n")
    return f"# HELP {name} {doc}\n# TYPE {name} {kind}\n"


class Labels:
    """One label set, written sorted by name (as prometheus_client does), alone or with
    one more label in its place (its value given escaped: most are constants)."""

    __slots__ = ("_pairs", "_splits", "plain")

    def __init__(self, **labels: str) -> None:
        self._pairs = sorted((k, f'{k}="{_escape(v)}"') for k, v in labels.items())
        self.plain = "{" + ",".join(p for _, p in self._pairs) + "}"
        self._splits: dict[str, tuple[str, str]] = {}

    def with_(self, name: str, v: str) -> str:
        pre, post = self.around(name)
        return f"{pre}{v}{post}"

    def plus(self, **more: str) -> str:
        """These and ``more`` (values as they are: escaped here)."""
        pairs = sorted([*self._pairs, *((k, f'{k}="{_escape(v)}"') for k, v in more.items())])
        return "{" + ",".join(p for _, p in pairs) + "}"

    def around(self, name: str) -> tuple[str, str]:
        """What goes before and after the value of label ``name``, added to these."""
        split = self._splits.get(name)
        if split is None:
            before = ",".join(p for k, p in self._pairs if k < name)
            after = ",".join(p for k, p in self._pairs if k > name)
            split = self._splits[name] = (
                "{" + before + "," * bool(before) + f'{name}="',
                '"' + "," * bool(after) + after + "}",
            )
        return split


# --- the lines of a session, of a workload -------------------------------------------------
Lines = Callable[[Any, Labels], str]  # one row's (a SessionStatus, a WorkloadStatus)


@lru_cache(maxsize=1024)
def user_name(uid: int) -> str:
    """The uid's name on this node, else the number (a container's user, say)."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _one(metric: str, field: str) -> Lines:
    get = attrgetter(field)
    return lambda s, lab: f"{metric}{lab.plain} {value(get(s))}\n"


def _by_direction(metric: str, out: str, in_: str) -> Lines:
    def lines(s: Any, lab: Labels) -> str:
        pre, post = lab.around("direction")
        return (
            f"{metric}{pre}out{post} {value(getattr(s, out))}\n"
            f"{metric}{pre}in{post} {value(getattr(s, in_))}\n"
        )

    return lines


def _waits(s: SessionStatus, lab: Labels) -> str:
    pre, post = lab.around("le")
    cums = list(itertools.accumulate(s.wait_seconds_buckets))
    return "".join(
        [
            *(
                f"gpushare_wait_seconds_bucket{pre}{le}{post} {value(n)}\n"
                for le, n in zip(_LE, cums, strict=True)
            ),
            f"gpushare_wait_seconds_count{lab.plain} {value(cums[-1])}\n",
            f"gpushare_wait_seconds_sum{lab.plain} {value(s.wait_seconds_completed_total)}\n",
        ]
    )


def _state(s: SessionStatus, lab: Labels) -> str:
    pre, post = lab.around("state")
    return "".join(
        [f"gpushare_session_state{pre}{st}{post} {_one_if(s.state == st)}\n" for st in _STATES]
    )


def _info(s: SessionStatus, lab: Labels) -> str:
    return f"gpushare_session_info{lab.plus(name=s.name, user=user_name(s.uid))} 1.0\n"


def _gang(s: SessionStatus, lab: Labels) -> str:
    """A rank of a distributed job: its job (the node's gang key) and its rank; no line
    for a session of its own."""
    if not s.gang:
        return ""
    return f"gpushare_session_gang_info{lab.plus(gang=s.gang, rank=str(s.gang_rank))} 1.0\n"


# (header, its lines for one session), in the order they are exposed
_SESSION_FAMILIES: list[tuple[str, Lines]] = [
    *(
        (_header(f"gpushare_{m}_total", "counter", h), _one(f"gpushare_{m}_total", f))
        for m, f, h in _SESSION_COUNTERS
    ),
    *(
        (_header(f"gpushare_{m}", "gauge", h), _one(f"gpushare_{m}", f))
        for m, f, h in _SESSION_GAUGES
    ),
    *(
        (_header(f"gpushare_{m}_total", "counter", h), _by_direction(f"gpushare_{m}_total", o, i))
        for m, h, o, i in _SESSION_SWAPS
    ),
    (
        _header(
            "gpushare_wait_seconds",
            "histogram",
            "Seconds from asking for the GPU to being granted it.",
        ),
        _waits,
    ),
    (_header("gpushare_session_state", "gauge", "1 for the session's state."), _state),
    (
        _header(
            "gpushare_session_info",
            "gauge",
            "Who each session is: its name and user (join on gpu and session).",
        ),
        _info,
    ),
    (
        _header(
            "gpushare_session_gang_info",
            "gauge",
            "The distributed job (gang) a session is a rank of, and its rank (join on gpu"
            " and session).",
        ),
        _gang,
    ),
]
_WORKLOAD_FAMILIES: list[tuple[str, Lines]] = [
    *(
        (
            _header(f"gpushare_workload_{m}_total", "counter", h),
            _one(f"gpushare_workload_{m}_total", f),
        )
        for m, f, h in _WORKLOAD_COUNTERS
    ),
    (
        _header(
            "gpushare_workload_swap_bytes_total",
            "counter",
            "Bytes its sessions swapped, by direction.",
        ),
        _by_direction(
            "gpushare_workload_swap_bytes_total", "swap_out_bytes_total", "swap_in_bytes_total"
        ),
    ),
]


@dataclass(frozen=True)
class _Rows:
    """A kind of row (a session, a workload): its families, what tells one from another
    on a GPU, what its lines show, and its labels."""

    families: list[tuple[str, Lines]]
    ident: Callable[[Any], Hashable]
    shown: Callable[[Any], Any]
    labels: Callable[[GpuStatus, Any], Labels]


_SESSIONS = _Rows(
    _SESSION_FAMILIES,
    attrgetter("id"),
    _SHOWN,
    lambda g, s: Labels(
        gpu=str(g.index),
        gpu_uuid=g.uuid,
        namespace=s.namespace,
        pod=s.pod,
        container=s.container,
        session=str(s.id),
    ),
)
_WORKLOADS = _Rows(
    _WORKLOAD_FAMILIES,
    attrgetter("name", "namespace", "pod", "container"),
    _WORKLOAD_SHOWN,
    lambda g, w: Labels(
        gpu=str(g.index),
        gpu_uuid=g.uuid,
        namespace=w.namespace,
        pod=w.pod,
        container=w.container,
        name=w.name,
    ),
)

_BUILD = _header("gpushare_build_info", "gauge", "gpushare version and Python.") + (
    f"gpushare_build_info{Labels(version=__version__, python=platform.python_version()).plain}"
    " 1.0\n"
)


class Exposition:
    """Writes the exposition of a snapshot. Thread-safe (scrapes take turns); keeps each
    session's (and workload's) lines until one of its figures changes or it is gone."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # per kind of row: (gpu, gpu uuid, row) -> (its shown figures, its lines per family)
        self._last: dict[int, dict[tuple[int, str, Hashable], tuple[Any, list[bytes]]]] = {}

    def render(self, st: NodeStatus) -> bytes:
        with self._lock:
            gpus = [
                (g, Labels(gpu=str(g.index), gpu_uuid=g.uuid, simulated=_bool(g.simulated)))
                for g in st.gpus
            ]
            out = ["".join(self._gpu_text(gpus)).encode()]
            for kind, items in (
                (_SESSIONS, [(g, s) for g in st.gpus for s in g.sessions]),
                (_WORKLOADS, [(g, w) for g in st.gpus for w in g.workloads]),
            ):
                rows = self._rows(kind, items)
                for i, (header, _) in enumerate(kind.families):
                    out.append(header.encode())
                    out.extend([r[i] for r in rows])
            return b"".join(out)  # one copy (joining per family first took 10x as long)

    def _gpu_text(self, gpus: list[tuple[GpuStatus, Labels]]) -> Iterator[str]:  # noqa: C901
        yield _BUILD
        yield _header("gpushare_gpu_info", "gauge", "Each GPU the node arbitrates.")
        for g, lab in gpus:
            yield f"gpushare_gpu_info{lab.with_('name', _escape(g.name))} 1.0\n"
        for metric, h, fig in _GPU_GAUGES:
            yield from _per_gpu(f"gpushare_{metric}", "gauge", h, fig, gpus)
        yield _header("gpushare_mode", "gauge", "1 for the GPU's arbitration mode.")
        for g, lab in gpus:
            for m in MODES:
                yield f"gpushare_mode{lab.with_('mode', m)} {_one_if(g.mode == m)}\n"
        yield _header("gpushare_policy", "gauge", "1 for the GPU's share policy.")
        for g, lab in gpus:
            for pol in POLICIES:
                yield f"gpushare_policy{lab.with_('policy', pol)} {_one_if(g.policy == pol)}\n"
        for metric, h, fig in _GPU_COUNTERS:
            yield from _per_gpu(f"gpushare_{metric}_total", "counter", h, fig, gpus)
        yield _header("gpushare_sessions", "gauge", "Sessions by state.")
        for g, lab in gpus:
            counts = dict.fromkeys([x.value for x in State], 0)
            for s in g.sessions:
                counts[s.state] += 1
            for state, n in counts.items():
                yield f"gpushare_sessions{lab.with_('state', state)} {value(n)}\n"
        yield _header(
            "gpushare_gang_regroups_total",
            "counter",
            "Parked ranks of a distributed job let go on to their next safe point (one of"
            " its ranks was blocked in a collective).",
        )
        for g, lab in gpus:
            for k in g.gangs:
                yield f"gpushare_gang_regroups_total{lab.with_('gang', _escape(k.gang))}"
                yield f" {value(k.regroups_total)}\n"

    def _rows(self, kind: _Rows, items: list[tuple[GpuStatus, Any]]) -> list[list[bytes]]:
        """Each row's lines per family, the last scrape's where nothing they show changed."""
        last, kept = self._last.get(id(kind), {}), {}
        rows = []
        for g, x in items:
            key = (g.index, g.uuid, kind.ident(x))
            shown = kind.shown(x)
            had = last.get(key)
            if had is None or had[0] != shown:
                lab = kind.labels(g, x)
                had = (shown, [lines(x, lab).encode() for _, lines in kind.families])
            kept[key] = had
            rows.append(had[1])
        self._last[id(kind)] = kept  # rows gone are forgotten
        return rows


def _per_gpu(
    name: str,
    kind: str,
    help_: str,
    fig: Callable[[GpuStatus], float],
    gpus: list[tuple[GpuStatus, Labels]],
) -> Iterator[str]:
    yield _header(name, kind, help_)
    for g, lab in gpus:
        yield f"{name}{lab.plain} {value(fig(g))}\n"


def _bool(b: bool) -> str:
    return "true" if b else "false"


def _one_if(b: bool) -> str:
    return "1.0" if b else "0.0"


# --- serving ------------------------------------------------------------------------------
# Bounds of the exporter's HTTP server: connections served at once (more are closed as
# they come: 4,000 half-sent requests once held 4,002 threads), and how long one may take
# to send its whole request (a byte now and then kept a slot for ever: 64 such blocked
# every scrape), and then to read the answer.
MAX_CONNECTIONS = 64
HTTP_TIMEOUT_S = 10.0


class _ByDeadline(io.RawIOBase):
    """A socket's reads, all of them together within ``deadline`` (monotonic): each
    waits only for what is left of it, then the connection is timed out."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        super().__init__()
        self.sock, self.deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        left = self.deadline - time.monotonic()
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
            _ByDeadline(self.connection, time.monotonic() + HTTP_TIMEOUT_S)
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


# --- for Python callers (and tests): the exposition as prometheus_client's families -----
class _Parsed(Collector):
    def __init__(self, text: Callable[[], bytes]) -> None:
        self.text = text

    def collect(self) -> Iterator[Metric]:
        yield from text_string_to_metric_families(self.text().decode())


def registry_for(snapshot: Callable[[], NodeStatus]) -> CollectorRegistry:
    """A registry whose collection is the exposition of ``snapshot()``, parsed (slow:
    for tests and tools, not for serving)."""
    exposition = Exposition()
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Parsed(lambda: exposition.render(snapshot())))
    return reg

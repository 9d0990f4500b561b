"""The node daemon: moves messages and state in and out of one arbiter per GPU.

It decides nothing itself. Workload connections arrive on one Unix socket, administration
on a second one (mode 0600, peer uid checked); every input goes to the GPU's arbiter and
every action that comes back is sent, logged or applied here.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import logging
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from gpushare import protocol as p
from gpushare.core.arbiter import (
    ESCALATIONS,
    MODES,
    POLICIES,
    Action,
    Arbiter,
    ArbiterError,
    EscalateAction,
    EventAction,
    GpuSettings,
    GrantAction,
    RevokeAction,
    RoomAction,
    SwapOutAction,
)
from gpushare.core.attribution import Attribution
from gpushare.core.clock import Clock
from gpushare.node import snapshot as status
from gpushare.node.clock import SystemClock
from gpushare.node.config import ConfigError, NodeConfig, gpu_settings, load, persist
from gpushare.node.events import EventBus
from gpushare.node.gpus import GpuInfo
from gpushare.node.identity import CgroupIdentity, groups_of, peer_credentials, read_identity
from gpushare.node.k8s import PodCache, PodWatcher
from gpushare.node.utilization import NvmlUtilization
from gpushare.simlink import SimLink
from gpushare.units import format_size, parse_size

log = logging.getLogger("gpushare.node.daemon")


@dataclass
class Conn:
    writer: asyncio.StreamWriter
    pid: int
    uid: int
    gid: int
    session: int = 0
    gpu: int = 0
    info: dict[str, Any] = field(default_factory=dict)  # what the client claims
    identity: CgroupIdentity = field(default_factory=CgroupIdentity)  # what the kernel says
    verified: bool = False  # the claimed pod UID is the kernel's
    frozen: bool = False
    tokens: float = 0.0
    refilled: float = 0.0

    def send(self, msg: p.Message) -> None:
        if not self.writer.is_closing():
            self.writer.write(p.encode(msg))

    def spend(self, rate: float) -> bool:
        """One message from the token bucket (``rate``/s, bursts of twice that)."""
        now = time.monotonic()
        self.tokens = min(2 * rate, self.tokens + (now - self.refilled) * rate)
        self.refilled = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


class Refused(Exception):
    """A request this connection may not make; it is answered, logged, and closed."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


async def read_frame(reader: asyncio.StreamReader) -> p.Message:
    header = await reader.readexactly(p.HEADER_SIZE)
    body = await reader.readexactly(p.frame_length(header))
    return p.decode(body)


class Node:
    def __init__(
        self,
        config: NodeConfig,
        gpus: list[GpuInfo],
        config_path: str = "",
        clock: Clock | None = None,
        nvml: Any = None,
        state_path: str = "",
        flags: dict[str, Any] | None = None,
    ) -> None:
        if not gpus:
            raise ValueError("a node needs at least one GPU")
        self.config = config
        self.config_path = config_path
        self.state_path = state_path
        self.flags = flags or {}
        self._config_text: bytes | None = self._read_config_text()
        self.gpus = gpus
        self.clock = clock or SystemClock()
        self.events = EventBus(config.event_log)
        reserve = parse_size(config.reserve)
        self.arbiters: list[Arbiter] = []
        for g in gpus:
            settings = GpuSettings(
                grace_s=config.grace, overlap=config.overlap, **gpu_settings(config, g.index)
            )
            if g.memory_bytes - reserve <= 0:
                raise ValueError(f"reserve {config.reserve} leaves nothing of GPU {g.index}")
            self.arbiters.append(Arbiter(g.index, g.memory_bytes - reserve, self.clock, settings))
        self.conns: dict[int, Conn] = {}
        self._next_session = 1
        self._timers: dict[int, asyncio.TimerHandle] = {}
        self._servers: list[asyncio.Server] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self.started = time.time()
        self.utilization = [Attribution() for _ in gpus]
        self._nvml_util = {
            g.index: NvmlUtilization(nvml, g.index) for g in gpus if nvml and not g.simulated
        }
        self._stop_metrics: Any = None
        self.pods: PodCache | None = None  # pod names from the Kubernetes API
        self._pod_watcher: PodWatcher | None = None
        self.metrics_port = 0

    # --- life -----------------------------------------------------------------------

    def _sim_link(self, gpu: int) -> str:
        return f"{self.config.socket}.link{gpu}"

    async def start(self) -> None:
        self._servers.append(await _serve_unix(self._workload_conn, self.config.socket, mode=0o666))
        for g in self.gpus:  # the simulated links' shared state, beside the socket
            if g.simulated:
                SimLink.create(self._sim_link(g.index))
        gid = self._admin_gid()
        self._servers.append(
            await _serve_unix(
                self._admin_conn, self.config.admin_socket, mode=0o600 if gid is None else 0o660
            )
        )
        if gid is not None:
            os.chown(self.config.admin_socket, -1, gid)
        for g, a in zip(self.gpus, self.arbiters, strict=True):
            s = a.settings
            log.info(
                "GPU %d: %s%s, %s usable, TQ %g s, mode %s, policy %s",
                g.index,
                g.name,
                " [simulated]" if g.simulated else "",
                format_size(a.capacity),
                s.tq_s,
                s.mode,
                s.policy,
            )
        log.info("workloads: %s  admin: %s", self.config.socket, self.config.admin_socket)
        self._spawn(self._sample_utilization())
        if self.config.kubernetes and self.pods is None:
            node = self.config.node_name or os.environ.get("NODE_NAME") or socket.gethostname()
            self.pods = PodCache()
            self._pod_watcher = PodWatcher(self.pods, node).start()
            log.info("pod names from the Kubernetes API, pods of node %s", node)
        if self.config_path:
            self._spawn(self._watch_config())
        if self.config.metrics_port:
            try:
                from gpushare.node import metrics
            except ImportError:
                raise OSError(
                    "the metrics exporter needs prometheus-client: pip install"
                    " 'gpushare[node]', or pass --metrics-port 0"
                ) from None

            loop = asyncio.get_running_loop()

            def snapshot() -> dict[str, Any]:
                # Made in the event loop, so one scrape sees one consistent state.
                async def take() -> dict[str, Any]:
                    return self.status()

                return asyncio.run_coroutine_threadsafe(take(), loop).result(timeout=5)

            self._stop_metrics = metrics.serve(
                metrics.registry_for(snapshot),
                self.config.metrics_port,
                self.config.metrics_address,
            )
            self.metrics_port = self.config.metrics_port
            log.info(
                "metrics: http://%s:%d/metrics", self.config.metrics_address, self.metrics_port
            )

    def _spawn(self, coro: Any) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _sample_utilization(self, period: float = 1.0) -> None:
        """Once a period: the GPU's utilization, credited to the lease holders."""
        last = time.monotonic()
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            dt, last = now - last, now
            for g, arb, att in zip(self.gpus, self.arbiters, self.utilization, strict=True):
                sampler = self._nvml_util.get(g.index)
                try:
                    if sampler is None:  # the simulated GPU's model: busy while leased
                        ratio, procs = (1.0 if arb.holders else 0.0), None
                    else:
                        ratio = sampler.device()
                        procs = sampler.processes() if len(arb.holders) > 1 else None
                        used = sampler.memory()
                except Exception as e:  # a flaky driver must not stop the node
                    log.warning("GPU %d: utilization sample failed: %s", g.index, e)
                    continue
                pids = {sid: c.pid for sid, c in self.conns.items() if c.gpu == g.index}
                att.credit(ratio, dt, list(arb.holders), procs, pids)
                if sampler is not None:  # the GPU's own view of each session's memory
                    allowance = parse_size(self.config.nvml_allowance)
                    for sid, pid in pids.items():
                        if pid in used and sid in arb.sessions:
                            self._apply(arb, arb.over_limit(sid, used[pid] - allowance))

    def _read_config_text(self) -> bytes | None:
        try:
            return open(self.config_path, "rb").read() if self.config_path else None
        except OSError:
            return None

    async def _watch_config(self, period: float = 1.0) -> None:
        """Apply changes to the config file live (a ConfigMap update lands this way)."""
        while True:
            await asyncio.sleep(period)
            text = self._read_config_text()
            if text == self._config_text:
                continue
            self._config_text = text
            self.reload()

    def reload(self) -> None:
        """Merge the files and flags again; apply what changed in them, from the next
        quantum. A live change made with ctl stays unless the same key changed."""
        try:
            new = load(self.config_path, self.state_path, self.flags)
        except ConfigError as e:
            log.error("%s: keeping the configuration in force", e)
            return
        for arb in self.arbiters:
            arb.settings.overlap = new.overlap  # the next switch is planned with it
            before, after = gpu_settings(self.config, arb.gpu), gpu_settings(new, arb.gpu)
            change = {k: v for k, v in after.items() if before[k] != v}
            if change:
                log.info(
                    "config %s changed: GPU %d %s (from the next quantum)",
                    self.config_path,
                    arb.gpu,
                    change,
                )
                self._apply(arb, arb.configure(**change))
        restart = [
            k
            for k in ("socket", "admin_socket", "metrics_port", "sim_gpus", "reserve")
            if getattr(new, k) != getattr(self.config, k)
        ]
        if restart:
            log.warning(
                "config %s changed %s: takes effect when the node restarts",
                self.config_path,
                ", ".join(restart),
            )
        self.config = new

    async def run(self) -> None:
        await self.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("stopping")
        await self.stop()

    async def stop(self) -> None:
        for srv in self._servers:
            srv.close()
        for c in list(self.conns.values()):
            c.writer.close()
        for t in self._timers.values():
            t.cancel()
        for task in list(self._tasks):
            task.cancel()
        if self._stop_metrics:
            self._stop_metrics()
        if self._pod_watcher:
            self._pod_watcher.stop()
        links = [self._sim_link(g.index) for g in self.gpus if g.simulated]
        for path in (self.config.socket, self.config.admin_socket, *links):
            with contextlib.suppress(OSError):
                os.unlink(path)
        self.events.close()

    # --- actions --------------------------------------------------------------------

    def _apply(self, arb: Arbiter, actions: list[Action]) -> None:
        for a in actions:
            if isinstance(a, EventAction):
                self.events.publish(a.record)
                continue
            c = self.conns.get(a.session)
            if isinstance(a, GrantAction):
                if c and a.thaw:
                    self._signal(c, signal.SIGCONT)
                    c.frozen = False
                if c:
                    c.send(
                        p.Grant(
                            lease=a.lease,
                            swap_in=a.swap_in,
                            quantum_s=a.quantum_s,
                            shared=a.shared,
                            room=a.room,
                        )
                    )
            elif isinstance(a, RevokeAction):
                if c:
                    c.send(p.Revoke(lease=a.lease, swap_out=a.swap_out, grace_s=a.grace_s))
            elif isinstance(a, SwapOutAction):
                if c:
                    c.send(p.SwapOut(bytes=a.bytes))
            elif isinstance(a, RoomAction):
                if c:
                    c.send(p.Room(room=a.room))
            elif isinstance(a, EscalateAction):
                self._escalate(a, c)
        self._schedule(arb)

    def _escalate(self, a: EscalateAction, c: Conn | None) -> None:
        who = f"session {a.session}" + (f" (pid {c.pid})" if c else "")
        log.warning("escalation %s for %s: %s", a.escalation, who, a.reason)
        if c is None:
            return
        if a.escalation == "kill":
            self._signal(c, signal.SIGCONT if c.frozen else 0)
            self._signal(c, signal.SIGKILL)
        elif a.escalation == "freeze" and a.reason == "no_yield_within_grace":
            c.frozen = True
            self._signal(c, signal.SIGSTOP)

    @staticmethod
    def _signal(c: Conn, sig: int) -> None:
        if c.pid > 1 and sig:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(c.pid, sig)

    def _new_conn(self, writer: asyncio.StreamWriter) -> Conn:
        """A connection, with its peer from the kernel and a full message allowance."""
        peer = peer_credentials(writer.get_extra_info("socket"))
        rate = self.config.max_messages_per_s
        return Conn(
            writer, peer.pid, peer.uid, peer.gid, tokens=2 * rate, refilled=time.monotonic()
        )

    def _refuse(self, conn: Conn, where: str, code: str, message: str) -> None:
        """Log a refusal, make it an event, then answer it (in that order: whoever reads
        the answer finds the event already written)."""
        log.warning(
            "refused pid %d uid %d on the %s socket: %s", conn.pid, conn.uid, where, message
        )
        self.events.publish(
            {
                "ts": self.clock.wall(),
                "gpu": None,
                "event": "refused",
                "session": conn.session or None,
                "pid": conn.pid,
                "uid": conn.uid,
                "socket": where,
                "code": code,
                "reason": message,
            }
        )
        conn.send(p.Error(code=code, message=message))

    def _schedule(self, arb: Arbiter) -> None:
        old = self._timers.pop(arb.gpu, None)
        if old:
            old.cancel()
        when = arb.next_deadline()
        if when is not None:
            loop = asyncio.get_running_loop()
            # The arbiter's clock and the loop's are both time.monotonic().
            self._timers[arb.gpu] = loop.call_at(when, self._on_timer, arb)

    def _on_timer(self, arb: Arbiter) -> None:
        self._timers.pop(arb.gpu, None)
        self._apply(arb, arb.tick())

    # --- workloads ------------------------------------------------------------------

    async def _workload_conn(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        conn = self._new_conn(writer)
        arb: Arbiter | None = None
        try:
            try:
                hello = await asyncio.wait_for(read_frame(reader), self.config.hello_timeout)
            except TimeoutError:
                raise Refused(
                    "timeout", f"no hello within {self.config.hello_timeout:g} s"
                ) from None
            if not isinstance(hello, p.Hello):
                raise p.ProtocolError(f"first message must be hello, not {type(hello).__name__}")
            arb = self._attach(conn, hello)
            if arb is None:
                return
            while True:
                msg = await read_frame(reader)
                if not conn.spend(self.config.max_messages_per_s):
                    raise Refused(
                        "rate",
                        f"more than {self.config.max_messages_per_s:g} messages"
                        " per second: slow down",
                    )
                try:
                    self._apply(arb, self._workload_msg(arb, conn.session, msg))
                except ArbiterError as e:
                    conn.send(p.Error(code="state", message=str(e)))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except Refused as e:
            self._refuse(conn, "workload", e.code, str(e))
        except p.ProtocolError as e:
            self._refuse(conn, "workload", "protocol", str(e))
        finally:
            if arb is not None and conn.session in self.conns:
                del self.conns[conn.session]
                self.utilization[arb.gpu].forget(conn.session)
                self._apply(arb, arb.detach(conn.session, reason="disconnected"))
            writer.close()

    def _attach(self, conn: Conn, h: p.Hello) -> Arbiter | None:
        mine = sum(1 for c in self.conns.values() if c.uid == conn.uid)
        if mine >= self.config.max_sessions_per_uid:
            raise Refused(
                "limit",
                f"uid {conn.uid} has {mine} sessions, the most allowed"
                " (max_sessions_per_uid): close some first",
            )
        if h.version != p.PROTOCOL_VERSION:
            conn.send(
                p.Error(
                    code="version",
                    message=(
                        f"client speaks protocol {h.version}, this node {p.PROTOCOL_VERSION}:"
                        " use the same gpushare version in workloads and node"
                    ),
                )
            )
            return None
        gpu = 0 if h.gpu is None else h.gpu
        if h.gpu_uuid:
            by_uuid = {g.uuid: g.index for g in self.gpus}
            if h.gpu_uuid not in by_uuid:
                conn.send(
                    p.Error(
                        code="gpu",
                        message=(
                            f"no GPU {h.gpu_uuid} on this node (NVIDIA_VISIBLE_DEVICES): it has "
                            + ", ".join(by_uuid)
                        ),
                    )
                )
                return None
            gpu = by_uuid[h.gpu_uuid]
        if not 0 <= gpu < len(self.arbiters):
            conn.send(
                p.Error(
                    code="gpu",
                    message=(
                        f"no GPU {gpu} on this node (it has {len(self.arbiters)}): choose gpu=0.."
                        f"{len(self.arbiters) - 1}"
                    ),
                )
            )
            return None
        arb = self.arbiters[gpu]
        g = self.gpus[gpu]
        if h.memory_limit is not None:
            limit = h.memory_limit
        elif h.portion is not None and 0 < h.portion <= 1:
            limit = int(arb.capacity * h.portion)
        else:
            limit = arb.capacity
        weight = h.weight if h.weight is not None else 1.0
        sid = self._next_session
        try:
            actions = arb.attach(
                sid,
                h.name or f"pid-{conn.pid}",
                limit,
                weight,
                h.resident,
                h.swapped,
                h.holding,
                h.fills,
            )
        except ArbiterError as e:
            conn.send(p.Error(code="attach", message=str(e)))
            return None
        self._next_session += 1
        conn.session, conn.gpu = sid, gpu
        conn.identity = read_identity(conn.pid, self.config.proc_root)
        conn.verified = bool(conn.identity.pod_uid) and h.pod_uid == conn.identity.pod_uid
        conn.info = {
            "name": h.name,
            "pod": h.pod,
            "namespace": h.namespace,
            "container": h.container,
            "backend": h.backend,
        }
        self.conns[sid] = conn
        conn.send(
            p.Welcome(
                session=sid,
                name=h.name or f"pid-{conn.pid}",
                gpu=gpu,
                gpu_name=g.name,
                gpu_uuid=g.uuid,
                simulated=g.simulated,
                memory_limit=limit,
                weight=weight,
                idle_release_s=self.config.idle_release,
                sim_scale=self.config.sim_scale,
                sim_bandwidth=self.config.sim_bandwidth,
                sim_swap_failure_rate=self.config.sim_swap_failure_rate,
                sim_link=self._sim_link(gpu) if g.simulated else "",
            )
        )
        self._apply(arb, actions)
        return arb

    @staticmethod
    def _workload_msg(arb: Arbiter, sid: int, msg: p.Message) -> list[Action]:
        if isinstance(msg, p.Acquire):
            return arb.acquire(sid)
        if isinstance(msg, p.Release):
            return arb.release(
                sid,
                msg.resident,
                msg.swapped,
                msg.again,
                msg.swapped_out,
                msg.seconds,
                msg.swapping_out,
            )
        if isinstance(msg, p.SwapDone):
            return arb.swap_done(
                sid, msg.direction, msg.bytes, msg.seconds, msg.resident, msg.swapped, msg.error
            )
        if isinstance(msg, p.Report):
            return arb.report(sid, msg.resident, msg.swapped)
        raise Refused(
            "denied",
            f"{type(msg).__name__} is not a workload message: a workload acts only on its own"
            " session (administration uses the admin socket)",
        )

    # --- administration -------------------------------------------------------------

    async def _admin_conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = self._new_conn(writer)
        try:
            if not self._may_administer(conn):
                group = f" or a member of group {self.config.admin_group}" * bool(
                    self.config.admin_group
                )
                raise Refused(
                    "denied",
                    f"uid {conn.uid} may not administer this node: run as"
                    f" root, uid {os.geteuid()}{group}",
                )
            while True:
                msg = await asyncio.wait_for(read_frame(reader), 3600)
                if not conn.spend(self.config.max_messages_per_s):
                    raise Refused("rate", "too many admin requests per second: slow down")
                if isinstance(msg, p.StatusRequest):
                    conn.send(p.StatusReply(status=self.status()))
                elif isinstance(msg, p.SetConfig):
                    conn.send(self._set_config(msg))
                elif isinstance(msg, p.EndSession):
                    conn.send(self._end_session(msg))
                elif isinstance(msg, p.EventsRequest):
                    await self._serve_events(conn, msg)
                    return
                else:
                    raise p.ProtocolError(f"{type(msg).__name__} is not an admin request")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            pass
        except Refused as e:
            self._refuse(conn, "admin", e.code, str(e))
        except p.ProtocolError as e:
            self._refuse(conn, "admin", "protocol", str(e))
        finally:
            writer.close()

    def _admin_gid(self) -> int | None:
        g = self.config.admin_group
        if not g:
            return None
        return int(g) if g.isdigit() else grp.getgrnam(g).gr_gid

    def _may_administer(self, conn: Conn) -> bool:
        # The socket's mode already keeps others out; the peer check holds even if the
        # mode was loosened by hand.
        if conn.uid in (0, os.geteuid()):
            return True
        gid = self._admin_gid()
        return gid is not None and (
            conn.gid == gid or gid in groups_of(conn.pid, self.config.proc_root)
        )

    def _end_session(self, m: p.EndSession) -> p.Message:
        c = self.conns.get(m.session)
        if c is None:
            return p.Error(code="session", message=f"no session {m.session} on this node")
        log.warning("ending session %d (pid %d): %s", m.session, c.pid, m.reason)
        c.send(p.Error(code="ended", message=f"session ended: {m.reason}"))
        if c.frozen:
            self._signal(c, signal.SIGCONT)
        c.writer.close()  # its reader sees the end; the detach follows from there
        return p.Done(message=f"session {m.session} ended")

    def _set_config(self, m: p.SetConfig) -> p.Message:
        if m.gpu is not None and not 0 <= m.gpu < len(self.arbiters):
            return p.Error(code="gpu", message=f"no GPU {m.gpu} on this node")
        if m.mode is not None and m.mode not in MODES:
            return p.Error(code="value", message=f"mode must be one of {', '.join(MODES)}")
        if m.policy is not None and m.policy not in POLICIES:
            return p.Error(code="value", message=f"policy must be one of {', '.join(POLICIES)}")
        if m.escalation is not None and m.escalation not in ESCALATIONS:
            return p.Error(
                code="value", message=f"escalation must be one of {', '.join(ESCALATIONS)}"
            )
        targets = self.arbiters if m.gpu is None else [self.arbiters[m.gpu]]
        try:
            for arb in targets:
                self._apply(arb, arb.configure(m.tq_s, m.mode, m.policy, m.escalation))
        except ArbiterError as e:
            return p.Error(code="value", message=str(e))
        for arb in targets:
            s = arb.settings
            log.info(
                "GPU %d: TQ %g s, mode %s, policy %s (from next quantum)",
                arb.gpu,
                s.tq_s,
                s.mode,
                s.policy,
            )
        persisted = ""
        if m.persist:
            target = self.state_path or self.config_path
            if not target:
                return p.Error(
                    code="persist",
                    message=(
                        "changed live but not persisted: the node runs without --config FILE"
                        " or --state FILE"
                    ),
                )
            values: dict[str, Any] = {}
            if m.tq_s is not None:
                values["tq"] = m.tq_s
            if m.mode is not None:
                values["mode"] = m.mode
            if m.policy is not None:
                values["policy"] = m.policy
            if m.escalation is not None:
                values["escalation"] = m.escalation
            try:
                persist(target, m.gpu, **values)
                self.config = load(self.config_path, self.state_path, self.flags)
                self._config_text = self._read_config_text()
            except (OSError, ValueError) as e:
                return p.Error(code="persist", message=f"changed live, not persisted: {e}")
            persisted = target
            log.info("persisted %s to %s", values, persisted)
        return p.ConfigReply(gpus=[self._gpu_settings(a) for a in targets], persisted_to=persisted)

    @staticmethod
    def _gpu_settings(a: Arbiter) -> dict[str, Any]:
        return {
            "escalation": a.settings.escalation,
            "index": a.gpu,
            "tq_s": a.settings.tq_s,
            "mode": a.settings.mode,
            "policy": a.settings.policy,
        }

    async def _serve_events(self, conn: Conn, m: p.EventsRequest) -> None:
        since = time.time() - m.since_s if m.since_s is not None else None
        q = self.events.follow() if m.follow else None
        try:
            for rec in self.events.select(since, m.session):
                conn.send(p.EventMsg(event=rec))
            conn.send(p.EventsEnd())
            await conn.writer.drain()
            if q is None:
                return
            while (live := await q.get()) is not None:
                if m.session is None or live.get("session") == m.session:
                    conn.send(p.EventMsg(event=live))
                    await conn.writer.drain()
        finally:
            if q is not None:
                self.events.followers.discard(q)

    # --- status ---------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        gpus = []
        for g, a, att in zip(self.gpus, self.arbiters, self.utilization, strict=True):
            sessions = [
                {**status.session(a, s, att), **status.identity(self.conns.get(s.id), self.pods)}
                for s in a.sessions.values()
            ]
            gpus.append(status.gpu(g, a, att, sessions))
        return {
            "node": {"pid": os.getpid(), "started": self.started, "config": self.config_path},
            "gpus": gpus,
        }


async def _serve_unix(cb: Any, path: str, mode: int) -> asyncio.Server:
    d = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(d, exist_ok=True)
    except OSError as e:
        raise OSError(f"cannot create {d}: {e.strerror}; choose another socket path") from None
    if os.path.exists(path):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # stale, from a node that died
        else:
            raise OSError(f"another gpushare node is serving {path}")
        finally:
            probe.close()
    old = os.umask(0o777 & ~mode)  # born with the right mode: no window where it is wider
    try:
        srv = await asyncio.start_unix_server(cb, path=path)
    finally:
        os.umask(old)
    os.chmod(path, mode)
    return srv

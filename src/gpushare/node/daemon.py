"""The node daemon's composition root: it builds the parts, starts and stops them.

It decides nothing itself: one arbiter per GPU decides (gpushare.core), and the parts
here move messages and state in and out of them, one job each:

* ``workload_server``: the workload socket (hello, then a session's messages);
* ``admin_server``: the admin socket (status, settings, ending sessions, events);
* ``guard``: connection identity, rate and session limits, the one refusal path;
* ``decisions``: every input's actions go there: delivered, the GPU's timer set, the
  GPUs linked through a gang ticked until nothing follows;
* ``dispatch``: the one place actions leave (messages, signals);
* ``live_config``: the config file watched and applied, ``--persist`` written down;
* ``utilization``: sampling, credited through the lease; NVML's memory view checked;
* ``snapshot``: the typed status; ``exporter``: the metrics exporter's process, which
  asks for it (``metrics``: its text);
* ``recovery``: the records a restarted node recovers its sessions from, and the window
  in which it grants nothing until they are back;
* ``safefs``: the node's files, in directories it checked, never through a symlink.

Time comes from one injected clock; on :mod:`gpushare.node.host.virtual_time`'s loop a test
drives the whole running node with fake time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import signal
import socket
from typing import TYPE_CHECKING, Any

import msgspec

from gpushare.core import events as typed
from gpushare.core.arbiter import Arbiter
from gpushare.core.attribution import Attribution
from gpushare.core.clock import Clock
from gpushare.core.coordinator import Coordinator
from gpushare.node.decide.decisions import Decisions
from gpushare.node.decide.dispatch import Dispatch, Signaller
from gpushare.node.guard import Conn, Guard, admin_gid
from gpushare.node.host.clock import SystemClock
from gpushare.node.host.gpus import GpuInfo
from gpushare.node.host.procs import ProcRef, pidfd_signal
from gpushare.node.host.sockets import Handlers, serve_unix
from gpushare.node.keep.config import NodeConfig, check_gpus, settings_for
from gpushare.node.keep.events import EventBus
from gpushare.node.keep.recovery import Recovery, SessionRecord
from gpushare.node.keep.safefs import SafeDir
from gpushare.node.keep.totals import Totals
from gpushare.node.kube.gpusharenode import NodeObject
from gpushare.node.kube.k8s import PodCache, PodWatcher
from gpushare.node.observe import snapshot
from gpushare.node.observe.utilization import NvmlUtilization, Sampler
from gpushare.node.serve.admin_server import AdminServer
from gpushare.node.serve.live_config import LiveConfig
from gpushare.node.serve.prepared_claims import PreparedClaims
from gpushare.node.serve.workload_server import WorkloadServer
from gpushare.settings import GpuSettings
from gpushare.simlink import SimLink
from gpushare.status import NodeInfo, NodeStatus
from gpushare.units import format_size, parse_size

if TYPE_CHECKING:
    from gpushare.node.observe.exporter import Exporter

log = logging.getLogger("gpushare.node.daemon")


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
        signaller: Signaller | None = None,
    ) -> None:
        if not gpus:
            raise ValueError("a node needs at least one GPU")
        check_gpus(config, len(gpus))  # a [gpu.N] table for a GPU it lacks: a mistake
        self.gpus = gpus
        self.clock = clock or SystemClock()
        # Its directories, checked once and held open: sockets and link files beside the
        # workload socket, the session records beside the admin socket (or recovery_dir).
        self.rundir = SafeDir(os.path.dirname(os.path.abspath(config.socket)))
        self.admindir = SafeDir(os.path.dirname(os.path.abspath(config.admin_socket)))
        recdir = SafeDir(config.recovery_dir) if config.recovery_dir else self.admindir
        self.events = EventBus(config.event_log)
        self.conns: dict[int, Conn] = {}  # attached sessions' connections, by session id
        self._initial = config
        self.recovery = Recovery(recdir, len(gpus), self._records, self._proc_root)
        self.recovery.load()
        reserve = parse_size(config.reserve)
        self.arbiters: list[Arbiter] = []
        for g in gpus:
            settings = GpuSettings(grace_s=config.grace, **settings_for(config, g.index))
            if g.memory_bytes - reserve <= 0:
                raise ValueError(f"reserve {config.reserve} leaves nothing of GPU {g.index}")
            self.arbiters.append(
                Arbiter(
                    g.index,
                    g.memory_bytes - reserve,
                    self.clock,
                    settings,
                    lease_base=self.recovery.lease_floor[g.index],
                )
            )
        self.utilization = [Attribution() for _ in gpus]
        self.totals = [Totals() for _ in gpus]  # by workload, sessions gone included
        self.pods: PodCache | None = None  # pod names from the Kubernetes API
        self.started = self.clock.wall()
        # The sockets served, from the config at start (a reload that changes them
        # waits for the next start).
        self.socket, self.admin_socket = config.socket, config.admin_socket
        self.metrics_port = 0

        self.signaller: Signaller = signaller or self._send_signal
        # Gangs with ranks on several GPUs are granted on all of them at once.
        self.coordinator = Coordinator(self.arbiters) if len(self.arbiters) > 1 else None
        self.guard = Guard(lambda: self.live.config, self.clock, self.events, self.conns)
        self.dispatch = Dispatch(
            self.clock,
            self.events,
            self.conns,
            self.signaller,
            self._proc_root,
            refuse=self.guard.refuse,
        )
        self.dispatch.recovery = self.recovery
        self.decisions = Decisions(
            self.dispatch,
            self.clock,
            linked=self.coordinator.linked if self.coordinator else None,
        )
        self.live = LiveConfig(
            config, self.arbiters, self.decisions, config_path, state_path, flags
        )
        self.claims = PreparedClaims()  # the DRA plugin's, told again at its resync
        self.workloads = WorkloadServer(
            config=lambda: self.live.config,
            gpus=gpus,
            arbiters=self.arbiters,
            conns=self.conns,
            guard=self.guard,
            decisions=self.decisions,
            utilization=self.utilization,
            sim_link=self._sim_link,
            recovery=self.recovery,
            returned=lambda: self._end_recovery("every session on record is back"),
            pods=lambda: self.pods,
            claims=self.claims,
            retire=self._retire,
            nvml_used=lambda gpu, pids: self.sampler.used_by(gpu, pids),
        )
        self.admin = AdminServer(
            live=self.live,
            arbiters=self.arbiters,
            conns=self.conns,
            guard=self.guard,
            dispatch=self.dispatch,
            decisions=self.decisions,
            events=self.events,
            status=self.status,
            clock=self.clock,
            claims=self.claims,
        )
        self.sampler = Sampler(
            gpus,
            self.arbiters,
            self.utilization,
            {
                g.index: NvmlUtilization(nvml, max(g.nvml_index, 0), g.mig_index)
                for g in gpus
                if nvml and not g.simulated
            },
            self.conns,
            self.clock,
            self.decisions,
            lambda: parse_size(self.live.config.nvml_allowance),
            publish=self.events.publish,
            proc_root=lambda: self.live.config.proc_root,
        )
        self._servers: list[asyncio.Server] = []
        self._made: list[str] = []  # socket and link files this node created
        self._handlers = Handlers()
        self._tasks: set[asyncio.Task[None]] = set()
        self.exporter: Exporter | None = None
        self._pod_watcher: PodWatcher | None = None
        self.k8s_object: NodeObject | None = None  # its GPUShareNode, with --kubernetes
        self._recovery_timer: asyncio.TimerHandle | None = None
        self._loop_errors: dict[str, tuple[float, int]] = {}

    @property
    def config(self) -> NodeConfig:
        """The configuration in force (the files and flags, reloaded live)."""
        return self.live.config

    def status(self) -> NodeStatus:
        info = NodeInfo(pid=os.getpid(), started=self.started, config=self.live.path)
        return snapshot.take(
            info, self.gpus, self.arbiters, self.utilization, self.conns, self.pods, self.totals
        )

    def _retire(self, gpu: int, sid: int) -> None:
        """A session leaves: its final figures go to its workload's totals."""
        a = self.arbiters[gpu]
        s = a.sessions.get(sid)
        if s is not None:
            st = snapshot.session(a, s, self.utilization[gpu], self.conns.get(sid), self.pods)
            self.totals[gpu].retire(st)

    def reload(self) -> None:
        self.live.reload()

    # --- life -----------------------------------------------------------------------

    def _sim_link(self, gpu: int, uid: int) -> str:
        """The simulated link of ``gpu`` for the workloads of ``uid``: a file of that
        uid's alone (mode 0600), so no user can stall another's swaps through it. Made
        once, kept as long as it is sound (workloads map it: it is never truncated)."""
        owner = uid if os.geteuid() == 0 else os.geteuid()
        name = f"{os.path.basename(self.socket)}.u{owner}.link{gpu}"
        self.rundir.keep_or_write(name, bytes(SimLink.SIZE), mode=0o600, uid=owner)
        return self.rundir.join(name)

    def _proc_root(self) -> str:
        live = vars(self).get("live")  # the config in force, once there is one
        return live.config.proc_root if live is not None else self._initial.proc_root

    def _send_signal(self, ref: ProcRef, sig: int) -> None:
        pidfd_signal(ref, sig, self._proc_root())

    def _records(self) -> list[SessionRecord]:
        """What the node would need to recover its sessions now (each connection's
        record is made once, at its attach)."""
        out = []
        for c in self.conns.values():
            r = c.record
            if r is None:
                continue
            s = self.arbiters[c.gpu].sessions.get(c.session)
            if s is not None:
                lease = s.lease.number if s.holding else 0  # the only lease whose token is good
                m = s.memory
                if (r.resident, r.swapped, r.lease) != (m.resident, m.swapped, lease):
                    r = c.record = msgspec.structs.replace(
                        r, resident=m.resident, swapped=m.swapped, lease=lease
                    )
            out.append(r)
        return out

    def _begin_recovery(self) -> None:
        """The sessions on record whose processes run are expected back: what a freeze
        stopped is continued (it could not come back stopped), and nothing is granted
        until they are back or the window ends."""
        for r in self.recovery.expected.values():
            for pid, start in r.stopped:
                self.signaller(ProcRef(pid, start, r.uid), signal.SIGCONT)
        n = len(self.recovery.expected)
        if not n:
            return
        window = self.config.recovery_window
        self.recovery.figures.expected = n
        self.recovery.figures.started = self.clock.monotonic()
        self.recovery.open = True
        for a in self.arbiters:
            a.begin_recovery()
        self.events.publish(
            typed.record(
                typed.Recovery(phase="begin", expected=n, window_s=window),
                ts=self.clock.wall(),
                gpu=None,
            )
        )
        log.info("recovery: waiting up to %g s for %d sessions on record", window, n)
        self._recovery_timer = asyncio.get_running_loop().call_later(
            window, self._end_recovery, "the window ended"
        )
        self._spawn(self._watch_expected())

    async def _watch_expected(self, period: float = 0.5) -> None:
        """During the window: a session on record whose process has ended since will not
        come back; once every one left is back, the window ends early."""
        while self._recovery_timer is not None:
            await asyncio.sleep(period)
            self.recovery.forget_dead()
            if self._recovery_timer is not None and not self.recovery.expected:
                self._end_recovery("every session on record that still runs is back")

    def _end_recovery(self, reason: str) -> None:
        if self._recovery_timer is None:
            return
        self._recovery_timer.cancel()
        self._recovery_timer = None
        f = self.recovery.figures
        seconds = self.clock.monotonic() - f.started
        self.events.publish(
            typed.record(
                typed.Recovery(
                    phase="end",
                    expected=f.expected,
                    returned=f.returned,
                    missing=f.missing,
                    seconds=seconds,
                    reason=reason,
                ),
                ts=self.clock.wall(),
                gpu=None,
            )
        )
        log.info(
            "recovery: %d of %d sessions back in %.2f s (%s)",
            f.returned,
            f.expected,
            seconds,
            reason,
        )
        self.recovery.expected.clear()
        self.recovery.open = False
        for a in self.arbiters:
            self.decisions.act(a, a.end_recovery())

    def _on_loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """asyncio's errors (an accept failing for want of descriptors, say) logged at
        most once per 10 s each, with a count of those held back."""
        key = str(context.get("message", ""))
        now = self.clock.monotonic()
        last, held = self._loop_errors.get(key, (-1e9, 0))
        if now - last < 10.0 and len(self._loop_errors) < 1000:
            self._loop_errors[key] = (last, held + 1)
            return
        self._loop_errors[key] = (now, 0)
        exc = context.get("exception")
        more = f" ({held} more in the last 10 s)" if held else ""
        log.error("%s: %s%s", key, exc or "", more)

    async def start(self) -> None:
        cfg = self.config
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(self._on_loop_error)
        if cfg.metrics_port:  # first: a busy port stops the start before anything is up
            self._start_exporter(cfg)
        try:
            await self._serve(cfg)
        except BaseException:
            await self.stop()  # no socket left behind
            raise

    async def _serve(self, cfg: NodeConfig) -> None:
        self._begin_recovery()
        workloads = self._handlers.track(self.workloads.handle)
        self._servers.append(await serve_unix(workloads, self.socket, mode=0o666))
        self._made.append(self.socket)
        gid = admin_gid(cfg)
        self._servers.append(
            await serve_unix(
                self._handlers.track(self.admin.handle),
                self.admin_socket,
                mode=0o600 if gid is None else 0o660,
            )
        )
        self._made.append(self.admin_socket)
        if gid is not None:
            os.chown(self.admin_socket, -1, gid)
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
        log.info("workloads: %s  admin: %s", self.socket, self.admin_socket)
        self._spawn(self.sampler.run())
        if cfg.kubernetes and self.pods is None:
            node = cfg.node_name or os.environ.get("NODE_NAME") or socket.gethostname()
            self.pods = PodCache()
            self._pod_watcher = PodWatcher(self.pods, node).start()
            log.info("pod names from the Kubernetes API, pods of node %s", node)
            # Its GPUShareNode: status written, spec applied as the admin socket's SetConfig.
            self.k8s_object = NodeObject(
                node,
                arbiters=self.arbiters,
                status=self.status,
                set_config=self.admin.set_config,
                refused=self.live.refused,
                events=self.events,
                clock=self.clock,
            ).start()
        if self.live.path:
            self._spawn(self.live.watch())

    def _start_exporter(self, cfg: NodeConfig) -> None:
        try:
            from gpushare.node.observe.exporter import Exporter
        except ImportError:
            raise OSError(
                "the metrics exporter needs prometheus-client: pip install"
                " 'gpushare[node]', or pass --metrics-port 0"
            ) from None
        try:
            # Served by a process of its own; asks this loop for a snapshot per scrape,
            # so the figures of one scrape are one consistent state.
            self.exporter = Exporter(
                self.status, cfg.metrics_port, cfg.metrics_address, self.clock.monotonic
            )
        except OSError as e:
            raise OSError(
                f"metrics port {cfg.metrics_address}:{cfg.metrics_port}: {e.strerror or e}"
                " (another gpushare node, or another exporter?): choose another with"
                " --metrics-port PORT (or metrics_port in the config file), or 0 for none"
            ) from None
        self.exporter.start()
        self.metrics_port = self.exporter.port
        log.info("metrics: http://%s:%d/metrics", cfg.metrics_address, self.metrics_port)

    def _spawn(self, coro: Any) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def run(self) -> None:
        _raise_fd_limit()
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
        self.recovery.hold()  # the workloads outlive this node: the next one expects them
        self.events.end_followers()
        self.guard.end_lines()  # connections waiting for room to say hello: not now
        await self._handlers.close()  # every connection ends; its session detaches
        self.decisions.close()
        for task in list(self._tasks):
            task.cancel()
        if self.exporter is not None:
            await self.exporter.stop()
            self.exporter = None
        if self._pod_watcher:
            self._pod_watcher.stop()
        if self.k8s_object is not None:
            await self.k8s_object.stop()
            self.k8s_object = None
        if self._recovery_timer is not None:
            self._recovery_timer.cancel()
            self._recovery_timer = None
        # The link files stay: workloads map them, and the next node keeps them.
        for path in self._made:  # only what this node made: never another node's socket
            with contextlib.suppress(OSError):
                os.unlink(path)
        self._made.clear()
        self.events.close()
        for d in {id(d): d for d in (self.rundir, self.admindir, self.recovery.dir)}.values():
            d.close()


def _raise_fd_limit() -> None:
    """Descriptors up to the hard limit: every connection costs one, and a soft limit of
    1,024 is what a flood of connections exhausts first."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

"""The node daemon's composition root: it builds the parts, starts and stops them.

It decides nothing itself: one arbiter per GPU decides (gpushare.core), and the parts
here move messages and state in and out of them, one job each:

* ``workload_server``: the workload socket (hello, then a session's messages);
* ``admin_server``: the admin socket (status, settings, ending sessions, events);
* ``guard``: connection identity, rate and session limits, the one refusal path;
* ``dispatch``: the one place actions leave (messages, signals, the per-GPU timers);
* ``live_config``: the config file watched and applied, ``--persist`` written down;
* ``utilization``: sampling, credited through the lease; NVML's memory view checked;
* ``snapshot``: the typed status; ``metrics``: the exporter over it.

Time comes from one injected clock; on :mod:`gpushare.node.virtual_time`'s loop a test
drives the whole running node with fake time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from typing import Any

from gpushare.core.arbiter import Arbiter
from gpushare.core.attribution import Attribution
from gpushare.core.clock import Clock
from gpushare.core.coordinator import Coordinator
from gpushare.node import snapshot
from gpushare.node.admin_server import AdminServer
from gpushare.node.clock import SystemClock
from gpushare.node.config import NodeConfig, gpu_settings, scheduling
from gpushare.node.dispatch import Dispatch, Signaller, send_signal
from gpushare.node.events import EventBus
from gpushare.node.gpus import GpuInfo
from gpushare.node.guard import Conn, Guard, admin_gid
from gpushare.node.k8s import PodCache, PodWatcher
from gpushare.node.live_config import LiveConfig
from gpushare.node.sockets import Handlers, serve_unix
from gpushare.node.utilization import NvmlUtilization, Sampler
from gpushare.node.workload_server import WorkloadServer
from gpushare.settings import GpuSettings
from gpushare.simlink import SimLink
from gpushare.status import NodeInfo, NodeStatus
from gpushare.units import format_size, parse_size

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
        signaller: Signaller = send_signal,
    ) -> None:
        if not gpus:
            raise ValueError("a node needs at least one GPU")
        self.gpus = gpus
        self.clock = clock or SystemClock()
        self.events = EventBus(config.event_log)
        reserve = parse_size(config.reserve)
        self.arbiters: list[Arbiter] = []
        for g in gpus:
            settings = GpuSettings(
                grace_s=config.grace,
                overlap=config.overlap,
                **scheduling(config),
                **gpu_settings(config, g.index),
            )
            if g.memory_bytes - reserve <= 0:
                raise ValueError(f"reserve {config.reserve} leaves nothing of GPU {g.index}")
            self.arbiters.append(Arbiter(g.index, g.memory_bytes - reserve, self.clock, settings))
        self.conns: dict[int, Conn] = {}  # attached sessions' connections, by session id
        self.utilization = [Attribution() for _ in gpus]
        self.pods: PodCache | None = None  # pod names from the Kubernetes API
        self.started = self.clock.wall()
        # The sockets served, from the config at start (a reload that changes them
        # waits for the next start).
        self.socket, self.admin_socket = config.socket, config.admin_socket
        self.metrics_port = 0

        # Gangs with ranks on several GPUs are granted on all of them at once.
        self.coordinator = Coordinator(self.arbiters) if len(self.arbiters) > 1 else None
        linked = self.coordinator.linked if self.coordinator else None
        self.dispatch = Dispatch(self.clock, self.events, self.conns, signaller, linked)
        self.live = LiveConfig(config, self.arbiters, self.dispatch, config_path, state_path, flags)
        self.guard = Guard(lambda: self.live.config, self.clock, self.events, self.conns)
        self.workloads = WorkloadServer(
            config=lambda: self.live.config,
            gpus=gpus,
            arbiters=self.arbiters,
            conns=self.conns,
            guard=self.guard,
            dispatch=self.dispatch,
            utilization=self.utilization,
            sim_link=self._sim_link,
        )
        self.admin = AdminServer(
            live=self.live,
            arbiters=self.arbiters,
            conns=self.conns,
            guard=self.guard,
            dispatch=self.dispatch,
            events=self.events,
            status=self.status,
            clock=self.clock,
        )
        self.sampler = Sampler(
            gpus,
            self.arbiters,
            self.utilization,
            {g.index: NvmlUtilization(nvml, g.index) for g in gpus if nvml and not g.simulated},
            self.conns,
            self.clock,
            self.dispatch,
            lambda: parse_size(self.live.config.nvml_allowance),
        )
        self._servers: list[asyncio.Server] = []
        self._handlers = Handlers()
        self._tasks: set[asyncio.Task[None]] = set()
        self._stop_metrics: Any = None
        self._pod_watcher: PodWatcher | None = None

    @property
    def config(self) -> NodeConfig:
        """The configuration in force (the files and flags, reloaded live)."""
        return self.live.config

    def status(self) -> NodeStatus:
        info = NodeInfo(pid=os.getpid(), started=self.started, config=self.live.path)
        return snapshot.take(
            info, self.gpus, self.arbiters, self.utilization, self.conns, self.pods
        )

    def reload(self) -> None:
        self.live.reload()

    # --- life -----------------------------------------------------------------------

    def _sim_link(self, gpu: int) -> str:
        return f"{self.socket}.link{gpu}"

    async def start(self) -> None:
        cfg = self.config
        workloads = self._handlers.track(self.workloads.handle)
        self._servers.append(await serve_unix(workloads, self.socket, mode=0o666))
        for g in self.gpus:  # the simulated links' shared state, beside the socket
            if g.simulated:
                SimLink.create(self._sim_link(g.index))
        gid = admin_gid(cfg)
        self._servers.append(
            await serve_unix(
                self._handlers.track(self.admin.handle),
                self.admin_socket,
                mode=0o600 if gid is None else 0o660,
            )
        )
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
        if self.live.path:
            self._spawn(self.live.watch())
        if cfg.metrics_port:
            self._start_exporter(cfg)

    def _start_exporter(self, cfg: NodeConfig) -> None:
        try:
            from gpushare.node import metrics
        except ImportError:
            raise OSError(
                "the metrics exporter needs prometheus-client: pip install"
                " 'gpushare[node]', or pass --metrics-port 0"
            ) from None

        loop = asyncio.get_running_loop()

        def take() -> NodeStatus:
            # Made in the event loop, so one scrape sees one consistent state.
            async def status() -> NodeStatus:
                return self.status()

            return asyncio.run_coroutine_threadsafe(status(), loop).result(timeout=5)

        self._stop_metrics = metrics.serve(
            metrics.registry_for(take), cfg.metrics_port, cfg.metrics_address
        )
        self.metrics_port = cfg.metrics_port
        log.info("metrics: http://%s:%d/metrics", cfg.metrics_address, self.metrics_port)

    def _spawn(self, coro: Any) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

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
        self.events.end_followers()
        await self._handlers.close()  # every connection ends; its session detaches
        self.dispatch.close()
        for task in list(self._tasks):
            task.cancel()
        if self._stop_metrics:
            self._stop_metrics()
        if self._pod_watcher:
            self._pod_watcher.stop()
        links = [self._sim_link(g.index) for g in self.gpus if g.simulated]
        for path in (self.socket, self.admin_socket, *links):
            with contextlib.suppress(OSError):
                os.unlink(path)
        self.events.close()

"""The node as a Kubernetes object: its ``GPUShareNode`` (cluster-scoped, named after the
node; deploy/kubernetes/base/crd.yaml), whose status this node writes and whose spec it
applies.

* Status: the node's GPUs, settings, holders, queue and sessions by pod, written at a
  bounded rate: at once on a change of holder, queue, sessions or settings, but never
  more often than once per ``min_interval``; the figures alone (lease seconds, resident
  bytes) every ``refresh``; at least every ``heartbeat`` (``status.updated`` says how
  fresh it is).
* Spec: TQ, mode, policy and escalation, node-wide and per GPU (``spec.gpu.N``), watched
  and applied from the next quantum through the node's one validating path (the admin
  socket's ``SetConfig``). A bad value is refused whole: its reason goes to the status'
  ``SettingsApplied`` condition and a Kubernetes Event, and the settings in force stay.
  A key the spec sets wins over every other source: a change made otherwise (``ctl``,
  the ConfigMap) to that key is set back at the next look.
* Events: a session attached to, or detached from, a pod, and an escalation, as
  Kubernetes Events on that pod (``kubectl describe pod``, ``kubectl gpushare events``).

Where the CRD is not installed, or the node's role lacks a right, the node says so once
and goes on without its object, looking again every ``absent_retry`` seconds.

The pure parts (the status' body, the spec's reading) are functions in
:mod:`~gpushare.node.kube.node_status`, the API is :mod:`~gpushare.node.kube.node_api`
(through the one client, :mod:`~gpushare.node.kube.api`);
:class:`NodeObject` runs them on the node's loop, its API calls on threads (the official
client blocks).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpushare import protocol as p
from gpushare.core.arbiter import Arbiter
from gpushare.core.clock import Clock
from gpushare.node.host.clock import SystemClock, now_rfc3339
from gpushare.node.keep.events import EventBus
from gpushare.node.kube.node_api import Absent, KubernetesObjects, ObjectApi
from gpushare.node.kube.node_status import (
    API_VERSION,
    EVENTS_NAMESPACE,
    KIND,
    condition,
    desired,
    shape,
    status_body,
)
from gpushare.settings import Change, SettingsError
from gpushare.status import NodeStatus

log = logging.getLogger("gpushare.node.gpusharenode")

# What changes the status' shape (written at once, rate-bounded) rather than its figures.
SHAPE_EVENTS = {"attach", "detach", "grant", "revoke", "release", "config", "escalate"}


@dataclass(slots=True)
class _Written:
    """The status last written: its shape ("": none, or write it again at the next
    turn), its figures (JSON, all but ``updated``) and when (the clock's monotonic)."""

    shape: str = ""
    figures: str = ""
    at: float = -1e9


class NodeObject:
    """This node's GPUShareNode, kept: its status written, its spec applied (see the
    module's docstring). Runs on the node's loop; ``start()``, ``stop()``."""

    def __init__(
        self,
        name: str,
        *,
        arbiters: Sequence[Arbiter],
        status: Callable[[], NodeStatus],
        set_config: Callable[[p.SetConfig], p.Message],
        refused: Callable[[str, str], None],
        events: EventBus,
        clock: Clock | None = None,
        api: Callable[[], ObjectApi] | None = None,
        min_interval: float = 2.0,
        refresh: float = 10.0,
        heartbeat: float = 60.0,
        absent_retry: float = 60.0,
    ) -> None:
        self.name = name
        self.arbiters, self.status, self.set_config = arbiters, status, set_config
        self.refused, self.events = refused, events
        self.clock: Clock = clock or SystemClock()
        self.wall = self.clock.wall
        self._make_api = api or KubernetesObjects
        self.min_interval, self.refresh, self.heartbeat = min_interval, refresh, heartbeat
        self.absent_retry = absent_retry
        self.api: ObjectApi | None = None
        self.writes = 0  # status writes made (the bounded rate's count)
        self.uid = ""
        self.generation = 0  # the spec's generation last read
        self.desired: list[Change] = []  # what the spec sets per GPU (empty: nothing)
        self.conditions: list[dict[str, Any]] = []
        self._spec: Any = None
        self._dirty = asyncio.Event()
        self._stop = threading.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._said: set[str] = set()  # messages said once
        self._known: dict[int, dict[str, Any]] = {}  # sessions last written, by id
        self._loop: asyncio.AbstractEventLoop | None = None

    # --- life -----------------------------------------------------------------------

    def start(self) -> NodeObject:
        self._loop = asyncio.get_running_loop()
        self._tasks = [
            self._loop.create_task(self._publish()),
            self._loop.create_task(self._follow()),
        ]
        return self

    async def stop(self) -> None:
        self._stop.set()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    def _once(self, key: str, level: int, message: str) -> None:
        if key not in self._said:
            self._said.add(key)
            log.log(level, "%s", message)

    # --- the spec -------------------------------------------------------------------

    def on_object(self, obj: Mapping[str, Any]) -> None:
        """The object as the API has it (a list, a watch event): its spec applied if it
        changed; on the loop."""
        meta = obj.get("metadata") or {}
        uid = str(meta.get("uid") or "")
        if uid and uid != self.uid:  # another object (deleted, made again): from scratch
            self.uid, self.generation, self._spec = uid, 0, None
        generation = int(meta.get("generation") or 0)
        spec = obj.get("spec") or {}
        if generation < self.generation or (spec == self._spec and generation == self.generation):
            return  # an older view (a list that crossed a watch event), or no change
        self._spec, self.generation = spec, generation
        try:
            self.desired = desired(spec, len(self.arbiters))
        except SettingsError as e:  # the last spec that held is what stays in force
            self._refuse(str(e))
            return
        self.reconcile(changed=True)

    def _refuse(self, reason: str) -> None:
        self.refused(f"GPUShareNode {self.name}", reason)
        self._set_condition(False, "Refused", f"{reason}; the settings in force are kept")
        self._node_event("Warning", "SettingsRefused", reason)

    def reconcile(self, changed: bool = False) -> None:
        """Each GPU brought to what the spec sets, through the node's one validating path;
        a key set otherwise since (ctl, the ConfigMap) is set back."""
        applied = []
        for arb, want in zip(self.arbiters, self.desired, strict=False):
            diff = {k: v for k, v in want.items() if getattr(arb.settings, k) != v}
            if not diff:
                continue
            if not changed:
                log.info(
                    "GPU %d: GPUShareNode %s sets %s: set back (the spec wins; edit it there)",
                    arb.gpu,
                    self.name,
                    diff,
                )
            reply = self.set_config(p.SetConfig(gpu=arb.gpu, **diff))  # type: ignore[arg-type]
            if isinstance(reply, p.Error):  # refused by the node's path: not tried again
                self.desired = []
                self._refuse(reply.message)
                return
            applied.append(f"GPU {arb.gpu} {', '.join(f'{k}={v}' for k, v in diff.items())}")
        if changed or applied:
            what = "; ".join(applied) if applied else "nothing to change"
            self._set_condition(True, "Applied", f"generation {self.generation}: {what}")
            if applied:
                self._node_event("Normal", "SettingsApplied", "; ".join(applied))
        self._dirty.set()

    def _set_condition(self, ok: bool, reason: str, message: str) -> None:
        old = self.conditions[0] if self.conditions else None
        c = condition(ok, reason, message, self.generation, self.wall())
        if old is not None and old["status"] == c["status"]:
            c["lastTransitionTime"] = old["lastTransitionTime"]
        self.conditions = [c]
        self._dirty.set()

    # --- events ---------------------------------------------------------------------

    def _event(
        self, namespace: str, involved: dict[str, Any], kind: str, reason: str, message: str
    ) -> None:
        api = self.api
        if api is None or self._loop is None:
            return
        ts = now_rfc3339(self.wall())
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{involved['name']}.gpushare.", "namespace": namespace},
            "involvedObject": involved,
            "type": kind,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": "gpushare-node", "host": self.name},
            "reportingComponent": "gpushare-node",
            "reportingInstance": self.name,
            "firstTimestamp": ts,
            "lastTimestamp": ts,
            "count": 1,
        }
        self._spawn_call(api.event, namespace, body)

    def _node_event(self, kind: str, reason: str, message: str) -> None:
        involved = {"apiVersion": API_VERSION, "kind": KIND, "name": self.name}
        if self.uid:
            involved["uid"] = self.uid
        self._event(EVENTS_NAMESPACE, involved, kind, reason, message)

    def _pod_event(self, s: Mapping[str, Any], kind: str, reason: str, message: str) -> None:
        if not s.get("pod") or not s.get("namespace"):
            return  # not a pod's (or not named by the API yet)
        involved = {
            "apiVersion": "v1",
            "kind": "Pod",
            "namespace": s["namespace"],
            "name": s["pod"],
        }
        if s.get("podUID"):
            involved["uid"] = s["podUID"]
        if s.get("container"):
            involved["fieldPath"] = f"spec.containers{{{s['container']}}}"
        self._event(s["namespace"], involved, kind, reason, message)

    def _spawn_call(self, fn: Callable[..., Any], *args: Any) -> None:
        async def call() -> None:
            try:
                await asyncio.to_thread(fn, *args)
            except Exception as e:  # an Event is best effort: said once per kind of failure
                self._once(
                    f"event:{type(e).__name__}",
                    logging.WARNING,
                    f"Kubernetes Event not written: {e}",
                )

        assert self._loop is not None
        t = self._loop.create_task(call())
        self._tasks.append(t)
        t.add_done_callback(lambda t: self._tasks.remove(t) if t in self._tasks else None)

    async def _follow(self) -> None:
        """The node's events: a change of holder, sessions or settings wakes the writer;
        an escalation becomes an Event on its pod."""
        while True:
            f = self.events.follow()
            try:
                while (rec := await f.queue.get()) is not None:
                    if rec.get("event") in SHAPE_EVENTS:
                        self._dirty.set()
                    if rec.get("event") == "escalate":
                        s = self._known.get(int(rec.get("session") or -1))
                        if s is not None:
                            self._pod_event(
                                s,
                                "Warning",
                                "GPUShareEscalated",
                                f"session {s['id']} ({s['name']}) on GPU {s['gpu']}:"
                                f" {rec.get('action', '')} ({rec.get('reason', '')})",
                            )
            finally:
                self.events.unfollow(f)

    def _sessions_changed(self, sessions: Sequence[Mapping[str, Any]]) -> None:
        now = {int(s["id"]): dict(s) for s in sessions}
        for sid, s in now.items():
            old = self._known.get(sid)
            if s.get("pod") and (old is None or not old.get("pod")):
                self._pod_event(
                    s,
                    "Normal",
                    "GPUShareAttached",
                    f"session {sid} ({s['name']}) attached on GPU {s['gpu']} of"
                    f" {self.name}, memory limit {s['memoryLimit']}",
                )
        for sid, s in self._known.items():
            if sid not in now:
                self._pod_event(
                    s,
                    "Normal",
                    "GPUShareDetached",
                    f"session {sid} ({s['name']}) detached from GPU {s['gpu']} of"
                    f" {self.name} after {s['leaseSeconds']:g} s holding it",
                )
        self._known = now

    # --- the object -----------------------------------------------------------------

    async def _connect(self) -> ObjectApi:
        while True:
            try:
                api = await asyncio.to_thread(self._make_api)
                return api
            except Exception as e:
                self._once(
                    "config",
                    logging.WARNING,
                    f"GPUShareNode {self.name}: no Kubernetes API ({e}); the node runs"
                    f" on without its object, trying again every {self.absent_retry:g} s",
                )
                await asyncio.sleep(self.absent_retry)

    async def _ensure(self, api: ObjectApi) -> None:
        """The object found or made; its spec applied."""
        obj = await asyncio.to_thread(api.get, self.name)
        if obj is None:
            obj = await asyncio.to_thread(api.create, self.name)
            log.info("GPUShareNode %s: created", self.name)
        self.on_object(obj)

    async def _publish(self) -> None:
        api = self.api = await self._connect()
        watching = False
        last = _Written()
        while True:
            try:
                if not watching:
                    await self._start_watch(api)
                    watching = True
                await self._next_turn(last.at)
                await self._write_if_due(api, last)
            except Absent as e:
                self._once(
                    "absent",
                    logging.WARNING,
                    f"GPUShareNode {self.name}: {e}; the node runs on without it, looking"
                    f" again every {self.absent_retry:g} s",
                )
                self._stop_watch()
                watching = False
                last.shape = ""
                await asyncio.sleep(self.absent_retry)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # API away: the node goes on; the next write catches up
                self._once(
                    f"write:{type(e).__name__}",
                    logging.WARNING,
                    f"GPUShareNode {self.name}: {e}; retrying",
                )
                last.shape = ""
                await asyncio.sleep(self.min_interval)

    async def _start_watch(self, api: ObjectApi) -> None:
        """The object found or made, its spec applied, and its watch started on a thread."""
        await self._ensure(api)
        assert self._loop is not None
        threading.Thread(
            target=self._watch,
            args=(api, self._loop),
            daemon=True,
            name="gpushare-gsn",
        ).start()
        if "absent" in self._said:
            self._said.discard("absent")
            log.info("GPUShareNode %s: the API has it now: publishing", self.name)
        log.info(
            "GPUShareNode %s: status every %g-%g s, spec applied live",
            self.name,
            self.min_interval,
            self.refresh,
        )

    async def _next_turn(self, last_write: float) -> None:
        """Until a change (or ``min_interval``), and no sooner than ``min_interval``
        after the last write; then the spec applied anew (a key set otherwise since is
        set back)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._dirty.wait(), timeout=self.min_interval)
        wait = last_write + self.min_interval - self.clock.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)  # coalesced: what changes meanwhile rides along
        self._dirty.clear()
        if self.desired:
            self.reconcile()
            self._dirty.clear()

    async def _write_if_due(self, api: ObjectApi, last: _Written) -> None:
        """The status written where its shape changed, its figures changed and
        ``refresh`` passed, or ``heartbeat`` passed; ``last`` brought up to it. An
        object deleted meanwhile is made again (its spec gone with it)."""
        body = status_body(self.name, self.status(), self.conditions, self.generation, self.wall())
        figures = json.dumps({k: v for k, v in body.items() if k != "updated"})
        new_shape = shape(body)
        age = self.clock.monotonic() - last.at
        if not (
            new_shape != last.shape
            or (age >= self.refresh and figures != last.figures)
            or age >= self.heartbeat
        ):
            return
        try:
            await asyncio.to_thread(api.patch_status, self.name, body)
        except LookupError:  # deleted: made again (its spec gone with it)
            log.warning("GPUShareNode %s: deleted; making it again", self.name)
            await self._ensure(api)
            await asyncio.to_thread(api.patch_status, self.name, body)
        self.writes += 1
        last.shape, last.figures, last.at = new_shape, figures, self.clock.monotonic()
        self._sessions_changed(body["sessions"])

    def _stop_watch(self) -> None:
        self._watch_gen = getattr(self, "_watch_gen", 0) + 1

    def _watch(self, api: ObjectApi, loop: asyncio.AbstractEventLoop) -> None:
        """On its own thread: the object's changes handed to the loop; after an error, a
        list again (with backoff)."""
        gen = getattr(self, "_watch_gen", 0)
        delay = 0.5
        while not self._stop.is_set() and gen == getattr(self, "_watch_gen", 0):
            try:
                obj = api.get(self.name)
                if obj is not None:
                    loop.call_soon_threadsafe(self.on_object, obj)
                for kind, o in api.watch(self.name):
                    if self._stop.is_set():
                        return
                    if kind in ("ADDED", "MODIFIED"):
                        loop.call_soon_threadsafe(self.on_object, o)
                    elif kind == "DELETED":
                        loop.call_soon_threadsafe(self._dirty.set)
                delay = 0.5
                self._stop.wait(0.5)  # a watch the server ends at once does not spin
            except Absent:
                return  # the writer says so and starts a watch again when it is back
            except Exception as e:
                log.info("GPUShareNode %s: watch: %s; again in %.1f s", self.name, e, delay)
                self._stop.wait(delay)
                delay = min(delay * 2, 30.0)

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

The pure parts (the status' body, the spec's reading) are functions; :class:`NodeObject`
runs them on the node's loop, its API calls on threads (the official client blocks).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

from gpushare import protocol as p
from gpushare._version import __version__
from gpushare.core.arbiter import Arbiter
from gpushare.core.clock import Clock
from gpushare.node.host.clock import SystemClock, now_rfc3339
from gpushare.node.keep.events import EventBus
from gpushare.settings import Change, SettingsError, validate
from gpushare.status import NodeStatus, SessionStatus
from gpushare.units import format_size

log = logging.getLogger("gpushare.node.gpusharenode")

GROUP, VERSION, PLURAL, KIND = "gpushare.io", "v1alpha1", "gpusharenodes", "GPUShareNode"
CRD = f"{PLURAL}.{GROUP}"
API_VERSION = f"{GROUP}/{VERSION}"
CONDITION = "SettingsApplied"
SPEC_KEYS = {"tq": "tq_s", "mode": "mode", "policy": "policy", "escalation": "escalation"}
MAX_SESSIONS = 256  # per object: a status stays well under etcd's object size
EVENTS_NAMESPACE = "default"  # where Events about a cluster-scoped object go (as a Node's)
# What changes the status' shape (written at once, rate-bounded) rather than its figures.
SHAPE_EVENTS = {"attach", "detach", "grant", "revoke", "release", "config", "escalate"}


def _joined(values: Sequence[object]) -> str:
    """One value where all GPUs agree, else each GPU's, comma-separated."""
    texts = [str(v) for v in values]
    return texts[0] if len(set(texts)) == 1 else ",".join(texts)


def _tq(v: float) -> str:
    return f"{v:g}s"


def session_entry(gpu: int, s: SessionStatus) -> dict[str, Any]:
    out: dict[str, Any] = {
        "gpu": gpu,
        "id": s.id,
        "name": s.name,
        "namespace": s.namespace,
        "pod": s.pod,
        "container": s.container,
        "state": s.state,
        "frozen": s.frozen,
        "memoryLimitBytes": s.memory_limit_bytes,
        "memoryLimit": format_size(s.memory_limit_bytes),
        "residentBytes": s.resident_bytes,
        "swappedBytes": s.swapped_bytes,
        "leaseSeconds": round(s.lease_seconds_total, 3),
        "waitSeconds": round(s.wait_seconds_total, 3),
    }
    if s.weight_source not in ("", "default"):  # the pod's GPU request: its fraction
        out["fraction"] = s.weight
        out["fractionSource"] = s.weight_source
    if s.pod_uid:
        out["podUID"] = s.pod_uid
    return out


def status_body(
    node: str,
    st: NodeStatus,
    conditions: Sequence[Mapping[str, Any]],
    observed_generation: int,
    wall: float,
) -> dict[str, Any]:
    """The object's ``status``, from the node's snapshot (plain JSON types)."""
    gpus = [
        {
            "index": g.index,
            "model": g.name,
            "uuid": g.uuid,
            "simulated": g.simulated,
            "memoryBytes": g.memory_bytes,
            "memory": format_size(g.memory_bytes),
            "usableBytes": g.usable_bytes,
            "usedBytes": g.used_bytes,
            "tq": g.tq_s,
            "mode": g.mode,
            "policy": g.policy,
            "escalation": g.escalation,
            "holders": list(g.holders),
            "queue": list(g.queue),
            "recovering": g.recovering,
        }
        for g in st.gpus
    ]
    sessions = [session_entry(g.index, s) for g in st.gpus for s in g.sessions]
    sessions.sort(key=lambda s: (s["namespace"], s["pod"], s["container"], s["gpu"], s["id"]))
    omitted = max(0, len(sessions) - MAX_SESSIONS) + sum(g.sessions_omitted for g in st.gpus)
    sessions = sessions[:MAX_SESSIONS]
    swapped = sum(s.swapped_bytes for g in st.gpus for s in g.sessions)
    models = [("[simulated] " if g.simulated else "") + g.name for g in st.gpus]
    summary = {
        "gpus": len(st.gpus),
        "tq": _joined([_tq(g.tq_s) for g in st.gpus]),
        "mode": _joined([g.mode for g in st.gpus]),
        "policy": _joined([g.policy for g in st.gpus]),
        "escalation": _joined([g.escalation for g in st.gpus]),
        "holders": sum(len(g.holders) for g in st.gpus),
        "waiting": sum(len(g.queue) for g in st.gpus),
        "sessions": sum(len(g.sessions) + g.sessions_omitted for g in st.gpus),
        "swappedBytes": swapped,
        "model": _joined(models),
        "memory": _joined([format_size(g.memory_bytes) for g in st.gpus]),
        "simulated": any(g.simulated for g in st.gpus),
    }
    summary["swapped"] = format_size(swapped)
    return {
        "node": node,
        "version": __version__,
        "pid": st.node.pid,
        "updated": now_rfc3339(wall),
        "observedGeneration": observed_generation,
        "summary": summary,
        "gpus": gpus,
        "sessions": sessions,
        "sessionsOmitted": omitted,
        "conditions": [dict(c) for c in conditions],
    }


_FIGURES = {
    "updated",
    "leaseSeconds",
    "waitSeconds",
    "residentBytes",
    "swappedBytes",
    "swapped",
    "usedBytes",
    "pid",
}


def shape(body: Mapping[str, Any]) -> str:
    """The body without its running figures: what, changed, is written at once."""

    def strip(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in _FIGURES}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x

    return json.dumps(strip(body), sort_keys=True)


def desired(spec: Mapping[str, Any] | None, ngpus: int) -> list[Change]:
    """Each GPU's settings as the spec sets them (only the keys it sets), every value
    checked by the one validation (:func:`gpushare.settings.validate`); the first bad
    one raises :class:`SettingsError` naming the field and why, and nothing is to apply."""
    spec = dict(spec or {})
    unknown = sorted(set(spec) - {*SPEC_KEYS, "gpu"})
    if unknown:
        raise SettingsError(f"spec.{unknown[0]}: not a setting (tq, mode, policy, escalation, gpu)")
    top = {SPEC_KEYS[k]: v for k, v in spec.items() if k in SPEC_KEYS}
    per_gpu = spec.get("gpu") or {}
    if not isinstance(per_gpu, Mapping):
        raise SettingsError("spec.gpu must map GPU indexes to settings (gpu: {'0': {tq: 20}})")
    over: dict[int, dict[str, Any]] = {}
    for key, values in per_gpu.items():
        try:
            index = int(key)
        except ValueError:
            raise SettingsError(f"spec.gpu.{key}: not a GPU index (0..{ngpus - 1})") from None
        if not 0 <= index < ngpus:
            raise SettingsError(
                f"spec.gpu.{key}: no GPU {index} on this node (it has {ngpus}: 0..{ngpus - 1})"
            )
        values = dict(values or {})
        bad = sorted(set(values) - set(SPEC_KEYS))
        if bad:
            raise SettingsError(
                f"spec.gpu.{key}.{bad[0]}: not a setting (tq, mode, policy, escalation)"
            )
        over[index] = {SPEC_KEYS[k]: v for k, v in values.items()}
    out: list[Change] = []
    for i in range(ngpus):
        merged = {**top, **over.get(i, {})}
        where = f"spec.gpu.{i}" if i in over else "spec"
        try:
            out.append(validate(**merged))
        except SettingsError as e:
            raise SettingsError(f"{where}: {e}") from None
    return out


def condition(ok: bool, reason: str, message: str, generation: int, wall: float) -> dict[str, Any]:
    return {
        "type": CONDITION,
        "status": "True" if ok else "False",
        "reason": reason,
        "message": message,
        "observedGeneration": generation,
        "lastTransitionTime": now_rfc3339(wall),
    }


class Absent(Exception):
    """The API has no such kind (the CRD is not installed) or refuses this node's role."""


class ObjectApi(Protocol):
    def get(self, name: str) -> dict[str, Any] | None: ...
    def create(self, name: str) -> dict[str, Any]: ...
    def patch_status(self, name: str, status: Mapping[str, Any]) -> dict[str, Any]: ...
    def event(self, namespace: str, body: Mapping[str, Any]) -> None: ...
    def watch(self, name: str) -> Iterator[tuple[str, dict[str, Any]]]: ...


class KubernetesObjects:
    """:class:`ObjectApi` through the official client (in-cluster, else KUBECONFIG), each
    call with a client-side deadline. 404 on the kind and 403 raise :class:`Absent`."""

    def __init__(self, kubeconfig: str | None = None, watch_timeout: int = 300) -> None:
        from kubernetes import client, config

        cfg = client.Configuration()
        if kubeconfig:
            config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
        else:
            try:
                config.load_incluster_config(client_configuration=cfg)
            except config.ConfigException:
                config.load_kube_config(client_configuration=cfg)
        # One client per thread that calls (the watch's own, the writer's).
        self._writer = client.CustomObjectsApi(client.ApiClient(cfg))
        self._core = client.CoreV1Api(client.ApiClient(cfg))
        self._watcher = client.CustomObjectsApi(client.ApiClient(cfg))
        self.watch_timeout = watch_timeout
        self._timeout = (10.0, 30.0)

    @staticmethod
    def _absent(e: Any, what: str) -> Exception:
        from kubernetes.client.rest import ApiException

        if isinstance(e, ApiException) and e.status == 404:
            return Absent(
                f"{what}: the API server has no {KIND} kind (the CRD {CRD} is not installed:"
                " kubectl apply -k deploy/kubernetes/overlays/plain, or -f"
                " deploy/kubernetes/base/crd.yaml)"
            )
        if isinstance(e, ApiException) and e.status == 403:
            return Absent(
                f"{what}: forbidden ({e.reason}): the node's service account lacks the"
                " rights of deploy/kubernetes/base/rbac.yaml (kubectl apply -k"
                " deploy/kubernetes/overlays/plain)"
            )
        return e  # type: ignore[no-any-return]

    def get(self, name: str) -> dict[str, Any] | None:
        try:  # a list by name: the role needs list and watch, not get as well
            r = self._writer.list_cluster_custom_object(
                GROUP,
                VERSION,
                PLURAL,
                field_selector=f"metadata.name={name}",
                _request_timeout=self._timeout,
            )
        except Exception as e:
            raise self._absent(e, f"list {PLURAL}") from None
        items: list[dict[str, Any]] = r.get("items") or []
        return items[0] if items else None

    def create(self, name: str) -> dict[str, Any]:
        from kubernetes.client.rest import ApiException

        body = {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name}, "spec": {}}
        try:
            out: dict[str, Any] = self._writer.create_cluster_custom_object(
                GROUP, VERSION, PLURAL, body, _request_timeout=self._timeout
            )
            return out
        except ApiException as e:
            if e.status == 409:  # made meanwhile (another start of this node)
                got = self.get(name)
                if got is not None:
                    return got
            raise self._absent(e, f"create {KIND} {name}") from None

    def patch_status(self, name: str, status: Mapping[str, Any]) -> dict[str, Any]:
        from kubernetes.client.rest import ApiException

        try:
            out: dict[str, Any] = self._writer.patch_cluster_custom_object_status(
                GROUP,
                VERSION,
                PLURAL,
                name,
                {"status": status},
                _content_type="application/merge-patch+json",
                _request_timeout=self._timeout,
            )
            return out
        except ApiException as e:
            if e.status == 404 and "not found" in str(e.body).lower() and PLURAL in str(e.body):
                raise LookupError(name) from None  # the object is gone: made again
            raise self._absent(e, f"patch {KIND} {name}/status") from None

    def event(self, namespace: str, body: Mapping[str, Any]) -> None:
        self._core.create_namespaced_event(namespace, body, _request_timeout=self._timeout)

    def watch(self, name: str) -> Iterator[tuple[str, dict[str, Any]]]:
        from kubernetes import watch

        w = watch.Watch()
        try:
            for ev in w.stream(
                self._watcher.list_cluster_custom_object,
                GROUP,
                VERSION,
                PLURAL,
                field_selector=f"metadata.name={name}",
                timeout_seconds=self.watch_timeout,
                _request_timeout=(10.0, self.watch_timeout + 30.0),
            ):
                yield ev["type"], ev["raw_object"]
        except Exception as e:
            raise self._absent(e, f"watch {PLURAL}") from None


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

    async def _publish(self) -> None:  # noqa: C901
        api = self.api = await self._connect()
        watching = False
        last_shape, last_body, last_write = "", "", -1e9
        while True:
            try:
                if not watching:
                    await self._ensure(api)
                    assert self._loop is not None
                    threading.Thread(
                        target=self._watch,
                        args=(api, self._loop),
                        daemon=True,
                        name="gpushare-gsn",
                    ).start()
                    watching = True
                    if "absent" in self._said:
                        self._said.discard("absent")
                        log.info("GPUShareNode %s: the API has it now: publishing", self.name)
                    log.info(
                        "GPUShareNode %s: status every %g-%g s, spec applied live",
                        self.name,
                        self.min_interval,
                        self.refresh,
                    )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._dirty.wait(), timeout=self.min_interval)
                wait = last_write + self.min_interval - self.clock.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)  # coalesced: what changes meanwhile rides along
                self._dirty.clear()
                if self.desired:
                    self.reconcile()
                    self._dirty.clear()
                body = status_body(
                    self.name, self.status(), self.conditions, self.generation, self.wall()
                )
                figures = json.dumps({k: v for k, v in body.items() if k != "updated"})
                new_shape = shape(body)
                age = self.clock.monotonic() - last_write
                if not (
                    new_shape != last_shape
                    or (age >= self.refresh and figures != last_body)
                    or age >= self.heartbeat
                ):
                    continue
                try:
                    await asyncio.to_thread(api.patch_status, self.name, body)
                except LookupError:  # deleted: made again (its spec gone with it)
                    log.warning("GPUShareNode %s: deleted; making it again", self.name)
                    await self._ensure(api)
                    await asyncio.to_thread(api.patch_status, self.name, body)
                self.writes += 1
                last_shape, last_body, last_write = new_shape, figures, self.clock.monotonic()
                self._sessions_changed(body["sessions"])
            except Absent as e:
                self._once(
                    "absent",
                    logging.WARNING,
                    f"GPUShareNode {self.name}: {e}; the node runs on without it, looking"
                    f" again every {self.absent_retry:g} s",
                )
                self._stop_watch()
                watching = False
                last_shape = ""
                await asyncio.sleep(self.absent_retry)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # API away: the node goes on; the next write catches up
                self._once(
                    f"write:{type(e).__name__}",
                    logging.WARNING,
                    f"GPUShareNode {self.name}: {e}; retrying",
                )
                last_shape = ""
                await asyncio.sleep(self.min_interval)

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

"""The node's ``GPUShareNode`` as data, pure (no API, no thread, no clock of its own):
the kind's names, the status' body from the node's snapshot (:func:`status_body`), its
shape apart from its running figures (:func:`shape`), each GPU's settings as the spec
sets them, checked by the one validation (:func:`desired`), and the ``SettingsApplied``
condition. :mod:`gpushare.node.kube.gpusharenode` writes and applies them; the kubectl
plugin reads the same names.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from gpushare._version import __version__
from gpushare.node.host.clock import now_rfc3339
from gpushare.settings import Change, SettingsError, validate
from gpushare.status import NodeStatus, SessionStatus
from gpushare.units import format_size

GROUP, VERSION, PLURAL, KIND = "gpushare.io", "v1alpha1", "gpusharenodes", "GPUShareNode"
CRD = f"{PLURAL}.{GROUP}"
API_VERSION = f"{GROUP}/{VERSION}"
CONDITION = "SettingsApplied"
SPEC_KEYS = {"tq": "tq_s", "mode": "mode", "policy": "policy", "escalation": "escalation"}
MAX_SESSIONS = 256  # per object: a status stays well under etcd's object size
EVENTS_NAMESPACE = "default"  # where Events about a cluster-scoped object go (as a Node's)


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
        # its request: what the node guarantees it and packs by (its limit unless it
        # asked for less); between the two, memory is lent while free
        "memoryRequestBytes": s.memory_request_bytes or s.memory_limit_bytes,
        "memoryRequest": format_size(s.memory_request_bytes or s.memory_limit_bytes),
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

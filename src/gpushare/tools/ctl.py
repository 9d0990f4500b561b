"""``gpushare ctl``: status, TQ and events, over the admin socket."""

from __future__ import annotations

import json
import sys
from typing import Any, TextIO

import msgspec

from gpushare import protocol as p
from gpushare.errors import GpushareError
from gpushare.settings import Change
from gpushare.status import GangStatus, NodeStatus, SessionStatus, to_json_object
from gpushare.tools.admin import AdminClient
from gpushare.units import format_size


def show_status(status: NodeStatus, out: TextIO = sys.stdout) -> None:
    for g in status.gpus:
        sim = "  [SIMULATED]" if g.simulated else ""
        out.write(
            f"GPU {g.index}  {g.name}{sim}  mode {g.mode}  policy {g.policy}"
            f"  TQ {g.tq_s:g} s  in use {format_size(g.used_bytes)}"
            f" of {format_size(g.usable_bytes)} (holders counted at their bounds;"
            f" resident {format_size(sum(s.resident_bytes for s in g.sessions))})\n"
        )
        names = {s.id: s.name for s in g.sessions}
        holders = ", ".join(names.get(i, str(i)) for i in g.holders) or "-"
        queue = ", ".join(names.get(i, str(i)) for i in g.queue) or "-"
        out.write(f"  holder: {holders}   queue: {queue}\n")
        if g.recovering:
            out.write("  recovering: nothing granted until the sessions on record are back\n")
        if not g.sessions:
            out.write("  no sessions\n")
            continue
        # Names whole, the column as wide as the longest: never cut without a mark.
        w = max(16, *(len(s.name) for s in g.sessions))
        out.write(
            f"  {'ID':>4} {'NAME':<{w}} {'STATE':<15} {'RESIDENT':>10} {'SWAPPED':>10}"
            f" {'DISCARDED':>10} {'REQUEST':>10} {'LIMIT':>10} {'LEASE s':>8} {'WAIT s':>7}"
            f" {'GRANTS':>6} {'RECLAIMED':>10} {'CREDIT s':>8} {'BURST s':>7}\n"
        )
        for s in g.sessions:
            state = s.state
            if s.state == "waiting":  # the wait going on now (WAIT s: all its waits)
                state = f"waiting {s.wait_seconds_total - s.wait_seconds_completed_total:.1f} s"
            out.write(
                f"  {s.id:>4} {s.name:<{w}} {state:<15}"
                f" {format_size(s.resident_bytes):>10} {format_size(s.swapped_bytes):>10}"
                f" {format_size(s.discarded_bytes):>10}"
                f" {format_size(s.memory_request_bytes or s.memory_limit_bytes):>10}"
                f" {format_size(s.memory_limit_bytes):>10} {s.lease_seconds_total:>8.1f}"
                f" {s.wait_seconds_total:>7.1f} {s.grants_total:>6}"
                f" {format_size(s.reclaimed_bytes_total):>10}"
                # its interactive turns (docs/scheduling.md 3): why it takes them or not
                f" {s.turn_credit_seconds:>8.2f} {s.usual_burst_seconds:>7.2f}\n"
            )
        if g.sessions_omitted:
            out.write(
                f"  ... and {g.sessions_omitted} more sessions (the status is larger than one"
                " frame: holders and the queue are shown first)\n"
            )
        _show_modelled(g.sessions, out)
        _show_gangs(g.gangs, out)


def _show_modelled(sessions: list[SessionStatus], out: TextIO) -> None:
    """Sessions whose resident bytes are modelled (a CPU-run program on a simulated GPU)
    rather than allocated: said, as their figures are the model's."""
    modelled = [f"{s.id} ({s.resident_model})" for s in sessions if s.resident_model]
    if modelled:
        out.write(
            "  resident modelled, not allocated (gpushare run --sim-resident): sessions"
            f" {', '.join(modelled)}\n"
        )


def _show_gangs(gangs: list[GangStatus], out: TextIO) -> None:
    for gang in gangs:  # the ranks of one job, or a session's processes: one holder
        spans = "  spans nodes" if gang.spans_nodes else ""
        who = ", ".join(map(str, gang.sessions))
        if not gang.size and gang.gang.startswith("session:"):  # a family: no ranks
            head = gang.gang.removeprefix("session:").split("@")[0]
            out.write(f"  family of session {head}: sessions {who} {gang.state}\n")
            continue
        out.write(
            f"  gang {gang.gang}: sessions {who}"
            f" ({len(gang.sessions)} of {gang.size or '?'} ranks) {gang.state}{spans}\n"
        )


def status(path: str | None, as_json: bool) -> int:
    with AdminClient(path) as c:
        st = c.status()
    if as_json:
        print(json.dumps(to_json_object(st), indent=2))
    else:
        show_status(st)
    return 0


def _settings_json(gpus: list[p.GpuConfig], persisted_to: str = "") -> str:
    out: dict[str, Any] = {"gpus": msgspec.to_builtins(gpus)}
    if persisted_to:
        out["persisted_to"] = persisted_to
    return json.dumps(out, indent=2)


def set_config(
    path: str | None, gpu: int | None, persist: bool, change: Change, as_json: bool = False
) -> int:
    """Set TQ, mode, policy or escalation; prints the new values per GPU."""
    with AdminClient(path) as c:
        r = c.set_config(change, gpu=gpu, persist=persist)
    if as_json:
        print(_settings_json(r.gpus, r.persisted_to))
        return 0
    for g in r.gpus:
        print(
            f"GPU {g.index}: TQ {g.tq_s:g} s, mode {g.mode}, policy {g.policy},"
            f" escalation {g.escalation} (from the next quantum; a shorter TQ also ends"
            " the running one sooner)"
        )
    if r.persisted_to:
        print(f"persisted to {r.persisted_to}")
    return 0


def show_settings(path: str | None, gpu: int | None, as_json: bool) -> int:
    """The TQ (and mode, policy, escalation) in force on each GPU, or on ``gpu``."""
    with AdminClient(path) as c:
        st = c.status()
    gpus = [
        p.GpuConfig(
            index=g.index, tq_s=g.tq_s, mode=g.mode, policy=g.policy, escalation=g.escalation
        )
        for g in st.gpus
        if gpu is None or g.index == gpu
    ]
    if not gpus:
        n = len(st.gpus)
        raise GpushareError(f"no GPU {gpu} on this node (it has {n}: --gpu 0..{n - 1})")
    if as_json:
        print(_settings_json(gpus))
        return 0
    for g in gpus:
        print(
            f"GPU {g.index}: TQ {g.tq_s:g} s (mode {g.mode}, policy {g.policy},"
            f" escalation {g.escalation})"
        )
    return 0


def prepare_claim(
    path: str | None,
    uid: str,
    gpu: int,
    namespace: str,
    name: str,
    pods: list[str],
    memory_request: int,
    memory_limit: int,
    weight: float,
    compute_limit: float = 0.0,
) -> int:
    msg = p.PrepareClaim(
        uid=uid, namespace=namespace, name=name, gpu=gpu, pods=pods,
        memory_request=memory_request, memory_limit=memory_limit, weight=weight,
        compute_limit=compute_limit,
    )  # fmt: skip
    return _done(path, msg)


def unprepare_claim(path: str | None, uid: str, reason: str, grace_s: float) -> int:
    return _done(path, p.UnprepareClaim(uid=uid, reason=reason, grace_s=grace_s))


def end_session(path: str | None, session: int, reason: str, grace_s: float = 0.0) -> int:
    return _done(path, p.EndSession(session=session, reason=reason, grace_s=grace_s))


def _done(path: str | None, msg: p.Message) -> int:
    """Send an admin request the node answers with ``done``; print what it says."""
    with AdminClient(path) as c:
        r = c.request(msg)
    assert isinstance(r, p.Done)
    print(r.message)
    return 0


def events(path: str | None, follow: bool, since_s: float | None, session: int | None) -> int:
    with AdminClient(path, timeout=None if follow else 10.0) as c:
        for ev in c.events(follow=follow, since_s=since_s, session=session):
            if ev is not None:
                sys.stdout.write(json.dumps(ev, separators=(",", ":")) + "\n")
                if follow:
                    sys.stdout.flush()
    return 0

"""``kubectl gpushare``: the cluster's GPUs from kubectl (a kubectl plugin: kubectl runs
``kubectl-gpushare`` from PATH, installed with the ``cli`` extra).

It reads and edits the nodes' ``GPUShareNode`` objects (deploy/kubernetes/base/crd.yaml)
through the Kubernetes API, with your kubeconfig (``--kubeconfig``, ``--context``, else
``$KUBECONFIG`` or ``~/.kube/config``, as kubectl):

* ``status``: every node's GPUs, one table;
* ``tq SECONDS --pod NS/NAME`` (or ``--node NAME``): the pod's node found, its spec
  patched, and the command waits until the node's status shows it applied (or refused,
  with the node's reason); ``mode``, ``policy`` and ``escalation`` work the same way;
* ``top``: the sessions, by pod, of the cluster or one node, refreshed;
* ``events --pod NS/NAME`` (or ``--node NAME``): what the nodes said about it (Kubernetes
  Events: attached, detached, escalated; a node's settings applied or refused).

An error names its fix: no CRD installed, no such pod or node, a role missing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from gpushare.node.kube.api import PERSON, ApiError, Kube, NotFound
from gpushare.node.kube.node_status import (
    CONDITION,
    EVENTS_NAMESPACE,
    GROUP,
    KIND,
    PLURAL,
    VERSION,
)
from gpushare.settings import SettingsError, validate
from gpushare.units import format_size, parse_duration

PROG = "kubectl gpushare"


class PluginError(Exception):
    """A one-line error for the user, naming the fix."""


def die(message: str) -> NoReturn:
    print(f"{PROG}: {message}", file=sys.stderr)
    raise SystemExit(1)


class Api:
    """The calls the plugin makes, through the node's one client
    (:class:`~gpushare.node.kube.api.Kube`, as a person: its map names the ClusterRole
    to ask for); each refusal raised as :class:`PluginError` with its fix."""

    def __init__(self, kubeconfig: str | None, context: str | None) -> None:
        try:
            import kubernetes  # noqa: F401  (the cli extra)
        except ImportError:
            raise PluginError("needs the Kubernetes client: pip install 'gpushare[cli]'") from None
        from kubernetes.config import ConfigException

        try:
            self.kube = Kube(kubeconfig, context, in_cluster=False, caller=PERSON)
        except ConfigException as e:
            raise PluginError(str(e)) from None
        self.user = ""

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        try:
            return self.kube.call(what, fn, *args, **kw)
        except ApiError as e:
            raise PluginError(str(e)) from None

    def nodes(self) -> list[dict[str, Any]]:
        r = self._call(
            f"list {PLURAL}", self.kube.custom().list_cluster_custom_object, GROUP, VERSION, PLURAL
        )
        items: list[dict[str, Any]] = r.get("items") or []
        return sorted(items, key=lambda o: str(o["metadata"]["name"]))

    def node(self, name: str) -> dict[str, Any]:
        for o in self.nodes():  # a list: the viewer role needs no get
            if o["metadata"]["name"] == name:
                return o
        raise PluginError(
            f"node {name} has no {KIND}: gpushare's node does not run there (or runs"
            " without --kubernetes): kubectl -n gpushare-system get pods -o wide;"
            f" kubectl get {PLURAL} lists the nodes that have one"
        )

    def pod_node(self, ns: str, name: str) -> str:
        try:
            pod = self.kube.call(
                f"get pod {ns}/{name}", self.kube.core().read_namespaced_pod, name, ns
            )
        except NotFound:
            raise PluginError(
                f"no pod {name} in namespace {ns} (kubectl get pods -n {ns})"
            ) from None
        except ApiError as e:
            raise PluginError(str(e)) from None
        node = pod.spec.node_name
        if not node:
            raise PluginError(
                f"pod {ns}/{name} is not on a node yet (Pending, unscheduled): nothing to"
                " set; give --node NAME to set a node"
            )
        return str(node)

    def patch_spec(self, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = self._call(
            f"patch {KIND} {name}",
            self.kube.custom().patch_cluster_custom_object,
            GROUP,
            VERSION,
            PLURAL,
            name,
            {"spec": spec},
            _content_type="application/merge-patch+json",
        )
        return out

    def events(self, namespace: str, name: str, kind: str) -> list[Any]:
        r = self._call(
            f"list events in {namespace}",
            self.kube.core().list_namespaced_event,
            namespace,
            field_selector=f"involvedObject.name={name},involvedObject.kind={kind}",
        )
        return list(r.items)


def pod_ref(text: str) -> tuple[str, str]:
    ns, sep, name = text.partition("/")
    if not sep:
        ns, name = "default", text
    if not ns or not name:
        raise PluginError(f"--pod {text!r}: give NAMESPACE/NAME (or NAME in default)")
    return ns, name


# --- tables -----------------------------------------------------------------------------


def table(rows: Sequence[Sequence[object]]) -> str:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "   ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def age(updated: str, now: float) -> str:
    if not updated:
        return "never"
    try:
        t = datetime.datetime.fromisoformat(updated.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return updated
    s = max(0, int(now - t))
    return f"{s}s" if s < 120 else f"{s // 60}m" if s < 7200 else f"{s // 3600}h"


def _name(o: object) -> str:
    try:
        return str(o["metadata"]["name"])  # type: ignore[index]
    except (KeyError, TypeError):
        return "?"


def _malformed(e: Exception) -> str:
    """What is wrong with an object as the node should not have written it, briefly."""
    what = {KeyError: "lacks", TypeError: "has a wrong type", ValueError: "has a wrong value"}
    kind = next((w for k, w in what.items() if isinstance(e, k)), "is unreadable")
    return f"(malformed status: {kind} {str(e)[:60]})"


def status_table(objs: Sequence[dict[str, Any]], now: float) -> str:
    rows: list[list[object]] = [
        [
            "NODE",
            "GPU",
            "MODEL",
            "MEMORY",
            "TQ",
            "MODE",
            "POLICY",
            "ESCALATION",
            "HOLDERS",
            "WAITING",
            "SESSIONS",
            "SWAPPED",
            "SETTINGS",
            "UPDATED",
        ]
    ]
    for o in objs:
        name = _name(o)
        try:  # one node's object written wrong hides no other node's rows
            rows += _status_rows(o, name, now)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            rows.append([name, "-", _malformed(e), *["-"] * 11])
    return table(rows)


def _status_rows(o: dict[str, Any], name: str, now: float) -> list[list[object]]:
    rows: list[list[object]] = []
    st = o.get("status") or {}
    cond: dict[str, Any] = next(
        (c for c in st.get("conditions") or [] if c["type"] == CONDITION), {}
    )
    if not st.get("gpus"):
        return [[name, "-", "(no status yet)", *["-"] * 11]]
    sessions = st.get("sessions") or []
    for g in st["gpus"]:
        mine = [s for s in sessions if s["gpu"] == g["index"]]
        model = ("[simulated] " if g.get("simulated") else "") + str(g["model"])
        rows.append(
            [
                name,
                g["index"],
                model,
                g["memory"],
                f"{g['tq']:g}s",
                g["mode"],
                g["policy"],
                g["escalation"],
                len(g["holders"]),
                len(g["queue"]),
                len(mine),
                format_size(sum(int(s["swappedBytes"]) for s in mine)),
                cond.get("reason", "-"),
                age(st.get("updated", ""), now),
            ]
        )
    return rows


def top_table(objs: Sequence[dict[str, Any]], now: float) -> str:
    rows: list[list[object]] = [
        [
            "NODE",
            "GPU",
            "SESSION",
            "POD",
            "CONTAINER",
            "STATE",
            "FRACTION",
            "REQUEST",
            "LIMIT",
            "RESIDENT",
            "SWAPPED",
            "LEASE",
            "WAIT",
        ]
    ]
    heads = []
    for o in objs:
        name = _name(o)
        try:  # one node's object written wrong hides no other node's sessions
            more, head = _top_rows(o, name, now)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            more, head = [], f"{name}: {_malformed(e)}"
        rows += more
        heads.append(head)
    body = table(rows) if len(rows) > 1 else "no sessions"
    return "\n".join([*heads, "", body])


def _top_rows(o: dict[str, Any], name: str, now: float) -> tuple[list[list[object]], str]:
    st = o.get("status") or {}
    rows: list[list[object]] = []
    holders = {sid for g in st.get("gpus") or [] for sid in g["holders"]}
    for s in st.get("sessions") or []:
        pod = f"{s['namespace']}/{s['pod']}" if s.get("pod") else f"({s['name']})"
        rows.append(
            [
                name,
                s["gpu"],
                s["id"],
                pod,
                s.get("container") or "-",
                ("*" if s["id"] in holders else "") + s["state"],
                f"{s['fraction']:g}" if "fraction" in s else "-",
                s.get("memoryRequest", "-"),  # "-": a node from before it was published
                s["memoryLimit"],
                format_size(int(s["residentBytes"])),
                format_size(int(s["swappedBytes"])),
                f"{s['leaseSeconds']:.1f}s",
                f"{s['waitSeconds']:.1f}s",
            ]
        )
    summary = st.get("summary") or {}
    head = (
        f"{name}: {summary.get('gpus', 0)} GPU, TQ {summary.get('tq', '-')}, mode"
        f" {summary.get('mode', '-')}, {summary.get('holders', 0)} holding,"
        f" {summary.get('waiting', 0)} waiting, updated {age(st.get('updated', ''), now)}"
        " ago"
    )
    return rows, head


# --- commands ---------------------------------------------------------------------------


def _status_of(o: dict[str, Any]) -> dict[str, Any]:
    st = o.get("status") if isinstance(o, dict) else None
    return st if isinstance(st, dict) else {} if st is None else {"malformed": True}


def cmd_status(api: Api, a: argparse.Namespace) -> int:
    objs = [api.node(a.node)] if a.node else api.nodes()
    if a.output == "json":
        print(json.dumps([{"node": _name(o), **_status_of(o)} for o in objs], indent=1))
        return 0
    if not objs:
        print(
            f"no {KIND} objects: no gpushare node publishes here yet (kubectl -n"
            " gpushare-system get pods -o wide)"
        )
        return 0
    print(status_table(objs, time.time()))
    return 0


def cmd_top(api: Api, a: argparse.Namespace) -> int:
    n = 0
    try:
        while True:
            objs = [api.node(a.node)] if a.node else api.nodes()
            frame = top_table(objs, time.time())
            if a.once or not sys.stdout.isatty():
                print(frame, flush=True)
            else:
                print("\x1b[H\x1b[2J" + frame, flush=True)  # home, clear: a refreshed table
            n += 1
            if a.once or (a.count and n >= a.count):
                return 0
            time.sleep(a.interval)
    except KeyboardInterrupt:
        return 0


def checked_value(a: argparse.Namespace) -> object:
    """The value to set, checked as the node checks it (the node is still the judge): a
    typo is caught before anything is patched."""
    try:
        if a.command == "tq":
            v = float(a.value)
            validate(tq_s=v)
            return v
        validate(**{a.command: a.value})
        return str(a.value)
    except (SettingsError, ValueError) as e:
        raise PluginError(f"{a.command} {a.value}: {e}") from None


def cmd_set(api: Api, a: argparse.Namespace) -> int:
    key = a.command
    raw = checked_value(a)
    node, where = _target(api, a, key)
    api.node(node)  # it has one: else the patch would say only "not found"
    spec: dict[str, Any] = {key: raw} if a.gpu is None else {"gpu": {str(a.gpu): {key: raw}}}
    obj = api.patch_spec(node, spec)
    generation = int(obj["metadata"].get("generation") or 0)
    field = f"gpu.{a.gpu}.{key}" if a.gpu is not None else key
    print(
        f"{where}: spec.{field} = {raw} (generation {generation}); waiting for the node to apply it"
    )
    if a.no_wait:
        return 0
    deadline = time.monotonic() + a.timeout
    st: dict[str, Any] = {}
    while time.monotonic() < deadline:
        st = api.node(node).get("status") or {}
        gpus = _applied(st, a.gpu, key, raw, generation, where)
        if gpus:
            for g in gpus:
                print(
                    f"{node}: GPU {g['index']}: TQ {g['tq']:g} s, mode {g['mode']}, policy"
                    f" {g['policy']}, escalation {g['escalation']} (applied from the next"
                    " quantum)"
                )
            return 0
        time.sleep(0.25)
    raise PluginError(
        f"{where}: not applied within {a.timeout:g} s (status updated"
        f" {age(st.get('updated', ''), time.time())} ago): is its gpushare node running?"
        f" kubectl -n gpushare-system get pods -o wide --field-selector spec.nodeName={node}"
    )


def _target(api: Api, a: argparse.Namespace, key: str) -> tuple[str, str]:
    """The node a setting goes to (``--node``, or ``--pod``'s), and how to say it."""
    if bool(a.pod) == bool(a.node):
        raise PluginError(f"{key}: give --pod NAMESPACE/NAME or --node NAME (one of them)")
    if not a.pod:
        return a.node, f"node {a.node}"
    ns, pod = pod_ref(a.pod)
    node = api.pod_node(ns, pod)
    return node, f"node {node} (of pod {ns}/{pod})"


def _applied(
    st: dict[str, Any], gpu: int | None, key: str, raw: object, generation: int, where: str
) -> list[dict[str, Any]]:
    """The GPUs that show the setting applied, once the node has seen ``generation``
    (none yet: ``[]``); a refusal the node wrote raises :class:`PluginError`."""
    cond: dict[str, Any] = next(
        (c for c in st.get("conditions") or [] if c["type"] == CONDITION), {}
    )
    if int(cond.get("observedGeneration") or 0) < generation:
        return []
    if cond.get("status") == "False":
        raise PluginError(f"{where} refused it: {cond.get('message', '')}")
    gpus = [g for g in st.get("gpus") or [] if gpu is None or g["index"] == gpu]
    return gpus if gpus and all(g[key] == raw for g in gpus) else []


def cmd_events(api: Api, a: argparse.Namespace) -> int:
    if bool(a.pod) == bool(a.node):
        raise PluginError("events: give --pod NAMESPACE/NAME or --node NAME (one of them)")
    if a.pod:
        ns, name = pod_ref(a.pod)
        evs = api.events(ns, name, "Pod")
    else:
        api.node(a.node)
        evs = api.events(EVENTS_NAMESPACE, a.node, KIND)
    evs = [e for e in evs if (e.source and e.source.component == "gpushare-node")]
    evs.sort(key=lambda e: e.last_timestamp or e.metadata.creation_timestamp)
    if not evs:
        print("no gpushare events" + (f" for pod {a.pod}" if a.pod else f" for node {a.node}"))
        return 0
    now = time.time()
    rows: list[list[object]] = [["LAST SEEN", "TYPE", "REASON", "NODE", "MESSAGE"]]
    for e in evs:
        ts = e.last_timestamp or e.metadata.creation_timestamp
        rows.append([age(ts.isoformat(), now), e.type, e.reason, e.source.host or "-", e.message])
    print(table(rows))
    return 0


def _seconds(text: str) -> float:
    """A positive, finite number of seconds (``2``, ``500ms``, ``1m``), as gpushare's own
    flags take durations; ``-1``, ``nan`` or ``inf`` is a usage error, not a traceback."""
    try:
        v = parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not 0 < v <= 86400:
        raise argparse.ArgumentTypeError(
            f"must be a positive number of seconds up to 1 d (like 2, 500ms, 1m), not {text}"
        )
    return v


def _count(text: str) -> int:
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0, not {text}")
    return int(text)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """A usage mistake in one line (exit status 2), naming where --help is."""
        print(f"{PROG}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def parser() -> argparse.ArgumentParser:
    ap = _Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config)")
    ap.add_argument("--context", help="the kubeconfig's context to use")
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("status", help="every node's GPUs, one table")
    s.add_argument("--node", help="one node")
    s.add_argument("-o", "--output", choices=["table", "json"], default="table")
    for key, help_ in (
        ("tq", "the time quantum, seconds"),
        ("mode", "auto or exclusive"),
        ("policy", "equal or weighted"),
        ("escalation", "log, freeze or kill"),
    ):
        c = sub.add_parser(key, help=f"set {key} on a pod's node (or a node), and wait for it")
        c.add_argument("value", help=help_)
        c.add_argument("--pod", help="NAMESPACE/NAME: that pod's node")
        c.add_argument("--node", help="the node by name")
        c.add_argument("--gpu", type=int, help="one GPU of the node (default: all)")
        c.add_argument("--timeout", type=_seconds, default=60.0, help="seconds to wait (60)")
        c.add_argument("--no-wait", action="store_true", help="patch, do not wait")
    t = sub.add_parser("top", help="the sessions by pod, refreshed")
    t.add_argument("--node", help="one node")
    t.add_argument("--interval", type=_seconds, default=2.0, help="seconds between tables (2)")
    t.add_argument("--once", action="store_true", help="one table, then exit")
    t.add_argument("--count", type=_count, default=0, help="this many tables, then exit")
    e = sub.add_parser("events", help="what the nodes said about a pod (or a node)")
    e.add_argument("--pod", help="NAMESPACE/NAME")
    e.add_argument("--node", help="a node's settings applied or refused")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    a = parser().parse_args(argv)
    commands: dict[str, Callable[[Api, argparse.Namespace], int]] = {
        "status": cmd_status,
        "top": cmd_top,
        "events": cmd_events,
        "tq": cmd_set,
        "mode": cmd_set,
        "policy": cmd_set,
        "escalation": cmd_set,
    }
    try:
        if a.command in ("tq", "mode", "policy", "escalation"):
            checked_value(a)
        api = Api(a.kubeconfig, a.context)
        return commands[a.command](api, a)
    except PluginError as e:
        die(str(e))


if __name__ == "__main__":
    sys.exit(main())

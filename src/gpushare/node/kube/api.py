"""The one Kubernetes client of the node and of ``kubectl gpushare``: the configuration
loaded (a kubeconfig file and context, or in-cluster), a client-side deadline on every
call, and ONE map (:func:`explain`) from the API's refusals and a server out of reach to
a one-line :class:`ApiError` naming the fix.

Its users: the pod watcher (:mod:`~gpushare.node.kube.k8s`), the node's GPUShareNode
(:mod:`~gpushare.node.kube.node_api`) and the kubectl plugin
(:mod:`gpushare.tools.kubectl_gpushare`). The official client (the ``k8s`` or ``cli``
extra) is imported only when a :class:`Kube` is made: the node runs without it.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from gpushare.node.kube.node_status import CRD, KIND

T = TypeVar("T")

MANIFESTS = "kubectl apply -k deploy/kubernetes/overlays/plain"
RBAC = "deploy/kubernetes/base/rbac.yaml"
CLUSTER_INFO = "check `kubectl cluster-info`"
_WRITES = ("patch", "create", "update", "delete", "replace")


class ApiError(Exception):
    """A call the API refused, or a server out of reach: one line naming the fix.
    ``status`` is the HTTP status (0: no answer)."""

    status = 0

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class Absent(ApiError):
    """Not here for this caller: the kind (no CRD installed) or the right (403)."""


class NoKind(Absent):
    """404 on the kind: the API server has no GPUShareNode (its CRD is not installed)."""


class Forbidden(Absent):
    """403: the caller's role lacks the right."""


class Unauthorized(ApiError):
    """401: the caller's credentials are refused."""


class NotFound(ApiError, LookupError):
    """404 on an object: the kind is there, that object is not."""


class Conflict(ApiError):
    """409: it exists already, or changed meanwhile."""


class Expired(ApiError):
    """410 Gone: a watch's resourceVersion is older than the server keeps: list again."""


class TooMany(ApiError):
    """429: the server asks the caller to slow down; ``retry_after`` seconds (or 0)."""

    retry_after = 0.0


class Unreachable(ApiError):
    """No answer: the server is not there, or said nothing within the deadline."""


@dataclass(frozen=True)
class Caller:
    """Who calls, for the fix a refusal names: the node's service account (``person``
    False), or a person with a kubeconfig; the ClusterRoles that give it reads and
    writes (deploy/kubernetes/base/rbac.yaml)."""

    person: bool
    reader: str
    writer: str

    def role(self, what: str) -> str:
        return self.writer if what.split(" ", 1)[0] in _WRITES else self.reader


NODE = Caller(person=False, reader="gpushare-node", writer="gpushare-node")
PERSON = Caller(person=True, reader="gpushare-viewer", writer="gpushare-editor")


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def _status_of(e: Any) -> tuple[str, dict[str, Any]]:
    """The server's Status message (its JSON body's), else the HTTP reason, and its
    details."""
    try:
        body = json.loads(e.body or "{}")
    except (TypeError, ValueError):
        body = {}
    if not isinstance(body, dict):
        body = {}
    details = body.get("details") if isinstance(body.get("details"), dict) else {}
    return _one_line(body.get("message") or e.reason or f"HTTP {e.status}"), details or {}


def _retry_after(e: Any) -> float:
    try:
        return max(0.0, float((e.headers or {}).get("Retry-After", 0)))
    except (TypeError, ValueError):
        return 0.0


def refusal(what: str, status: int, message: str, caller: Caller, **more: Any) -> ApiError:
    """The one map from an API refusal (``status``, the server's ``message``) of the
    call ``what`` (``"list gpusharenodes"``) to its one-line error naming the fix."""
    role = caller.role(what)
    if status == 401:
        fix = (
            "your kubeconfig's credentials"
            if caller.person
            else "the node's credentials: its service account's token in a pod, else KUBECONFIG's"
        )
        return Unauthorized(f"{what}: unauthorized: {message} ({fix})", status)
    if status == 403:
        if caller.person:
            return Forbidden(
                f"{what}: forbidden: {message}. Ask an administrator to bind the ClusterRole"
                f" {role} ({RBAC}) to you: kubectl create clusterrolebinding $USER-{role}"
                f" --clusterrole={role} --user=$USER",
                status,
            )
        return Forbidden(
            f"{what}: forbidden ({message}): the node's service account lacks the rights of"
            f" the ClusterRole {role} ({RBAC}: {MANIFESTS})",
            status,
        )
    if status == 404 and not more.get("name"):
        return NoKind(
            f"{what}: the API server has no {KIND} kind (the CRD {CRD} is not installed):"
            f" {MANIFESTS} (or -f deploy/kubernetes/base/crd.yaml)",
            status,
        )
    if status == 404:
        return NotFound(f"{what}: {message}", status)
    if status == 409:
        return Conflict(f"{what}: conflict: {message}", status)
    if status == 410:
        return Expired(f"{what}: expired ({message}): list again", status)
    if status == 429:
        after = float(more.get("retry_after") or 0.0)
        when = f"in {after:g} s" if after else "later"
        e = TooMany(f"{what}: the API server is throttling ({message}): try again {when}", status)
        e.retry_after = after
        return e
    if status >= 500:
        return ApiError(
            f"{what}: the API server failed ({status}: {message}); {CLUSTER_INFO}", status
        )
    return ApiError(f"{what}: {message}", status)


def explain(what: str, e: BaseException, caller: Caller) -> ApiError:
    """:func:`refusal` for an ``ApiException``; a connection refused, reset or silent
    past its deadline (urllib3's errors, ``OSError``) is :class:`Unreachable`."""
    if isinstance(e, ApiError):
        return e
    status = getattr(e, "status", None)
    if isinstance(status, int) and hasattr(e, "body"):  # an ApiException
        message, details = _status_of(e)
        return refusal(
            what, status, message, caller, name=details.get("name"), retry_after=_retry_after(e)
        )
    silent = "timed out" in str(e).lower() or isinstance(e, TimeoutError)
    why = "no answer within the deadline" if silent else "cannot reach the API server"
    return Unreachable(f"{what}: {why} ({type(e).__name__}: {_one_line(e)}); {CLUSTER_INFO}")


def _mapped() -> tuple[type[BaseException], ...]:
    """What :func:`explain` maps: the client's ApiException, urllib3's and the OS's."""
    import urllib3
    from kubernetes.client.rest import ApiException

    return ApiException, urllib3.exceptions.HTTPError, OSError


def load_config(kubeconfig: str | None, context: str | None, *, in_cluster: bool) -> Any:
    """The client's Configuration: ``kubeconfig`` (and ``context``) where given; else,
    with ``in_cluster``, the pod's service account, then ``$KUBECONFIG`` or
    ``~/.kube/config``. Raises the client's ``ConfigException`` in one line naming the
    fix (both reasons where neither way works: in a pod the first says what is missing).
    """
    from kubernetes import client, config

    cfg = client.Configuration()
    if in_cluster and not kubeconfig and not context:
        try:
            config.load_incluster_config(client_configuration=cfg)
            return cfg
        except config.ConfigException as in_pod:
            try:
                config.load_kube_config(client_configuration=cfg)
                return cfg
            except (config.ConfigException, OSError) as e:
                raise config.ConfigException(
                    f"no Kubernetes API configuration: in-cluster: {_one_line(in_pod)} (in a"
                    f" pod: mount the service account's token); kubeconfig: {_one_line(e)}"
                    " (set KUBECONFIG)"
                ) from None
    try:
        config.load_kube_config(config_file=kubeconfig, context=context, client_configuration=cfg)
    except (config.ConfigException, OSError) as e:
        raise config.ConfigException(
            f"no Kubernetes configuration: {_one_line(e)} (set KUBECONFIG, or --kubeconfig FILE)"
        ) from None
    return cfg


@dataclass(frozen=True)
class Deadlines:
    """Client-side deadlines, seconds: a connection that dies without a word (a node cut
    off, a load balancer dropping it) fails the call instead of hanging. A watch asks
    the server to end it after ``watch``; one silent for longer than ``idle`` (default
    ``watch`` + 30 s) is taken for dead."""

    connect: float = 10.0
    request: float = 30.0
    watch: float = 300.0
    idle: float | None = None

    def call(self) -> tuple[float, float]:
        return (self.connect, self.request)

    def stream(self) -> tuple[float, float]:
        return (self.connect, self.idle if self.idle is not None else self.watch + 30.0)


class Kube:
    """One connection to the API server: its configuration loaded once, a client per
    thread that calls (a watch's thread and a writer's share no connection pool), every
    call under its deadline and its refusals mapped by :func:`explain`."""

    def __init__(
        self,
        kubeconfig: str | None = None,
        context: str | None = None,
        *,
        in_cluster: bool = True,
        caller: Caller = NODE,
        deadlines: Deadlines | None = None,
    ) -> None:
        import urllib3

        self.cfg = load_config(kubeconfig, context, in_cluster=in_cluster)
        # urllib3's default would sleep out a 429's Retry-After and ask again, three
        # times, inside one call, and retry a read that timed out: the deadline would not
        # be the deadline. A refused connection is retried; the rest is the caller's.
        self.cfg.retries = urllib3.Retry(total=2, read=0, respect_retry_after_header=False)
        self.caller = caller
        self.deadlines = deadlines or Deadlines()
        self._local = threading.local()
        self._errors = _mapped()

    def _client(self) -> Any:
        from kubernetes import client

        api = getattr(self._local, "api", None)
        if api is None:
            api = self._local.api = client.ApiClient(self.cfg)
        return api

    def core(self) -> Any:
        """This thread's ``CoreV1Api``."""
        from kubernetes import client

        return client.CoreV1Api(self._client())

    def custom(self) -> Any:
        """This thread's ``CustomObjectsApi``."""
        from kubernetes import client

        return client.CustomObjectsApi(self._client())

    def plain(self, obj: Any) -> Any:
        """A client model as the API serves it (JSON types, camelCase)."""
        return self._client().sanitize_for_serialization(obj)

    def call(self, what: str, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        """``fn(*args, **kw)`` under the request deadline; a refusal raised as
        :class:`ApiError` (``what`` says the call: ``"patch GPUShareNode x"``)."""
        try:
            return fn(*args, _request_timeout=self.deadlines.call(), **kw)
        except self._errors as e:
            raise explain(what, e, self.caller) from None

    def stream(
        self, what: str, fn: Callable[..., Any], *args: Any, **kw: Any
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """A watch of ``fn`` (a list call): (event type, object as served) until the
        server ends it; a refusal (410: :class:`Expired`) or a silent connection raised
        as :class:`ApiError`."""
        from kubernetes import watch

        try:
            for ev in watch.Watch().stream(
                fn,
                *args,
                timeout_seconds=int(self.deadlines.watch),
                _request_timeout=self.deadlines.stream(),
                **kw,
            ):
                yield ev["type"], ev["raw_object"]
        except self._errors as e:
            raise explain(what, e, self.caller) from None

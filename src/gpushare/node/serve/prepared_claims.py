"""The DRA ResourceClaims prepared on this node, as gpushare's DRA plugin told them over
the admin socket (:class:`gpushare.protocol.PrepareClaim`), and what they bound: a
session that names one (its hello's ``claim``, from the CDI env) attaches only on the
claim's GPU, only from a pod it is reserved for (where the kernel names the pod), and
within the claim's memory request and limit. A claim the plugin did not prepare is no
one's to name. Pure: the servers check and apply."""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpushare import protocol as p
from gpushare.node.guard import Refused
from gpushare.node.keep.recovery import SessionRecord
from gpushare.units import MAX_WEIGHT, MIN_WEIGHT

# Bounds on what a PrepareClaim may hold: Kubernetes' own for the names, and for the
# pods a claim is reserved for (ResourceClaimReservedForMaxSize); a node's claims are
# bounded too, so even an administrator's loop cannot grow the table without end.
MAX_PODS = 256
MAX_CLAIMS = 4096
_UID = re.compile(r"^[0-9a-fA-F-]{1,36}$")
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


@dataclass(frozen=True)
class PreparedClaim:
    uid: str
    namespace: str
    name: str
    gpu: int
    pods: frozenset[str]
    memory_request: int  # bytes; 0: none allocated
    memory_limit: int  # bytes; 0: none given
    weight: float  # 0: none given (the session's own word, as without a claim)
    compute_limit: float = 0.0  # in (0, 1]; 0: none given

    @property
    def terms(self) -> tuple[int, float, float]:
        """Its request, weight and compute limit, as a session's record keeps them."""
        return self.memory_request, self.weight, self.compute_limit

    def compute(self, asked: float | None) -> float | None:
        """A hello's compute limit within this claim's (the lower of the two)."""
        if not self.compute_limit:
            return asked
        return self.compute_limit if asked is None else min(asked, self.compute_limit)

    def bounds(self, limit: int, request: int | None) -> tuple[int, int | None]:
        """A hello's limit and request within this claim's: the limit no more than the
        claim's (its request where it gives none, as the scheduler allocated no more),
        the request no more than the claim's."""
        most = self.memory_limit or self.memory_request
        if most:
            limit = min(limit, most)
        if self.memory_request:  # none asked: the claim's (the node would fill in the limit)
            asked = self.memory_request if request is None else request
            request = min(asked, self.memory_request, limit)
        return limit, request


def check(m: p.PrepareClaim, gpus: int) -> PreparedClaim:
    """A PrepareClaim's fields within their bounds, or :class:`p.ProtocolError` naming
    the field (the plugin sends what the API server checked: one that does not is
    broken, and nothing of it is kept)."""
    if not _UID.fullmatch(m.uid):  # fullmatch: "$" would let a final newline through
        raise p.ProtocolError(f"prepare_claim: uid {m.uid[:40]!r} is not a Kubernetes UID")
    for field, text, most in (("namespace", m.namespace, 63), ("name", m.name, 253)):
        if text and (len(text) > most or not _NAME.fullmatch(text)):
            raise p.ProtocolError(
                f"prepare_claim: {field} {text[:64]!r} is not a Kubernetes name of at most"
                f" {most} characters"
            )
    if not 0 <= m.gpu < gpus:
        raise p.ProtocolError(f"prepare_claim: gpu {m.gpu}: this node has GPUs 0..{gpus - 1}")
    if len(m.pods) > MAX_PODS:
        raise p.ProtocolError(f"prepare_claim: pods must be at most {MAX_PODS} pod UIDs")
    if bad := next((u for u in m.pods if not _UID.fullmatch(u)), None):
        raise p.ProtocolError(f"prepare_claim: pods: {bad[:40]!r} is not a pod UID")
    _check_figures(m)
    return PreparedClaim(
        uid=m.uid,
        namespace=m.namespace,
        name=m.name,
        gpu=m.gpu,
        pods=frozenset(m.pods),
        memory_request=m.memory_request,
        memory_limit=m.memory_limit,
        weight=m.weight,
        compute_limit=m.compute_limit,
    )


def _check_figures(m: p.PrepareClaim) -> None:
    """The claim's memory, weight and compute limit within their bounds."""
    if not (0 <= m.memory_request < 2**63 and 0 <= m.memory_limit < 2**63):
        raise p.ProtocolError("prepare_claim: memory_request and memory_limit are bytes >= 0")
    if m.memory_limit and m.memory_limit < m.memory_request:
        raise p.ProtocolError(
            f"prepare_claim: memory_limit {m.memory_limit} is below memory_request"
            f" {m.memory_request}: give a limit at least the request"
        )
    if m.compute_limit and not 0 < m.compute_limit <= 1:
        raise p.ProtocolError(
            f"prepare_claim: compute_limit {m.compute_limit:g} is not a fraction in (0, 1]"
        )
    if m.weight and not MIN_WEIGHT <= m.weight <= MAX_WEIGHT:
        raise p.ProtocolError(
            f"prepare_claim: weight {m.weight:g} is out of range: {MIN_WEIGHT:g} to {MAX_WEIGHT:g}"
        )


def of_record(named: str, rec: SessionRecord, gpu: int, pod_uid: str) -> PreparedClaim | None:
    """The claim a session's record keeps from before a node restart, where the plugin
    has not told it again yet and the hello names that claim or none: the session is held
    to it as it was (its bounded limit, the claim's request, weight and compute limit),
    from the same pod and on the same GPU; None otherwise."""
    same = rec.pod_uid == pod_uid and rec.gpu == gpu and named in ("", rec.claim)
    if not (rec.claim and same):
        return None
    pods = frozenset({pod_uid}) if pod_uid else frozenset()
    request, weight, compute = rec.claim_terms
    return PreparedClaim(rec.claim, "", "", gpu, pods, request, rec.limit, weight, compute)


def held_already(c: PreparedClaim, sessions: list[int]) -> Refused:
    ids = ", ".join(str(i) for i in sessions)
    return Refused(
        "claim",
        f"hello: claim {c.namespace}/{c.name} is held by session {ids} already: a claim is one"
        " session's share (the processes its program starts join it: gpushare run makes"
        " them members); give another container or pod a claim of its own",
    )


def not_prepared(uid: str) -> Refused:
    return Refused(
        "claim",
        f"hello: claim {uid[:40]} is not prepared on this node: a claim's share is given"
        " through its pod's ResourceClaim (gpushare's DRA plugin prepares it and writes"
        " GPUSHARE_CLAIM); unset GPUSHARE_CLAIM to attach without one",
    )


class PreparedClaims:
    """The node's prepared claims by UID."""

    def __init__(self) -> None:
        self.by_uid: dict[str, PreparedClaim] = {}

    def prepare(self, c: PreparedClaim) -> str:
        """Keep ``c`` (the plugin's word replaces what it said before); what changed."""
        before = self.by_uid.get(c.uid)
        if before == c:
            return "prepared already"
        if before is None and len(self.by_uid) >= MAX_CLAIMS:
            raise Refused(
                "busy", f"{MAX_CLAIMS} claims are prepared on this node, the most: unprepare some"
            )
        self.by_uid[c.uid] = c
        return "prepared" if before is None else "updated"

    def unprepare(self, uid: str) -> PreparedClaim | None:
        return self.by_uid.pop(uid, None)

    def admit(self, uid: str, gpu: int, pod_uid: str, on_record: str = "") -> PreparedClaim | None:
        """The claim a hello names, checked against what the kernel says of its process
        (its pod) and the GPU it attaches on; :class:`Refused` naming the fix otherwise.
        ``on_record``: the claim of the session's record from before a node restart (the
        plugin tells its claims again at its next resync), which it may name meanwhile."""
        if not uid:
            return self._of_pod(gpu, pod_uid)
        c = self.by_uid.get(uid)
        if c is None:
            if uid == on_record:
                return None
            raise not_prepared(uid)
        if c.gpu != gpu:
            raise Refused(
                "claim",
                f"hello: claim {c.namespace}/{c.name} is on GPU {c.gpu}, not GPU {gpu}:"
                " attach on the GPU the claim gives (NVIDIA_VISIBLE_DEVICES from its CDI env)",
            )
        if pod_uid and pod_uid not in c.pods:  # reserved for no pod: for none of them
            raise Refused(
                "claim",
                f"hello: claim {c.namespace}/{c.name} is reserved for other pods, not this"
                f" process's pod {pod_uid}: a pod names only its own claims",
            )
        return c

    def _of_pod(self, gpu: int, pod_uid: str) -> PreparedClaim | None:
        """A hello that names no claim, from a pod (the kernel's word) that has claims
        prepared here: bound by its claim all the same, so unsetting GPUSHARE_CLAIM steps
        out of no share; on a GPU none of them gives, or with several there, refused."""
        if not pod_uid:
            return None
        mine = [c for c in self.by_uid.values() if pod_uid in c.pods]
        here = sorted((c for c in mine if c.gpu == gpu), key=lambda c: c.uid)
        if len(here) == 1 or not mine:
            return here[0] if here else None
        if not here:
            gpus = ", ".join(str(g) for g in sorted({c.gpu for c in mine}))
            raise Refused(
                "claim",
                f"hello: this process's pod {pod_uid} has its GPU share through ResourceClaims"
                f" on GPU {gpus}, not GPU {gpu}: attach on its claim's GPU"
                " (NVIDIA_VISIBLE_DEVICES from its CDI env)",
            )
        names = ", ".join(f"{c.namespace}/{c.name}" for c in here)
        raise Refused(
            "claim",
            f"hello: this process's pod {pod_uid} has {len(here)} claims on GPU {gpu} ({names}):"
            " name one with GPUSHARE_CLAIM (its CDI env sets it)",
        )

"""What a hello's figures come to at attach, as the node reckons them: the memory limit
and request it asks, whose job or family it is (the kernel's pod, else its uid), the gang
it may join, and the session's record. Pure: the workload server checks and applies."""

from __future__ import annotations

from gpushare import protocol as p
from gpushare.core import families
from gpushare.core.arbiter import Arbiter
from gpushare.node.guard import Conn
from gpushare.node.host.identity import CgroupIdentity
from gpushare.node.keep.recovery import SessionRecord


def family_of(
    arb: Arbiter, head: Conn | None, rec: SessionRecord | None, gang: str, who: str
) -> tuple[int, str]:
    """A session's family (a new member's session, checked; else what its record says;
    0: none) and the gang it is in: its job's, else its family's."""
    family = head.session if head is not None else (rec.family if rec is not None else 0)
    if family and not gang:  # a rank's processes are in its job's gang already
        gang = families.key(family, who)
    if head is not None:  # the session's own gang (its job's if it is a rank of one)
        gang = arb.sessions[head.session].rank.gang or gang
    return family, gang


def who_of(uid: int, identity: CgroupIdentity) -> str:
    """Whose a job or family is, as the kernel says: the pod, else the uid."""
    return f"pod:{identity.pod_uid}" if identity.pod_uid else f"uid:{uid}"


def gang_of(h: p.Hello, uid: int, identity: CgroupIdentity) -> tuple[str, bool]:
    """The node's key of the job a hello says it is a rank of ("" for none), and whether
    the job spans nodes (its figures bounded by `hello_bounds.check_hello`). The key joins the
    job's id to what the kernel says (the pod, else the uid): a rank can join only a job
    of its own pod or user, whatever id it claims."""
    if not h.gang:
        return "", False
    return f"{h.gang}@{who_of(uid, identity)}", 0 < h.gang_size < h.world_size


def bucket_of(uid: int, identity: CgroupIdentity, name: str) -> str:
    """The compute bucket of a session: its workload's, whichever session of it attaches
    (the pod, else the user's session of that name)."""
    return who_of(uid, identity) if identity.pod_uid else f"uid:{uid}/{name}"


def limit_of(h: p.Hello, capacity: int) -> int:
    """The memory limit a hello asks for: its own, its pod's portion limit or portion,
    or the whole GPU."""
    if h.memory_limit is not None:
        return h.memory_limit
    if h.portion is not None:
        return max(1, int(capacity * (h.portion_limit or h.portion)))
    return capacity


def request_of(h: p.Hello, capacity: int, limit: int) -> int | None:
    """The memory request a hello asks for: its own, its pod's portion (when a portion
    limit makes the limit larger), else none (the limit). The arbiter checks it."""
    if h.memory_request is not None:
        return h.memory_request
    if h.portion is not None and h.portion_limit is not None and h.memory_limit is None:
        return max(1, int(capacity * h.portion))
    return None


def record_of(
    conn: Conn,
    sid: int,
    gpu: int,
    identity: CgroupIdentity,
    limit: int,
    name: str,
    family: int,
    claim: str = "",
    terms: tuple[int, float, float] = (0, 0.0, 0.0),
) -> SessionRecord:
    return SessionRecord(
        id=sid,
        gpu=gpu,
        pid=conn.pid,
        start_time=conn.proc.start_time if conn.proc else 0,
        uid=conn.uid,
        pod_uid=identity.pod_uid,
        container_id=identity.container_id,
        limit=limit,
        name=name,
        family=family,
        claim=claim,
        claim_terms=terms,
    )

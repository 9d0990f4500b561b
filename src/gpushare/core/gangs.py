"""Gangs: the ranks of one distributed job on a GPU, granted and revoked as one holder.

The ranks of a DDP job wait for each other in their collectives. Granted one at a time,
the rank that holds the GPU blocks in an all-reduce for a rank that waits for the GPU,
and never reaches a safe point (issue 14). So the arbiter treats a gang as one holder
(docs/scheduling.md "Gangs"):

* a member that asks while its gang holds (or waits for a holder's next ask) is
  granted at once, its memory permitting, ahead of the queue: the GPU is its job's;
* the gang's quantum is its first holder's: members that join get what is left of it;
* when it ends and another job waits, every holding member is revoked, with one
  deadline (the gang's grace period) for all of them;
* a member that yields at its safe point is *parked*: it waits, and the GPU stays the
  gang's until every member has yielded. A member blocked in a collective may be
  waiting for a parked one: after :data:`REGROUP_S` with peers still holding, the
  parked members are granted again and revoked at once, to go on to their next safe
  point. Each regroup takes them one safe point further, to the collective and
  through it; then the blocked peers reach their safe points after it, and the
  regrouped ones theirs, before the next collective (which needs them all): the gang
  has yielded. A member that asks while its gang yields is granted the same way. (The
  client gives a rank fewer safe points, its outermost ones, so that this takes a
  few regroups: docs/scheduling.md);
* members that have not attached or asked are never waited for: the size a client
  gives is shown, never trusted to hold the GPU (a gang is the members present).

The rules are here, beside the gang's data (:class:`Gangs`); the arbiter calls them at
its inputs and in its decision loop.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from gpushare.core.actions import RevokeAction
from gpushare.core.checks import ArbiterError
from gpushare.core.events import Revoke
from gpushare.core.ledger import at_limit, view
from gpushare.core.planner import MemoryView, plan_grant
from gpushare.core.sessions import SessionState, State
from gpushare.core.state import GpuState
from gpushare.settings import Mode

# A parked member waits this long for its peers to reach their safe points before it
# is let go on to its next one (a peer may be blocked in a collective waiting for it).
# Short beside the grace period: a regroup too early costs a step of the job's work.
REGROUP_S = 0.1


@dataclass
class Gang:
    key: str  # the node's: the verified identity and the job's id
    size: int = 0  # ranks on this node, as the client says: shown, never waited for
    spans_nodes: bool = False  # the job has ranks on other nodes
    members: set[int] = field(default_factory=set)
    revoked: bool = False  # its members were revoked: each yields at its safe point
    reason: str = ""  # why (quantum, turn)
    deadline: float = 0.0  # while revoked: then the members still holding are escalated
    escalated: bool = False  # this revoke's escalation was applied
    regroup_at: float = math.inf  # parked members go on to their next safe point then
    regroups: int = 0

    def settle(self) -> None:
        """Every member has yielded: the revoke is over."""
        self.revoked, self.reason, self.escalated = False, "", False
        self.regroup_at = math.inf


class Peers(Protocol):
    """The node's view across its GPUs that an arbiter asks about its gangs with ranks
    on several GPUs (core/coordinator.py)."""

    def spread(self, key: str) -> bool: ...  # ranks on several GPUs, all exclusive
    def active(self, key: str) -> bool: ...  # it holds (or its quantum waits) on a GPU
    def holding(self, key: str) -> bool: ...  # a rank of it holds on a GPU
    def revoked(self, key: str) -> bool: ...  # it is yielding on a GPU
    def others_wait(self, key: str) -> bool: ...  # another job waits on a GPU of it
    def may_start(self, key: str) -> bool: ...  # it starts now, on all its GPUs
    def claimed(self, gpu: int) -> bool: ...  # the GPU is kept for such a gang


def across_gpus(key: str, gpu: int, mode: Mode, elsewhere: Mapping[int, Mode]) -> str:
    """Why a rank of ``key`` may not attach to ``gpu`` (in ``mode``) when the job has
    ranks on the node's other GPUs (``elsewhere``: their index and mode), or ''.

    A gang on several GPUs is granted on all of them at once where they are all in mode
    exclusive (core/coordinator.py); in mode auto its ranks share each GPU while their
    memory fits. Across modes neither holds: an exclusive GPU's part could wait for
    another GPU's, held by another job (issue 14)."""
    modes = {gpu: mode, **elsewhere}
    if len(set(modes.values())) < 2:
        return ""
    gpus = ", ".join(f"{i} ({m})" for i, m in sorted(modes.items()))
    return (
        f"job {key} has ranks on GPUs {gpus} of this node: its ranks are granted together"
        " only on GPUs all in mode exclusive (or share them in mode auto): set one mode on"
        " its GPUs, or put its ranks on one GPU"
    )


class Gangs(Mapping[str, Gang]):
    """One GPU's gangs, by the node's key, and the rules that make each one holder."""

    def __init__(self, st: GpuState) -> None:
        self.st = st
        self._gangs: dict[str, Gang] = {}
        self.revoked: set[str] = set()  # keys of the gangs yielding
        # The node's other GPUs, for gangs with ranks on several (core/coordinator.py).
        self.peers: Peers | None = None

    def __getitem__(self, key: str) -> Gang:
        return self._gangs[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._gangs)

    def __len__(self) -> int:
        return len(self._gangs)

    # --- members come and go ------------------------------------------------------

    def check(self, key: str, limit: int, spans_nodes: bool) -> None:
        """A member the gang can hold the GPU with, or :class:`ArbiterError` (no gang:
        nothing to check)."""
        if not key:
            return
        st = self.st
        if spans_nodes and st.settings.mode == "exclusive":
            raise ArbiterError(
                f"job {key} has ranks on other nodes, and one node cannot grant them"
                f" together: in mode exclusive its ranks would wait for each other; give it"
                f" GPUs of its own, or set mode auto on GPU {st.gpu}"
                f" (gpushare ctl mode auto --gpu {st.gpu})"
            )
        g = self._gangs.get(key)
        members = g.members if g else set()
        together = limit + sum(st.sessions[m].memory.limit for m in members)
        if together > st.capacity:
            raise ArbiterError(
                f"the ranks of job {key} on GPU {st.gpu} would need {together} bytes"
                f" together, more than its usable {st.capacity} bytes: they are granted"
                " together, so give each less (attach(memory=...), --memory or GPUSHARE_MEMORY)"
            )

    def join(self, s: SessionState, key: str, size: int, spans_nodes: bool) -> None:
        g = self._gangs.get(key)
        if g is None:
            g = self._gangs[key] = Gang(key)
        g.members.add(s.id)
        g.size, g.spans_nodes = max(g.size, size), g.spans_nodes or spans_nodes
        s.rank.gang = key

    def leave(self, s: SessionState) -> None:
        key = s.rank.gang
        g = self._gangs[key]
        g.members.discard(s.id)
        if not g.members:
            del self._gangs[key]
            self.revoked.discard(key)

    def park(self, s: SessionState, now: float) -> None:
        """Its gang is yielding: ``s`` waits as a parked member does (until the gang has
        yielded, or the regroup)."""
        g = self._gangs[s.rank.gang]
        s.rank.parked = True
        g.regroup_at = min(g.regroup_at, now + REGROUP_S)

    # --- what the gang's state says ------------------------------------------------

    def of(self, s: SessionState) -> Gang | None:
        return self._gangs.get(s.rank.gang) if s.rank.gang else None

    def here(self, key: str) -> bool:
        """The GPU is the gang's: a member holds, or its quantum waits for it."""
        g = self._gangs.get(key)
        ss = self.st.sessions
        return g is not None and any(ss[m].holding or ss[m].share.window for m in g.members)

    def spread(self, g: Gang) -> bool:
        """The gang has ranks on other GPUs of the node too, granted with these."""
        return self.peers is not None and self.peers.spread(g.key)

    def active(self, g: Gang) -> bool:
        """The gang holds this GPU (or, with ranks on several, one of them)."""
        if self.here(g.key):
            return True
        return self.spread(g) and self.peers is not None and self.peers.active(g.key)

    def yielding(self, g: Gang) -> bool:
        if g.revoked:
            return True
        return self.spread(g) and self.peers is not None and self.peers.revoked(g.key)

    def may_start(self, g: Gang) -> bool:
        """A gang on several GPUs starts on all at once: when it is the next to and none
        of its GPUs is held by another job (each was kept for it meanwhile)."""
        if self.peers is None or not self.spread(g):
            return False
        return self.peers.may_start(g.key)

    def claimed(self) -> bool:
        """The GPU is kept for a gang on several GPUs: its ranks only."""
        return self.peers is not None and self.peers.claimed(self.st.gpu)

    def head(self) -> SessionState | None:
        """The queue's head for a grant on its own: not a rank of a gang on several GPUs
        (the gang starts on all of them at once, in :meth:`grant_joining`)."""
        ss = self.st.sessions
        if self.peers is None:
            return ss[self.st.queue[0]]
        for sid in self.st.queue:
            s = ss[sid]
            if not (s.rank.gang and self.spread(self._gangs[s.rank.gang])):
                return s
        return None

    def others_wait(self, s: SessionState) -> bool:
        """Someone not of ``s``'s job waits for the GPU (or, a gang with ranks on several
        GPUs, for one of them; or a gang on several GPUs waits to start here)."""
        if self.peers is not None:
            g = self.of(s)
            if g is not None and self.spread(g):
                return self.peers.others_wait(g.key)
            if self.peers.claimed(self.st.gpu):
                return True
        if not s.rank.gang:
            return bool(self.st.queue)
        return any(self.st.sessions[q].rank.gang != s.rank.gang for q in self.st.queue)

    def limits(self, key: str) -> int:
        """The gang's ranks' limits together: they may all ask at any time."""
        return sum(self.st.sessions[m].memory.limit for m in self._gangs[key].members)

    def peers_to_count(self, s: SessionState) -> int:
        """Bytes the count grows by beyond ``s``'s own limit when ``s``'s grant makes its
        gang hold (its peers counted at their limits: they may join at any time)."""
        if not s.rank.gang or s.rank.held:
            return 0
        ss = self.st.sessions
        peers = (ss[m] for m in self._gangs[s.rank.gang].members if m != s.id)
        return sum(max(0, p.memory.limit - p.used) for p in peers)

    def views(self, s: SessionState, peers: int) -> list[MemoryView]:
        """Every session as the planner sees it; where ``s``'s grant makes its gang hold
        (``peers``, its :meth:`peers_to_count`, is not 0), as that grant would make it:
        its peers at their limits, not victims."""
        now, mode = self.st.now(), self.st.settings.mode
        ss = self.st.sessions.values()
        if not peers:
            return [view(v, now, mode) for v in ss]
        members = self._gangs[s.rank.gang].members - {s.id}
        return [at_limit(v) if v.id in members else view(v, now, mode) for v in ss]

    # --- the gang as one holder ----------------------------------------------------

    def hold(self, g: Gang, held: bool) -> None:
        """While the gang holds the GPU its ranks count at their limits (they may ask at
        any time) and are never asked to swap out."""
        for m in map(self.st.sessions.__getitem__, g.members):
            if m.rank.held != held:
                m.rank.held = held
                self.st.ledger.recount(m)

    def hold_all(self) -> None:
        for g in self._gangs.values():  # (held on another GPU: counted when granted here)
            self.hold(g, self.here(g.key))

    def quantum_left(self, g: Gang, s: SessionState, now: float) -> float | None:
        """The gang's quantum is its first holder's: what is left of it for ``s``."""
        ends = [
            m.lease.quantum_end
            for m in map(self.st.sessions.__getitem__, g.members)
            if m is not s and (m.holding or m.share.window) and not math.isinf(m.lease.quantum_end)
        ]
        return max(0.0, min(ends) - now) if ends else None

    def revoke(self, g: Gang, now: float, reason: str) -> None:
        """Every holding member is revoked, with the gang's one deadline. Members keep
        their memory until all have yielded (a parked one may be granted again); the
        next holder's plan asks for it then."""
        st = self.st
        if not g.revoked:
            g.revoked, g.reason, g.escalated = True, reason, False
            g.deadline = now + st.settings.grace_s
            self.revoked.add(g.key)
        for m in map(st.sessions.__getitem__, sorted(g.members)):
            if m.state is not State.HOLDING:
                continue
            if reason == "turn":
                m.share.resume_s = max(0.0, m.lease.quantum_end - now)
            m.state = State.YIELDING
            m.lease.revoke_deadline = g.deadline
            # Escalated once per revoke, not per regroup (nor at one at the deadline).
            m.esc.escalated = g.escalated or now >= g.deadline
            m.lease.revoked_at = now
            m.totals.revokes += 1
            lease = m.lease.number
            st.out.emit(
                Revoke(session=m.id, lease=lease, reason=reason, swap_out_bytes=0, gang=g.key)
            )
            st.out.act(RevokeAction(m.id, lease, 0, max(0.0, g.deadline - now)))

    def settle(self) -> None:
        """A revoked gang none of whose members holds has yielded: its parked members
        are plain waiting sessions again, in the queue where they joined it."""
        ss = self.st.sessions
        for key in list(self.revoked):
            g = self._gangs[key]
            if any(ss[m].holding for m in g.members):
                continue
            if self.spread(g) and self.peers is not None and self.peers.holding(key):
                continue  # its ranks on another GPU have not all yielded yet
            self.revoked.discard(key)
            g.settle()
            for m in g.members:
                ss[m].rank.parked = False

    def grant_joining(self, now: float, grant: Callable[[SessionState], None]) -> None:
        """Members asking while their gang holds the GPU join it at once (``grant``), when
        their memory fits (else the planner makes room, as for any grant). A parked
        member waits for its peers to yield, until the regroup: then it goes on to its
        next safe point (a peer may be blocked in a collective, waiting for it)."""
        for g in list(self._gangs.values()):
            if not self.active(g) and not self.may_start(g):
                continue
            if not g.revoked and self.here(g.key) and self.yielding(g):
                self.revoke(g, now, "quantum")  # revoked on its other GPUs
            regroup = g.revoked and now >= g.regroup_at
            before = g.regroups
            self._join(g, regroup, grant)
            if regroup:  # until a member parks again (or, none went on, a while)
                g.regroup_at = math.inf if g.regroups > before else now + REGROUP_S

    def _join(self, g: Gang, regroup: bool, grant: Callable[[SessionState], None]) -> None:
        """``g``'s waiting members granted, in rank order, as far as memory allows."""
        st = self.st
        for m in map(st.sessions.__getitem__, sorted(g.members)):
            if m.state is not State.WAITING or m.esc.frozen or (m.rank.parked and not regroup):
                continue
            if not self.active(g) and not self.may_start(g):
                break
            peers = self.peers_to_count(m)
            if st.used_bytes() - m.used + peers + m.memory.limit > st.capacity:
                plan = plan_grant(st.capacity, self.views(m, peers), m.id)
                if not plan.fits:
                    for sid, n in plan.swap_outs:
                        st.ask_swap_out(sid, n)
                    continue
            if m.rank.parked:
                g.regroups += 1
            grant(m)

    def deadlines(self) -> list[float]:
        """Parked members go on to their next safe point at their gang's regroup."""
        times = []
        for key in self.revoked:
            if not math.isinf(self._gangs[key].regroup_at):
                times.append(self._gangs[key].regroup_at)
        return times

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

Pure bookkeeping here; the rules that use it are the arbiter's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

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

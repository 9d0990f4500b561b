"""A GPU's settings: the values they may take and their one validation.

Shared vocabulary: the wire (``SetConfig``), the node's config file, the command line
and the arbiter all name modes, policies and escalations with these literals, and every
setting is checked by :func:`validate` whichever way it arrives (DESIGN.md rule 6), so a
value is refused with the same one-line message everywhere. Pure: no I/O, no msgspec
(the core imports it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, TypedDict, TypeVar

Mode = Literal["auto", "exclusive"]
Policy = Literal["equal", "weighted"]
Escalation = Literal["log", "freeze", "kill"]
MODES: tuple[Mode, ...] = ("auto", "exclusive")
POLICIES: tuple[Policy, ...] = ("equal", "weighted")
ESCALATIONS: tuple[Escalation, ...] = ("log", "freeze", "kill")
C = TypeVar("C", bound=str)


class SettingsError(ValueError):
    """A setting out of its range; the message names the values allowed."""


@dataclass
class GpuSettings:
    tq_s: float = 30.0
    mode: Mode = "auto"
    policy: Policy = "equal"
    grace_s: float = 5.0
    escalation: Escalation = "log"
    overlap: bool = True  # the next holder swaps in while the last one swaps out
    # docs/scheduling.md: how long a quantum waits for its holder to ask again (the
    # node's idle_release), the longest interactive turn (0: none), the turn credit
    # earned per idle second, and whether the next holder swaps in ahead of its grant.
    anticipate_s: float = 0.5
    turn_s: float = 1.0
    turn_share: float = 0.25
    prefetch: bool = True


class Change(TypedDict, total=False):
    """What a live change sets (only the keys given), every value checked."""

    tq_s: float
    mode: Mode
    policy: Policy
    escalation: Escalation


def seconds(what: str, value: object) -> float:
    """A positive, finite number of seconds."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SettingsError(f"{what} must be a positive number of seconds")
    if not (value > 0 and math.isfinite(value)):
        raise SettingsError(f"{what} must be a positive number of seconds")
    return float(value)


def _choice(what: str, value: object, allowed: tuple[C, ...]) -> C:
    for choice in allowed:
        if value == choice:
            return choice
    raise SettingsError(f"{what} must be one of {', '.join(allowed)}")


def validate(
    *,
    tq_s: object = None,
    mode: object = None,
    policy: object = None,
    escalation: object = None,
) -> Change:
    """Every value given (``None``: not given) checked, before anything is changed: the
    first bad one raises :class:`SettingsError` and nothing is returned to apply."""
    out = Change()
    if tq_s is not None:
        out["tq_s"] = seconds("TQ", tq_s)
    if mode is not None:
        out["mode"] = _choice("mode", mode, MODES)
    if policy is not None:
        out["policy"] = _choice("policy", policy, POLICIES)
    if escalation is not None:
        out["escalation"] = _choice("escalation", escalation, ESCALATIONS)
    return out

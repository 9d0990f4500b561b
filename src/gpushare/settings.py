"""The node's settings: the values they may take and their one validation.

Shared vocabulary: the wire (``SetConfig``), the node's config file, the command line
and the arbiter all name modes, policies and escalations with these literals, and every
setting is checked here whichever way it arrives (DESIGN.md rule 6): a GPU's live
settings by :func:`validate`, every numeric key of the config file (and its flag) by
:func:`check` against its documented range in :data:`RANGES`. So a value is refused with
the same one-line message everywhere. Pure: no I/O, no msgspec (the core imports it).
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
# KAI's gpu-compute-sharing-mode of a pod, as the mode its session is in: time-slicing
# takes exclusive quanta, sm-sharing holds beside others when memory fits.
SHARING_MODES: dict[str, Mode] = {"time-slicing": "exclusive", "sm-sharing": "auto"}
# `gpushare run --sim-resident`: how a CPU-run program's memory on a simulated GPU is
# modelled in its session (client/modelled.py), as its hello says it ("none": not said).
RESIDENT_MODELS = ("weights", "declared")
C = TypeVar("C", bound=str)
# `ctl end`: how long a session ended keeps its turns to finish what is in flight (its
# program told at once: SIGTERM under `gpushare run`), and the most an administrator gives.
END_GRACE_S = 10.0
END_GRACE_MAX_S = 3600.0


def check_end_grace(grace_s: float) -> float:
    """``grace_s`` if a grace ``ctl end`` may give, else :class:`SettingsError`."""
    if not (math.isfinite(grace_s) and 0 <= grace_s <= END_GRACE_MAX_S):
        raise SettingsError(
            f"an end's grace must be 0 (at once) to {END_GRACE_MAX_S:g} seconds, not {grace_s}"
        )
    return grace_s


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
    """A live change of a GPU's settings, what every door passes (``ctl`` over the wire,
    the config file watched, the arbiter's :meth:`~gpushare.core.arbiter.Arbiter.set_config`):
    only the keys given, each a :class:`GpuSettings` field, every value checked by
    :func:`validate`."""

    tq_s: float
    mode: Mode
    policy: Policy
    escalation: Escalation
    overlap: bool
    prefetch: bool
    anticipate_s: float
    turn_s: float
    turn_share: float


# The config file's key (and ``--flag``) for each setting a live change may set: the one
# place the two names meet (the file says ``tq``, the settings, events and wire ``tq_s``).
# A key's range in RANGES, and how messages name it, are the file's.
KEYS: dict[str, str] = {
    "tq_s": "tq",
    "mode": "mode",
    "policy": "policy",
    "escalation": "escalation",
    "overlap": "overlap",
    "prefetch": "prefetch",
    "anticipate_s": "idle_release",
    "turn_s": "turn",
    "turn_share": "turn_share",
}


@dataclass(frozen=True)
class Range:
    """The values a numeric setting may take, ends included."""

    low: float
    high: float
    unit: str = ""  # "s": seconds
    integer: bool = False
    note: str = ""  # what a special value means, said in the message

    def describe(self) -> str:
        if self.unit == "s":
            return f"a number of seconds from {_num(self.low)} s to {_secs(self.high)}{self.note}"
        kind = "a whole number" if self.integer else "a number"
        unit = f" {self.unit}" if self.unit else ""
        return f"{kind} from {_num(self.low)} to {_num(self.high)}{unit}{self.note}"


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() and abs(v) < 1e7 else f"{v:g}"


def _secs(v: float) -> str:
    return f"{_num(v)} s" + (f" ({v / 86400:g} d)" if v >= 86400 else "")


TQ_MIN_S, TQ_MAX_S = 0.05, 86400.0
# Every numeric key of the node's config file (``--flag`` on the command line), with the
# range it may take: a quantum shorter than a switch's handoff only thrashes, one longer
# than a day is a typo; the rest keep the node's timers, limits and models meaningful.
RANGES: dict[str, Range] = {
    "tq": Range(TQ_MIN_S, TQ_MAX_S, "s"),
    "grace": Range(0.01, 3600.0, "s"),
    "idle_release": Range(0.01, 3600.0, "s"),
    "turn": Range(0.0, 3600.0, "s", note=" (0: no interactive turns)"),
    "turn_share": Range(0.01, 1.0, note=" (turn credit per idle second)"),
    "hello_timeout": Range(0.01, 3600.0, "s"),
    "max_sessions_per_uid": Range(1, 1_000_000, integer=True),
    "max_messages_per_s": Range(1, 1e9, "per second"),
    "max_messages_per_s_per_user": Range(1, 1e9, "per second"),
    "max_pending_per_uid": Range(1, 1_000_000, integer=True),
    "max_pending": Range(1, 1_000_000, integer=True),
    "recovery_window": Range(0.0, 3600.0, "s", note=" (0: none)"),
    "metrics_port": Range(0, 65535, integer=True, note=" (0: no exporter)"),
    "sim_gpus": Range(0, 64, integer=True, note=" (0: real GPUs)"),
    "sim_bandwidth": Range(1e6, 1e13, "bytes/s"),
    "sim_scale": Range(1, 2**20, integer=True),
    "sim_swap_failure_rate": Range(0.0, 1.0),
}
NAMES = {"tq": "TQ"}  # how messages name a key, where not by the key itself


def check(key: str, value: object) -> float:
    """``value`` for the setting ``key``, checked against :data:`RANGES`; or
    :class:`SettingsError` naming the range (one line, the same whichever way it came).
    A whole-number setting given as ``3.0`` is 3."""
    r = RANGES[key]
    what = NAMES.get(key, key)
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise SettingsError(f"{what} must be {r.describe()}, not {value!r}")
    v: float = value
    if r.integer and isinstance(v, float) and v.is_integer():
        v = int(v)
    if r.unit == "s" and r.low > 0 and not v > 0:
        raise SettingsError(f"{what} must be positive: {r.describe()}, not {v:g}")
    if not (r.low <= v <= r.high) or (r.integer and not isinstance(v, int)):
        raise SettingsError(f"{what} must be {r.describe()}, not {v:g}")
    return v


def seconds(what: str, value: object) -> float:
    """A number of seconds for the setting ``what`` (a key of :data:`RANGES`)."""
    return float(check(what, value))


def _choice(what: str, value: object, allowed: tuple[C, ...]) -> C:
    for choice in allowed:
        if value == choice:
            return choice
    raise SettingsError(f"{what} must be one of {', '.join(allowed)}")


def _switch(what: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    raise SettingsError(f"{what} must be true or false, not {value!r}")


def validate(
    *,
    tq_s: object = None,
    mode: object = None,
    policy: object = None,
    escalation: object = None,
    overlap: object = None,
    prefetch: object = None,
    anticipate_s: object = None,
    turn_s: object = None,
    turn_share: object = None,
) -> Change:
    """Every value given (``None``: not given) checked, before anything is changed: the
    first bad one raises :class:`SettingsError` (naming the config file's key) and
    nothing is returned to apply."""
    out = Change()
    if tq_s is not None:
        out["tq_s"] = seconds(KEYS["tq_s"], tq_s)
    if mode is not None:
        out["mode"] = _choice("mode", mode, MODES)
    if policy is not None:
        out["policy"] = _choice("policy", policy, POLICIES)
    if escalation is not None:
        out["escalation"] = _choice("escalation", escalation, ESCALATIONS)
    if overlap is not None:
        out["overlap"] = _switch("overlap", overlap)
    if prefetch is not None:
        out["prefetch"] = _switch("prefetch", prefetch)
    if anticipate_s is not None:
        out["anticipate_s"] = seconds(KEYS["anticipate_s"], anticipate_s)
    if turn_s is not None:
        out["turn_s"] = seconds(KEYS["turn_s"], turn_s)
    if turn_share is not None:
        out["turn_share"] = float(check(KEYS["turn_share"], turn_share))
    return out

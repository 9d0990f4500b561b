"""Units as users write them: sizes (``80GiB``, ``512MiB``, bytes) and durations (``5m``)."""

from __future__ import annotations

import math
import re
from decimal import ROUND_CEILING, Decimal, InvalidOperation

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
# A number as people and programs write it: 80, 1.5, 1e9 (the same as 1000000000).
_NUMBER = r"[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?|\.[0-9]+(?:[eE][+-]?[0-9]+)?"
_SIZE = re.compile(rf"^\s*(-?(?:{_NUMBER}))\s*([a-zA-Z]*)\s*$")
# The largest size read: more than any GPU or host has, and within what the wire carries
# (an unsigned 64-bit integer), so that ``1e30`` is a usage error, not an overflow later.
MAX_SIZE = 2**50  # 1024 TiB
# A session's weight (its share under policy weighted) lies in these bounds: finite, and
# no quantum more than a million times another's. The node's (gpushare.core.checks) and
# `gpushare run`'s check, before a program runs, both read them here.
MIN_WEIGHT, MAX_WEIGHT = 1e-3, 1e3


def parse_size(text: str | int) -> int:
    """Parse ``80GiB``, ``512MiB``, ``1.5GB`` or plain bytes into bytes.

    >>> parse_size("1GiB")
    1073741824
    """
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must not be negative: {text}")
        if text > MAX_SIZE:
            raise ValueError(_too_large(str(text)))
        return text
    m = _SIZE.match(text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise ValueError(
            f"cannot read size {text!r}: write it like 80GiB, 512MiB, 1.5GB or a number of bytes"
        )
    if m.group(1).startswith("-"):
        raise ValueError(f"size must not be negative: {text.strip()}")
    value = float(m.group(1)) * _UNITS[unit]
    if not math.isfinite(value) or value > MAX_SIZE:
        raise ValueError(_too_large(text.strip()))
    return int(value)


# Kubernetes quantity suffixes a memory size is written with (k8s.io/apimachinery).
_QUANTITY = re.compile(
    r"^\+?((?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)([KMGTPE]i|[kMGTPE]?)$"
)
_QUANTITY_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15}
_QUANTITY_UNITS |= {"E": 10**18, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
_QUANTITY_UNITS |= {"Pi": 2**50, "Ei": 2**60}


def parse_quantity(value: str, source: str, *, unit_required: bool = False) -> int:
    """A Kubernetes memory quantity (``8Gi``, ``7680Mi``, ``8G``, bytes) in bytes,
    rounded up as Kubernetes rounds a quantity's value (a workload's annotations, and
    the node reading the same pod's through the API)."""
    m = _QUANTITY.match(value.strip())
    if m is None or (unit_required and not m.group(2)):
        unit = "with its unit, " if unit_required else ""
        raise ValueError(
            f"{source}={value!r} is not a Kubernetes memory quantity: write it {unit}like"
            " 8Gi or 7680Mi"
        )
    try:
        exact = Decimal(m.group(1)) * _QUANTITY_UNITS[m.group(2)]
    except InvalidOperation:  # pragma: no cover - the pattern admits only numbers
        exact = Decimal(-1)
    if not 0 < exact <= MAX_SIZE:
        raise ValueError(
            f"{source}={value!r} is not a size from 1 byte to 1024 TiB: write it like 8Gi"
        )
    return int(exact.to_integral_value(rounding=ROUND_CEILING))


def _too_large(text: str) -> str:
    return (
        f"size {text} is more than any GPU has (the most gpushare reads is 1024 TiB):"
        " write it like 80GiB"
    )


def parse_weight(text: str | float) -> float:
    """A session's weight (policy ``weighted``): a number in [MIN_WEIGHT, MAX_WEIGHT].

    >>> parse_weight("0.5")
    0.5
    """
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not MIN_WEIGHT <= value <= MAX_WEIGHT:  # NaN fails too
        raise ValueError(
            f"weight {str(text).strip()!r} is not a number from {MIN_WEIGHT:g} to"
            f" {MAX_WEIGHT:g}: a weight is a share, like 1 (the default), 0.5 or 2"
        )
    return value


def is_fraction(x: object, low: float = 0.0) -> bool:
    """A number in (``low``, 1] (``low`` itself allowed when above 0): a GPU fraction, a
    portion, a compute limit. Not a bool, not NaN."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return False
    return (low < x <= 1) if low == 0 else (low <= x <= 1)


def format_size(n: float) -> str:
    """Format bytes for people, binary units: ``format_size(3 * 2**30) == '3.0 GiB'``."""
    v = float(n)
    if abs(v) < 1024:
        return f"{v:.0f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        v /= 1024
        if abs(v) < 1024 or unit == "TiB":
            break
    return f"{v:.1f} {unit}"


_DURATION = re.compile(rf"^\s*([-+]?(?:{_NUMBER}))\s*(ms|s|m|h|d)?\s*$")
_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> float:
    """Seconds from ``90``, ``90s``, ``5m``, ``2h``, ``1d``, ``250ms``, ``1e3``. A sign is
    read (``-5`` is -5.0), so that whoever checks the range can say what is wrong."""
    m = _DURATION.match(text)
    if m is None:
        raise ValueError(f"cannot read duration {text!r}: write it like 30s, 5m, 2h or 1d")
    return float(m.group(1)) * _SECONDS[m.group(2) or "s"]

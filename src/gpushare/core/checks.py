"""The checks of the figures a client sends: each is bounded by what the node knows.

A check raises before anything changes, so a refused input leaves the arbiter as it was
(docs/faults.md). The bounds here need nothing but the figure; those that need the GPU's
state (what fits beside the others) are the ledger's (core/ledger.py).
"""

from __future__ import annotations

from gpushare.units import MAX_WEIGHT, MIN_WEIGHT  # a weight's bounds: one definition

MAX_SECONDS = 1e6  # a swap reported longer than this (11 days) is not a measurement
MAX_ERROR = 1024  # characters of a failed swap's error text
MAX_COUNT = 2**63 - 1  # a lease or prefetch number, a figure with no other bound


class ArbiterError(ValueError):
    """An input that is not valid in the session's current state. Raised before anything
    changes: a refused input leaves the arbiter as it was."""

    code = "state"


class FieldError(ArbiterError):
    """A figure the node knows to be wrong (negative, beyond the session's limit or the
    GPU, not finite); the message names the field."""

    code = "value"


def count(what: str, value: object, most: int) -> int:
    """A whole number of bytes in [0, most], or :class:`FieldError` naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= most:
        raise FieldError(f"{what} must be a whole number of bytes in [0, {most}], not {value!r}")
    return value


def seconds(what: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise FieldError(f"{what} must be a number of seconds, not {value!r}")
    if not 0 <= value <= MAX_SECONDS:  # NaN fails too
        raise FieldError(f"{what} must be a number of seconds in [0, {MAX_SECONDS:g}], not {value}")
    return float(value)


def check_weight(weight: object) -> float:
    """A weight within [MIN_WEIGHT, MAX_WEIGHT], or :class:`FieldError`."""
    if isinstance(weight, bool) or not isinstance(weight, int | float):
        raise FieldError(f"weight must be a number, not {weight!r}")
    if not MIN_WEIGHT <= weight <= MAX_WEIGHT:  # NaN fails too
        raise FieldError(
            f"weight must be a number in [{MIN_WEIGHT:g}, {MAX_WEIGHT:g}], not {weight}"
        )
    return float(weight)


def check_error(error: str) -> str:
    if len(error) > MAX_ERROR:
        raise FieldError(f"swap_done: error is {len(error)} characters, the most is {MAX_ERROR}")
    return error


def check_split(what: str, resident: int, swapped: int, limit: int) -> None:
    """``resident`` and ``swapped`` bytes, each and together within ``limit``."""
    count(f"{what}: resident", resident, limit)
    count(f"{what}: swapped", swapped, limit)
    if resident + swapped > limit:
        raise FieldError(
            f"{what}: resident + swapped ({resident} + {swapped} bytes) exceed the"
            f" session's memory limit of {limit} bytes"
        )

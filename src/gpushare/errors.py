"""Exceptions a workload may see. Each message says what to do about it."""

from __future__ import annotations


class GpushareError(Exception):
    """Base of every gpushare error."""


class DaemonUnavailableError(GpushareError):
    """The node daemon cannot be reached or went away."""


class OutOfMemoryError(GpushareError, MemoryError):
    """An allocation would take the session past its memory limit."""


class SwapError(GpushareError):
    """A swap failed; the session kept what it had."""


class SwapIntegrityError(SwapError):
    """Bytes that came back from host memory differ from those that went out."""

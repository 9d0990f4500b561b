"""Exceptions a workload may see. Each message says what to do about it."""

from __future__ import annotations


class GpushareError(Exception):
    """Base of every gpushare error."""


class DaemonUnavailableError(GpushareError):
    """The node daemon cannot be reached or went away."""


class AttachRefusedError(GpushareError):
    """The node answered an attach (or a re-attach after it restarted) with a refusal.

    ``code`` is the node's reason in one word (``attach``: a memory limit beyond the
    GPU, ``gpu``: no such GPU, ``limit``: too many sessions for this user, ``version``: a
    client and node of different protocol versions, ...); the message names the fix.
    """

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class OutOfMemoryError(GpushareError, MemoryError):
    """An allocation would take the session past its memory limit."""


class SwapError(GpushareError):
    """A swap failed; the session kept what it had."""


class SwapIntegrityError(SwapError):
    """Bytes that came back from host memory differ from those that went out."""

"""gpushare: several workloads share one GPU safely and fairly.

>>> import gpushare
>>> s = gpushare.attach(memory="20GiB")        # doctest: +SKIP
>>> with s.gpu():                               # doctest: +SKIP
...     s.checkpoint()
"""

from gpushare._version import __version__
from gpushare.client.session import Session, attach, discardable
from gpushare.errors import (
    AttachRefusedError,
    DaemonUnavailableError,
    GpushareError,
    OutOfMemoryError,
    SwapError,
    SwapIntegrityError,
)
from gpushare.units import format_size, parse_size

__all__ = [
    "AttachRefusedError",
    "DaemonUnavailableError",
    "GpushareError",
    "OutOfMemoryError",
    "Session",
    "SwapError",
    "SwapIntegrityError",
    "__version__",
    "attach",
    "discardable",
    "format_size",
    "parse_size",
]

"""gpushare: several workloads share one GPU safely and fairly.

>>> import gpushare
>>> s = gpushare.attach(memory="20GiB")        # doctest: +SKIP
>>> with s.gpu():                               # doctest: +SKIP
...     s.checkpoint()
"""

from gpushare.client import Session, attach
from gpushare.errors import (
    DaemonUnavailableError,
    GpushareError,
    OutOfMemoryError,
    SwapError,
    SwapIntegrityError,
)
from gpushare.units import format_size, parse_size

__version__ = "0.1.0"
__all__ = [
    "DaemonUnavailableError",
    "GpushareError",
    "OutOfMemoryError",
    "Session",
    "SwapError",
    "SwapIntegrityError",
    "__version__",
    "attach",
    "format_size",
    "parse_size",
]

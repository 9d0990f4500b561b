"""``gpushare run [--memory SIZE] [--weight W] -- COMMAND ...``: an unmodified PyTorch
program as a session.

The command runs with this package's ``_autoattach`` folder first on ``PYTHONPATH``:
its ``sitecustomize`` attaches the Python process at start (memory from ``--memory``,
else ``GPUSHARE_MEMORY``, else KAI's ``GPU_PORTION`` of the GPU), installs the global
hooks of :mod:`gpushare.client.hooks`, enforces the memory limit where CUDA is there, and
closes the session at exit. Any ``sitecustomize`` it shadows is run after it.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from gpushare.units import parse_size

if TYPE_CHECKING:
    from gpushare.client.session import Session

log = logging.getLogger("gpushare.run")
ENV_FLAG = "GPUSHARE_AUTOATTACH"
SESSION: Session | None = None  # this process's session, once attached


def child_env(
    environ: dict[str, str],
    memory: str | None,
    weight: float | None,
    name: str | None,
    socket: str | None,
    gpu: int | None,
) -> dict[str, str]:
    """The command's environment: what the sitecustomize in it needs."""
    env = dict(environ)
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_autoattach")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH", "")) if p)
    env[ENV_FLAG] = "1"
    if memory is not None:
        env["GPUSHARE_MEMORY"] = str(parse_size(memory))
    for key, value in (
        ("GPUSHARE_WEIGHT", weight),
        ("GPUSHARE_NAME", name),
        ("GPUSHARE_SOCKET", socket),
        ("GPUSHARE_GPU", gpu),
    ):
        if value is not None:
            env[key] = str(value)
    return env


def run(
    command: Sequence[str],
    memory: str | None = None,
    weight: float | None = None,
    name: str | None = None,
    socket: str | None = None,
    gpu: int | None = None,
) -> int:
    if not command:
        print(
            "gpushare run: error: no command: gpushare run [--memory SIZE] -- python train.py",
            file=sys.stderr,
        )
        return 2
    exe = shutil.which(command[0])
    if exe is None:
        print(f"gpushare run: error: command not found: {command[0]}", file=sys.stderr)
        return 127
    env = child_env(dict(os.environ), memory, weight, name, socket, gpu)
    os.execve(exe, list(command), env)
    return 0  # not reached


def child_start() -> None:
    """In the command's Python: attach, hook, limit. Called by the sitecustomize."""
    # Consumed here: Python processes this one starts (spawned DataLoader workers,
    # tools) are not the session.
    os.environ.pop(ENV_FLAG, None)
    from gpushare.client.session import attach
    from gpushare.errors import GpushareError

    weight = os.environ.get("GPUSHARE_WEIGHT")
    gpu = os.environ.get("GPUSHARE_GPU")
    try:
        session = attach(
            name=os.environ.get("GPUSHARE_NAME") or None,
            weight=float(weight) if weight else None,
            gpu=int(gpu) if gpu else None,
        )
    except (GpushareError, ValueError) as e:
        # At start-up, before the program: end here (SystemExit is fatal in sitecustomize)
        print(f"gpushare run: error: {e}", file=sys.stderr, flush=True)
        os._exit(3)
    atexit.register(session.close)
    try:
        from gpushare.client import hooks

        hooks.install(session)
        if session.backend.name != "torch":  # the torch backend sets its own limit
            hooks.limit_cuda_memory(session)
    except ImportError:
        log.warning("gpushare run: PyTorch is not installed: nothing is gated")
    global SESSION
    SESSION = session

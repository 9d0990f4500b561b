"""Distributed launchers under ``gpushare run``, and the job identity of their workers.

``gpushare run -- torchrun --nproc-per-node 2 train.py`` (also ``accelerate launch``,
``deepspeed``, ``python -m torch.distributed.run``): the launcher's own Python does no
GPU work and takes no lease; each worker it starts is a session of its own. The ranks
of one job must then be granted together, or they wait for each other in their
collectives while holding or wanting the GPU: each rank's hello carries its job (a
*gang*), its size on this node and its rank, from what the launcher put in its
environment, so that the node can grant the gang as one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

# Console scripts and modules that start workers and do no GPU work themselves.
LAUNCHER_SCRIPTS = frozenset({"torchrun", "accelerate", "deepspeed", "ds"})
LAUNCHER_MODULES = frozenset(
    {
        "torch.distributed.run",
        "torch.distributed.launch",
        "accelerate.commands.launch",
        "accelerate.commands.accelerate_cli",
        "deepspeed.launcher.runner",
        "deepspeed.launcher.launch",
    }
)
_OPTS_WITH_VALUE = frozenset({"-W", "-X", "-Q"})


def launcher(argv: Sequence[str]) -> str:
    """The launcher a Python command line (``sys.orig_argv``) runs, or ''."""
    args = list(argv[1:])
    i = 0
    while i < len(args):
        a = args[i]
        if a == "-m" or (a.startswith("-m") and not a.startswith("--")):
            module = a[2:] or (args[i + 1] if i + 1 < len(args) else "")
            return module if module in LAUNCHER_MODULES else ""
        if a == "-c" or a == "-" or (a.startswith("-c") and not a.startswith("--")):
            return ""
        if a in _OPTS_WITH_VALUE:
            i += 2
            continue
        if a.startswith("-"):
            i += 1
            continue
        script = os.path.basename(a)
        return script if script in LAUNCHER_SCRIPTS else ""
    return ""


def _int(env: Mapping[str, str], key: str) -> int | None:
    value = env.get(key, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{key}={value!r} is not a whole number: fix or unset it") from None


def gang_fields(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The job identity for :class:`gpushare.protocol.Hello`: ``gang`` (a job id: an
    explicit ``GPUSHARE_GANG``, else torchelastic's run id, else the rendezvous
    ``MASTER_ADDR:MASTER_PORT`` of a distributed job), ``gang_size`` (ranks of the job on
    this node: ``GPUSHARE_GANG_SIZE``, else ``LOCAL_WORLD_SIZE``, else ``WORLD_SIZE``) and
    ``rank`` (this one's among them), and ``world_size`` (ranks of the job on all nodes,
    ``WORLD_SIZE``; 0: not known): more than ``gang_size`` says the job spans nodes. A
    process of no job: ``gang`` empty."""
    e = os.environ if environ is None else environ
    gang = e.get("GPUSHARE_GANG", "").strip()
    run_id = e.get("TORCHELASTIC_RUN_ID", "").strip()
    distributed = "WORLD_SIZE" in e or "LOCAL_WORLD_SIZE" in e
    if not gang and run_id and run_id != "none":  # 'none': torchrun's default, not unique
        gang = f"torchelastic:{run_id}"
    if not gang and distributed and e.get("MASTER_ADDR") and e.get("MASTER_PORT"):
        gang = f"master:{e['MASTER_ADDR']}:{e['MASTER_PORT']}"
    if not gang:
        return {"gang": "", "gang_size": 0, "rank": -1, "world_size": 0}
    local = _int(e, "LOCAL_WORLD_SIZE")
    if local is None:
        local = _int(e, "LOCAL_SIZE")  # deepspeed's launcher
    size = _int(e, "GPUSHARE_GANG_SIZE")
    rank = _int(e, "GPUSHARE_RANK")
    world = _int(e, "WORLD_SIZE")
    if size is None:
        size = local if local is not None else world
    if rank is None:
        rank = _int(e, "LOCAL_RANK") if local is not None else _int(e, "RANK")
    return {
        "gang": gang,
        "gang_size": size or 0,
        "rank": -1 if rank is None else rank,
        "world_size": world or 0,
    }

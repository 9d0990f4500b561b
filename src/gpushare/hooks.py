"""Gating an unmodified PyTorch program on the lease, at PyTorch's global hooks.

What is gated: every ``nn.Module`` forward call (a global forward pre-hook, so nested
modules too) and every ``Optimizer.step`` (a global step pre-hook). Each is a safe
point: :meth:`Session.checkpoint` there opens a burst if none is open (waiting for the
lease), and yields if the lease was revoked. The burst ends after the node's
``idle_release`` seconds without another hook call.

What is not gated: tensor operations outside any module's forward (``x @ w`` at the top
level), host-to-device copies (``.cuda()``, ``.to()``), backward passes by themselves
(they follow a forward within the idle window in a training loop), custom kernels, and
anything in processes forked from the workload (DataLoader workers). A program whose
GPU work happens there should use ``with session.gpu()`` explicitly.
"""

from __future__ import annotations

import os
from typing import Any

from gpushare.client import Session


def install(session: Session) -> list[Any]:
    """Register the global hooks; returns their handles (``.remove()`` undoes them)."""
    from torch.nn.modules.module import register_module_forward_pre_hook
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    pid = os.getpid()

    def gate(*_args: Any, **_kwargs: Any) -> None:
        if os.getpid() == pid:  # a forked child is not this session
            session.checkpoint()

    return [register_module_forward_pre_hook(gate), register_optimizer_step_pre_hook(gate)]


def limit_cuda_memory(session: Session) -> float | None:
    """Enforce the session's memory limit inside this process, where CUDA is there:
    going past it raises PyTorch's out-of-memory error in this workload only. Returns
    the fraction set, or None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    dev = torch.cuda.current_device()
    total = torch.cuda.get_device_properties(dev).total_memory
    fraction = float(min(1.0, session.memory_limit / total))
    torch.cuda.set_per_process_memory_fraction(fraction, dev)
    return fraction

"""A CPU-run PyTorch program's GPU memory on a simulated GPU, modelled (docs/simulated-gpu.md).

On a simulated GPU PyTorch runs on the CPU: a program's tensors are host memory the sim
backend never sees, so its session shows 0 B resident and a switch to or from it moves
nothing, however large its model. ``gpushare run --sim-resident MODEL`` (or
``GPUSHARE_SIM_RESIDENT``) models that memory in the sim backend, as real (scaled)
bytes the node swaps and checks like any:

* ``weights``: what PyTorch allocates for the modules it runs, their parameters and
  buffers, counted at each module's first forward (each tensor once);
* ``declared``: the session's memory request, made at its first forward;
* ``none`` (the default): nothing modelled.

The hello says which (``resident_model``), and the node's status shows it beside the
session's resident bytes. What is modelled never takes the session past its limit: the
rest is left out, said once in a warning.
"""

from __future__ import annotations

import logging
import os
import weakref
from itertools import chain
from typing import Any

from gpushare.client.swap.sim import SimBackend, SimMemory
from gpushare.errors import OutOfMemoryError
from gpushare.settings import RESIDENT_MODELS
from gpushare.units import format_size

log = logging.getLogger("gpushare")

ENV = "GPUSHARE_SIM_RESIDENT"
MODELS = ("none", *RESIDENT_MODELS)


def model_of(text: str | None) -> str:
    """The model ``text`` names ("" for none); ValueError naming the choices. Exactly
    as ``--sim-resident`` takes them (no other case)."""
    word = (text or "").strip()
    if word in ("", "none"):
        return ""
    if word not in MODELS:
        raise ValueError(f"{ENV}={text!r}: choose one of {', '.join(MODELS)}")
    return word


def asked() -> str:
    """The model this process's environment asks for (``gpushare run`` sets it)."""
    return model_of(os.environ.get(ENV))


class ModelledMemory:
    """The global forward pre hook that models a session's memory in its sim backend
    (registered after gpushare's own, so the forward holds the lease when it runs)."""

    def __init__(self, session: Any, model: str) -> None:
        assert isinstance(session.backend, SimBackend), "a simulated GPU's session only"
        self.session, self.model = session, model
        self.seen: weakref.WeakSet[Any] = weakref.WeakSet()  # modules counted
        self.counted: set[int] = set()  # tensors counted (ids: a shared weight once)
        self.held: list[SimMemory] = []
        self.full = False  # the limit was reached: nothing more is modelled

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.held)

    def __call__(self, module: Any, _args: Any) -> None:
        if self.full or module in self.seen or not self.session.holding:
            return  # (not holding: a forward outside a lease models nothing yet)
        self.seen.add(module)
        if self.model == "declared":
            want = self.session.memory_request - self.nbytes
            self.full = True  # (made once: its request)
        else:
            want = self._new_tensor_bytes(module)
        if want > 0:
            self._allocate(want)

    def _new_tensor_bytes(self, module: Any) -> int:
        n = 0
        for t in chain(module.parameters(), module.buffers()):
            if id(t) not in self.counted:
                self.counted.add(id(t))
                n += t.numel() * t.element_size()
        return n

    def _allocate(self, nbytes: int) -> None:
        backend = self.session.backend
        room = backend.limit - backend.resident_bytes - backend.swapped_bytes
        if nbytes > room:
            self.full = True
            log.warning(
                "gpushare: the modelled memory (%s) would pass the session's limit of %s:"
                " %s of it left out (attach with a larger limit to model it all)",
                format_size(self.nbytes + nbytes),
                format_size(backend.limit),
                format_size(nbytes - max(0, room)),
            )
            nbytes = room
        if nbytes <= 0:
            return
        try:
            self.held.append(backend.allocate(nbytes))
        except OutOfMemoryError as e:  # (another thread allocated meanwhile)
            self.full = True
            log.warning("gpushare: modelled memory left out: %s", e)

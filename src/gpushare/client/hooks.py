"""Gating an unmodified PyTorch program on the lease, at PyTorch's global hooks.

What is gated: every ``nn.Module`` forward call (a global forward pre-hook, so nested
modules too), every ``Optimizer.step`` (a global step pre-hook), and the tensor methods
that move data to or from the GPU when a CUDA tensor or device is involved: ``to``,
``cuda``, ``copy_``, ``item``, ``cpu``, ``tolist``, ``numpy`` (so ``Module.to("cuda")``,
``batch.cuda()`` before a forward and ``loss.item()`` after a step are gated too). Each
is a safe point: :meth:`Session.checkpoint` there opens a burst if none is open (waiting
for the lease, and for the session's memory to come back), and yields if the lease was
revoked. The burst ends after the node's ``idle_release`` seconds without another call.

A forward (from the outermost module's start to its end) and a backward pass
(``Tensor.backward``, ``torch.autograd.backward``, ``torch.autograd.grad``, which start
with a safe point) keep the burst open while they run, however long. A revoke is
also answered at a nested module's forward, except in a rank of a distributed job (a
gang: docs/scheduling.md), which yields only at its outermost safe points.

Factory functions asked for CUDA memory (``torch.zeros(n, device="cuda")``,
``torch.empty_like(cuda_tensor)``, and the others in :data:`FACTORIES`) are safe points too.

Compiled code (``torch.compile``, ``Module.compile``): while dynamo traces, every hook
and wrapper here steps aside at once (``torch.compiler.is_compiling()``, which dynamo
folds to a constant), so gpushare adds no frame, graph or graph break, and a revoke
never makes a model recompile. A compiled model is gated where it is called: the
``OptimizedModule`` of ``torch.compile`` is a module whose hooks run uncompiled, and a
module compiled in place keeps its outermost safe point around its compiled call.

What is not gated: other tensor operations outside any module's forward (``x @ w`` at
the top level), custom kernels, and DataLoader workers. The hooks a forked child inherits
step aside: a process the workload starts is gated as a member of its session once it
joins, at its first GPU work (:func:`gpushare.client.runner.join_family`). Nothing
yields inside a CUDA graph capture. A program whose GPU work happens there should use
``with session.gpu()`` explicitly: outside a lease its memory may be swapped out.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

from gpushare.client.session import Session

# Forks so far in this process's line: hooks installed before a fork are not the child's
# session's (DataLoader workers). A counter, not os.getpid() on every call: a system call
# per module call is slow in sandboxes.
_forks = 0


def _after_fork_in_child() -> None:
    global _forks
    _forks += 1


os.register_at_fork(after_in_child=_after_fork_in_child)


class _CompiledCalls(threading.local):
    n = 0  # calls of modules compiled in place under way in this thread


# Inside such a call PyTorch runs the module's hooks under dynamo's frame callback, which
# compiles every Python frame it meets: there the hooks return at once, reading only
# this (no Python call), and their own frames are marked for dynamo to skip.
_compiled_calls = _CompiledCalls()


class _Compiles(threading.local):
    n = 0  # compiles under way that started in this thread: the hooks step aside


# Read after compiling(), never while dynamo traces (compiling() is True there): dynamo
# guards on the globals it reads, and this one, 1 while it traces, 0 when the compiled
# code runs, made every call recompile (8 times, up to the cache limit).
_compiles = _Compiles()
# Compiles under way in the process, read first: where none is (nearly always), one
# global's read; a thread-local's was 110 ns more per hook call.
_compiles_open = [0]
_skip: list[types.CodeType] = []  # code dynamo must not compile as frames of their own


def _skip_in_dynamo(*fns: Callable[..., Any]) -> None:
    _skip.extend(fn.__code__ for fn in fns)
    _apply_skips()


def _apply_skips() -> None:
    if "torch._dynamo" not in sys.modules:  # applied when something is compiled
        return
    skip_code = getattr(sys.modules.get("torch._dynamo.eval_frame"), "skip_code", None)
    while _skip and skip_code is not None:
        skip_code(_skip.pop())


def install(session: Session) -> list[Any]:
    """Register the global hooks; returns their handles (``.remove()`` undoes them)."""
    import torch
    from torch.nn.modules.module import (
        register_module_forward_hook,
        register_module_forward_pre_hook,
    )
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    cuda = torch.cuda.is_available()
    forks = _forks
    compiling = _compiling()
    ours = _ours(torch, cuda, forks)
    gate = _gate(session, ours, compiling)
    forward_pre, forward_post = _forward_hooks(session, gate, forks, compiling)
    _compile_session[:] = [session]
    _skip_in_dynamo(gate, forward_pre, forward_post, _compile_start, _compile_end)
    _on_dynamo_loaded()  # where the program loaded it before attaching
    handles = [
        register_module_forward_pre_hook(forward_pre),
        register_module_forward_hook(forward_post, always_call=True),
        register_optimizer_step_pre_hook(gate),
    ]
    return [
        *handles,
        *_gate_tensor_methods(gate, compiling),
        *_gate_factories(gate, compiling),
        *_hold_through_backward(session, ours, compiling),
        _gate_compiled_in_place(forward_pre, forward_post),
        _skip_when_compiled(),
        *_say_spawned_ranks_run_ungated(),
    ]


def _ours(torch: Any, cuda: bool, forks: int) -> Callable[[], bool]:
    def ours() -> bool:
        """This process's session (not a forked child), outside any CUDA graph capture
        (no yielding, nor swapping, there)."""
        return _forks == forks and not (cuda and torch.cuda.is_current_stream_capturing())

    return ours


def _gate(
    session: Session, ours: Callable[[], bool], compiling: Callable[[], bool]
) -> Callable[..., None]:
    """The safe point of every gated call: the session's checkpoint, stepping aside in
    compiled code and in a forked child."""

    def gate(*_args: Any, **_kwargs: Any) -> None:
        if _compiled_calls.n or compiling() or (_compiles_open[0] and _compiles.n):
            return
        if ours():
            session.checkpoint()

    return gate


def _forward_hooks(
    session: Session, gate: Callable[..., None], forks: int, compiling: Callable[[], bool]
) -> tuple[Callable[..., None], Callable[..., None]]:
    """The global forward pre and post hooks. A forward may outlast idle_release (one big
    module, a compiled model): from the outermost module's start to its end the burst is
    not ended for idleness."""
    depth = threading.local()  # module forwards under way in this thread
    # Read, not called, in the nested forward: under torch.compile(model) the hooks run
    # under dynamo's frame callback, which counted a property's frame as one of its own.
    lease = session._lease

    def forward_pre(*_args: Any) -> None:
        if (
            _compiled_calls.n
            or compiling()
            or (_compiles_open[0] and _compiles.n)
            or _forks != forks
        ):
            return
        n = getattr(depth, "n", 0)
        depth.n = n + 1  # first: the post hook runs even when this one raises
        if n == 0:
            session.begin_work()
            gate()
        elif lease.revoke is not None and not session.gang:  # Session._revoked, no frame
            # nested: a safe point only to yield (the flag checkpoint reads). Not for a
            # rank of a distributed job: its gang stops at the outermost safe points
            # (forward, backward, optimizer step), so a rank let go on to a peer's
            # collective gets there in a regroup or two (core/gangs.py).
            gate()

    def forward_post(*_args: Any) -> None:
        if _compiled_calls.n or compiling() or (_compiles_open[0] and _compiles.n):
            return
        n = getattr(depth, "n", 0)
        if _forks != forks or n <= 0:  # its pre hook never ran (another one raised first)
            return
        depth.n = n - 1
        if n == 1:
            session.end_work()

    return forward_pre, forward_post


# PyTorch warns, at calls of a ``torch.compile(module)`` while global module hooks are
# there, that they fire once more for the OptimizedModule: gpushare's are made for that
# (they step aside inside compiled code), so the warning is not said (it came twice even
# under a "once" filter: dynamo resets the registry while it compiles).
GLOBAL_HOOKS_WARNING = r"Using `torch.compile\(module\)` when there are global hooks"


# The compile under way (dynamo runs its callbacks once for nested compiles, the start
# and the end maybe in two threads): the step-aside counter of the thread it started in
# (that thread's _compiles), and whether it gave the lease back.
_compile_open: list[tuple[dict[str, Any], bool]] = []
_compile_session: list[Session] = []  # the session whose lease a compile gives back
_said_compiling = [False]
_said_holding = [False]
# Dynamo's triggers that are compiling (CPU work): a frame, a backward compiled lazily.
COMPILE_TRIGGERS = ("DYNAMO", "LAZY_BACKWARD")


def _compile_start(args: Any) -> None:
    """dynamo's on_compile_start: torch.compile compiles inside the forward that first
    meets a frame, for seconds (11-21 s seen) with no safe point, so a revoke would wait
    past the grace and the program be escalated (killed, with --escalation kill). The
    lease is given back while it compiles (CPU work), and asked again at the end.

    Until the end every hook steps aside in the compiling thread: AOT autograd traces
    the backward by calling ``torch.autograd.grad`` (gated: a safe point), which asked
    the lease back at once, and inductor then compiled holding it, unrevocable (issue 25:
    killed after 11 s with --escalation kill, grace 1 s)."""
    trigger = getattr(getattr(args, "callback_trigger", None), "name", "")
    if trigger not in COMPILE_TRIGGERS or not _compile_session or _forks:
        return
    session = _compile_session[0]
    # A rank keeps its lease: its gang is granted and revoked as one, not rank by rank.
    paused = not session.gang and session._lease.pause_work()
    steps = _compiles.__dict__
    steps["n"] = steps.get("n", 0) + 1
    _compile_open.append((steps, paused))
    _compiles_open[0] = len(_compile_open)
    if paused and not _said_compiling[0]:
        _said_compiling[0] = True
        _say(
            f"gpushare run: session {session.id} ({session.name}) gives the GPU back while"
            " torch.compile compiles (CPU work), and asks again after (said once)"
        )
    elif not paused and not session.gang and session.holding and not _said_holding[0]:
        _said_holding[0] = True
        _say(
            f"gpushare run: session {session.id} ({session.name}) holds the GPU while"
            " torch.compile compiles: another thread is inside 'with session.gpu():', so a"
            " revoke waits for the compile's end (escalated past the node's grace);"
            " compile outside that block, or with one thread inside it (said once)"
        )


def _compile_end(_args: Any) -> None:
    if not _compile_open:  # a trigger that is not compiling (cudagraph recording)
        return
    steps, paused = _compile_open.pop()
    steps["n"] -= 1
    _compiles_open[0] = len(_compile_open)
    if paused and _compile_session:
        _compile_session[0]._lease.resume_work()


def _say(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _on_dynamo_loaded() -> None:
    """Dynamo is loaded (it is, lazily, at the first ``torch.compile``): the hooks' frames
    are marked for it to skip, and the compile callbacks registered (again after a
    ``torch._dynamo.reset()``, which clears them)."""
    _apply_skips()
    handler = getattr(sys.modules.get("torch._dynamo.callback"), "callback_handler", None)
    if handler is None or not _compile_session:
        return
    if _compile_start not in handler.start_callbacks:
        handler.register_start_callback(_compile_start)
    if _compile_end not in handler.end_callbacks:
        handler.register_end_callback(_compile_end)


def _skip_when_compiled() -> _Unpatch:
    """``torch.compile`` loads dynamo (lazily, at its first call): the hooks' frames are
    marked for it to skip then, however the program compiles (``torch.compile(model)``,
    ``@torch.compile``, ``Module.compile()``), or dynamo traced them as frames of their
    own (3 frames where the bare program compiles 1)."""
    import warnings

    import torch

    warnings.filterwarnings("ignore", message=GLOBAL_HOOKS_WARNING, category=UserWarning)

    def wrap(original: Any) -> Callable[..., Any]:
        def compile(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            _on_dynamo_loaded()  # dynamo is loaded now
            return out

        return compile

    return _patch(torch, "compile", wrap)


def _say_spawned_ranks_run_ungated() -> list[_Unpatch]:
    """``torch.multiprocessing.spawn`` (DDP without a launcher) starts processes that are
    not sessions, while this one, a session, does no GPU work: said once, in one line
    naming the fix, where they ran ungated without a word."""
    import torch.multiprocessing

    module = sys.modules.get("torch.multiprocessing.spawn")
    said = [False]

    def wrap(original: Any) -> Callable[..., Any]:
        def start_processes(fn: Any, args: Any = (), nprocs: int = 1, *a: Any, **kw: Any) -> Any:
            if not said[0] and _forks == 0:
                said[0] = True
                sys.stderr.write(
                    f"gpushare run: torch.multiprocessing starts {nprocs} processes that run"
                    f" ungated: only this one (pid {os.getpid()}) is a session; start the"
                    f" ranks with a launcher instead, each then a session: gpushare run --"
                    f" torchrun --nproc-per-node {nprocs} train.py (docs/run.md)\n"
                )
                sys.stderr.flush()
            # said for them: the processes it starts say nothing of their own at CUDA start
            os.environ["GPUSHARE_UNGATED_SAID"] = "1"
            try:
                return original(fn, args, nprocs, *a, **kw)
            finally:
                os.environ.pop("GPUSHARE_UNGATED_SAID", None)

        return start_processes

    owners = [o for o in (torch.multiprocessing, module) if hasattr(o, "start_processes")]
    return [_patch(o, "start_processes", wrap) for o in owners]


def _compiling() -> Callable[[], bool]:
    """``torch.compiler.is_dynamo_compiling`` (dynamo folds it to True while it traces;
    eagerly a bare ``return False``, half the cost of ``is_compiling``)."""
    import torch

    compiler = getattr(torch, "compiler", None)
    fn = getattr(compiler, "is_dynamo_compiling", None) or getattr(compiler, "is_compiling", None)
    return fn if fn is not None else (lambda: False)


def _gate_compiled_in_place(pre: Callable[..., None], post: Callable[..., None]) -> _Unpatch:
    """``Module.compile()`` compiles the module's call itself, hooks included, which
    then never run: its compiled call gets the outermost safe point back around it."""
    import torch

    def wrap(original: Any) -> Callable[..., Any]:
        def compile(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(self, *args, **kwargs)
            inner = self._compiled_call_impl
            if inner is None:
                return out

            def gated(*a: Any, **kw: Any) -> Any:
                pre(self, a)
                _compiled_calls.n += 1
                try:
                    return inner(*a, **kw)
                finally:
                    _compiled_calls.n -= 1
                    post(self, a, None)

            self._compiled_call_impl = gated
            _on_dynamo_loaded()  # dynamo is loaded now
            return out

        return compile

    return _patch(torch.nn.Module, "compile", wrap)


class _Unpatch:
    """A handle like PyTorch's hook handles: ``.remove()`` puts the original back."""

    def __init__(self, owner: Any, name: str, original: Any) -> None:
        self.owner, self.name, self.original = owner, name, original

    def remove(self) -> None:
        setattr(self.owner, self.name, self.original)


def _patch(owner: Any, name: str, wrap: Callable[[Any], Callable[..., Any]]) -> _Unpatch:
    """Replace ``owner.name`` by ``wrap(original)``; the handle puts the original back."""
    original = getattr(owner, name)
    setattr(owner, name, functools.wraps(original)(wrap(original)))
    return _Unpatch(owner, name, original)


def _hold_through_backward(
    session: Session, ours: Callable[[], bool], compiling: Callable[[], bool]
) -> list[_Unpatch]:
    """A backward pass has no safe point inside and may outlast ``idle_release``: it
    starts with a checkpoint and keeps the burst open until it is done."""
    import torch

    def held(original: Any) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if (
                _compiled_calls.n
                or compiling()
                or (_compiles_open[0] and _compiles.n)
                or not ours()
            ):
                return original(*args, **kwargs)
            with session.working():
                return original(*args, **kwargs)

        _skip_in_dynamo(call)
        return call

    return [
        _patch(owner, name, held)
        for owner, name in (
            (torch.Tensor, "backward"),
            (torch.autograd, "backward"),
            (torch.autograd, "grad"),
        )
    ]


# Tensor methods that move data between host and GPU: gated when CUDA is involved.
TENSOR_METHODS = ("to", "cuda", "copy_", "item", "cpu", "tolist", "numpy")


def _is_cuda(x: Any) -> bool:
    import torch

    if isinstance(x, torch.Tensor):
        return bool(x.is_cuda)
    if isinstance(x, torch.device):
        return x.type == "cuda"
    if isinstance(x, int) and not isinstance(x, bool):  # a device index: .to(0)
        return True
    return isinstance(x, str) and x.startswith("cuda")


def _gate_tensor_methods(gate: Callable[[], None], compiling: Callable[[], bool]) -> list[_Unpatch]:
    import torch

    def gated(original: Any, always: bool) -> Callable[..., Any]:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            if _compiled_calls.n or compiling() or (_compiles_open[0] and _compiles.n):
                return original(self, *args, **kwargs)
            # Cheap first: most calls are on CUDA tensors or name no CUDA device.
            if (
                always
                or self.is_cuda
                or any(_is_cuda(a) for a in args)
                or any(_is_cuda(v) for v in kwargs.values())
            ):
                gate()
            return original(self, *args, **kwargs)

        _skip_in_dynamo(call)
        return call

    return [
        _patch(torch.Tensor, name, functools.partial(gated, always=name == "cuda"))
        for name in TENSOR_METHODS
    ]


# Factory functions: gated when asked for memory on a CUDA device (device=...).
FACTORIES = (
    "empty", "zeros", "ones", "full", "rand", "randn", "randint", "randperm", "arange",
    "linspace", "eye", "tensor", "as_tensor", "empty_like", "zeros_like", "ones_like",
    "full_like", "rand_like", "randn_like",
)  # fmt: skip


def _gate_factories(gate: Callable[[], None], compiling: Callable[[], bool]) -> list[_Unpatch]:
    import torch

    def gated(original: Any, like: bool) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if _compiled_calls.n or compiling() or (_compiles_open[0] and _compiles.n):
                return original(*args, **kwargs)
            device = kwargs.get("device")
            # A device asked for, or (the _like ones) the device of the tensor given.
            if device is not None:
                on_cuda = _is_cuda(device)
            else:
                on_cuda = like and bool(args) and _is_cuda(args[0])
            if on_cuda:
                gate()
            return original(*args, **kwargs)

        _skip_in_dynamo(call)
        return call

    return [
        _patch(torch, name, functools.partial(gated, like=name.endswith("_like")))
        for name in FACTORIES
    ]


def limit_cuda_memory(session: Session) -> float | None:
    """Enforce the session's memory limit inside this process, where CUDA is there:
    going past it raises PyTorch's out-of-memory error in this workload only. Returns
    the fraction set, or None without CUDA."""
    import torch

    from gpushare.client.swap.torch import limit_process_memory

    if not torch.cuda.is_available():
        return None
    return limit_process_memory(torch, session.memory_limit, torch.cuda.current_device())

"""``gpushare run [--memory SIZE] [--weight W] -- COMMAND ...``: an unmodified PyTorch
program as a session.

The command runs with this package's ``_autoattach`` folder first on ``PYTHONPATH`` and
gpushare's allocator library in ``LD_PRELOAD`` (PyTorch's ``cudaMalloc`` then reaches
gpushare's swappable memory; see :mod:`gpushare.client.swap.torch`). The ``sitecustomize``
there attaches the Python process at start (memory from ``--memory``, else
``GPUSHARE_MEMORY``, else KAI's ``GPU_PORTION`` of the GPU), installs the global hooks of
:mod:`gpushare.client.hooks`, enforces the memory limit where CUDA is there, and closes
the session at exit. Any ``sitecustomize`` it shadows is run after it.

A distributed launcher (``torchrun``, ``accelerate``, ``deepspeed``) is not attached:
each worker it starts is (:mod:`gpushare.client.launchers`). Settings that would put
PyTorch's memory out of gpushare's reach (``expandable_segments``, the
``cudaMallocAsync`` backend) are taken out of ``PYTORCH_CUDA_ALLOC_CONF``, saying so.
A Python that would skip the ``sitecustomize`` (``-I``, ``-E``, ``-S``) is refused.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

from gpushare.client import launchers, modelled
from gpushare.client.env import compute_limit_of, memory_figures, rank_gpu, read_env
from gpushare.units import format_size, parse_size

if TYPE_CHECKING:
    from gpushare.client.session import Session

log = logging.getLogger("gpushare.run")
ENV_FLAG = "GPUSHARE_AUTOATTACH"
STOP_GRACE_S = 10.0  # after SIGTERM, a program whose session was ended is killed
SESSION: Session | None = None  # this process's session, once attached


def child_env(
    environ: dict[str, str],
    memory: str | None,
    weight: float | None,
    name: str | None,
    socket: str | None,
    gpu: int | None,
    notes: list[str] | None = None,
    memory_limit: str | None = None,
    compute_limit: str | None = None,
) -> dict[str, str]:
    """The command's environment: what the sitecustomize in it needs. What had to be
    changed besides is said in ``notes``."""
    notes = [] if notes is None else notes
    env = dict(environ)
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_autoattach")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH", "")) if p)
    env[ENV_FLAG] = "1"
    env["GPUSHARE_PYTHON"] = sys.executable  # named when a foreign Python is refused
    if memory is not None:
        env["GPUSHARE_MEMORY"] = str(parse_size(memory))
    if memory_limit is not None:
        env["GPUSHARE_MEMORY_LIMIT"] = str(parse_size(memory_limit))
    if compute_limit is not None:
        env["GPUSHARE_COMPUTE_LIMIT"] = compute_limit
    for key, value in (
        ("GPUSHARE_WEIGHT", weight),
        ("GPUSHARE_NAME", name),
        ("GPUSHARE_SOCKET", socket),
        ("GPUSHARE_GPU", gpu),
    ):
        if value is not None:
            env[key] = str(value)
    _strip_alloc_confs(env, notes)
    _preload_shim(env, notes)
    return env


def _strip_alloc_confs(env: dict[str, str], notes: list[str]) -> None:
    """The PYTORCH_CUDA_ALLOC_CONF settings that would take PyTorch's memory out of
    gpushare's reach, out of ``env`` (a variable left empty goes), saying so."""
    from gpushare.client.swap.torch import ALLOC_CONF_VARS, strip_alloc_conf

    for var in ALLOC_CONF_VARS:
        if var not in env:
            continue
        kept, dropped = strip_alloc_conf(env[var])
        if not dropped:
            continue
        notes.append(
            f"{var}: {', '.join(dropped)} taken out: PyTorch's memory would then be"
            " out of gpushare's reach (docs/torch-backend.md)"
        )
        if kept:
            env[var] = kept
        else:
            del env[var]


def _preload_shim(env: dict[str, str], notes: list[str]) -> None:
    """gpushare's allocator library first in ``LD_PRELOAD`` (once); where it was not
    built, a note that the torch backend cannot start on a real GPU."""
    from gpushare.client.swap.shim import ShimUnavailableError, shim_path

    try:
        lib = shim_path()
    except ShimUnavailableError as e:
        notes.append(f"{e}: on a real GPU the torch backend cannot start")
        return
    preload = env.get("LD_PRELOAD", "")
    if lib not in preload.replace(":", " ").split():
        env["LD_PRELOAD"] = f"{lib} {preload}".strip()


def skipped_site(command: Sequence[str]) -> str:
    """Why a Python command line would never run gpushare's sitecustomize ('' if it does):
    ``-I``, ``-E`` (PYTHONPATH ignored) or ``-S`` (no site)."""
    if not re.fullmatch(r"python[0-9.]*", os.path.basename(command[0])):
        return ""
    for a in command[1:]:
        if a in ("-W", "-X") or not a.startswith("-") or a.startswith("--"):
            break
        if a[1:2] in ("c", "m"):
            break
        bad = sorted(set(a[1:]) & {"I", "E", "S"})
        if bad:
            return (
                f"{command[0]} -{bad[0]} ignores gpushare's start-up hook (PYTHONPATH or site):"
                f" the program would run ungated; drop -{bad[0]}"
            )
    return ""


def unbounded_memory(command: Sequence[str]) -> str:
    """What of a command line's GPU memory gpushare cannot bound ('' where nothing):
    vLLM's sleep mode allocates its weights and KV cache through an allocator of its own
    that calls the driver (cuMemCreate), past gpushare's (which serves cudaMalloc and
    refuses past the limit). gpushare counts and swaps that memory through vLLM's
    allocator (:mod:`~gpushare.client.swap.vllm_sleep`), but cannot refuse it."""
    words = [os.path.basename(a) for a in command]
    vllm = any(w == "vllm" or w.startswith("vllm.") for w in words)
    sleep = any(a == "--enable-sleep-mode" or a.startswith("--enable-sleep-mode=") for a in command)
    if vllm and sleep and "--enable-sleep-mode=false" not in command:
        return (
            "vLLM's --enable-sleep-mode allocates the model's memory through vLLM's own CUDA"
            " allocator: gpushare counts it and swaps it through that allocator, but cannot"
            " refuse it past the session's memory limit; set --gpu-memory-utilization so"
            " that the weights and KV cache fit within the limit"
        )
    return ""


def is_python(exe: str) -> bool:
    """Whether the file ``exe`` is a Python interpreter or a script run by one (its
    ``#!`` line names Python): what gpushare's start-up hook runs in."""
    if re.fullmatch(r"python[0-9.]*", os.path.basename(exe)):
        return True
    try:
        with open(exe, "rb") as f:
            first = f.readline(256)
    except OSError:
        return False
    return first.startswith(b"#!") and b"python" in first


def _memory_words(session: Session) -> str:
    limit = f" memory limit {format_size(session.memory_limit)}"
    if session.memory_request < session.memory_limit:
        return f" memory request {format_size(session.memory_request)},{limit}"
    return limit


def run(
    command: Sequence[str],
    memory: str | None = None,
    weight: float | None = None,
    name: str | None = None,
    socket: str | None = None,
    gpu: int | None = None,
    memory_limit: str | None = None,
    compute_limit: str | None = None,
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
    why = skipped_site(command)
    if why:
        print(f"gpushare run: error: {why}", file=sys.stderr)
        return 2
    notes: list[str] = []
    try:
        env = child_env(
            dict(os.environ), memory, weight, name, socket, gpu, notes, memory_limit, compute_limit
        )
        # What the program's attach will read (GPUSHARE_MEMORY, GPU_PORTION, the pod's
        # annotations, GPUSHARE_SIM_RESIDENT): a wrong value is a usage error said here,
        # as --memory's is; so is a limit below the request.
        e = read_env(env)
        memory_figures(None, None, e)
        compute_limit_of(None, env.get("GPUSHARE_COMPUTE_LIMIT"))
        modelled.model_of(env.get(modelled.ENV))
    except ValueError as e:
        print(f"gpushare run: error: {e}", file=sys.stderr)
        return 2
    why = unbounded_memory(command)
    if why:
        notes.append(why)
    if not is_python(exe):
        notes.append(
            f"{command[0]} is not a Python program: only the Python programs it starts are"
            " gated (each a session of its own); the rest runs ungated"
        )
    for note in notes:
        print(f"gpushare run: {note}", file=sys.stderr)
    sys.stderr.flush()
    os.execve(exe, list(command), env)
    return 0  # not reached


_draining: list[float] = []  # the grace the node gave, once it said the session ends


def _stop_program(reason: str, grace_s: float) -> None:
    """The node ends this session (``ctl end``; refused on reconnecting): the program
    must not go on ungated, its memory counted free. Stopped as a deleted pod is: SIGTERM
    (a program may save its state, a server answer what is in flight), then SIGKILL.

    Given a grace (``ctl end --grace``), the session keeps its turns until the node ends
    it, so the SIGTERM goes at once and the SIGKILL when the node has ended it (or
    :data:`STOP_GRACE_S` after the grace, should the node not say). Ended at once, the
    SIGKILL follows :data:`STOP_GRACE_S` after the SIGTERM; ended after a grace, at once.
    On the reader thread: written straight to fd 2, no lock the program may hold."""
    pid = os.getpid()
    if _draining and grace_s <= 0:  # the grace given is over: nothing more to wait for
        os.write(2, f"gpushare run: error: {reason}: its grace is over: SIGKILL\n".encode())
        os.kill(pid, signal.SIGKILL)
        return
    if grace_s > 0:
        if _draining:
            return  # said already
        _draining.append(grace_s)
        wait = grace_s + STOP_GRACE_S
        how = f"SIGTERM; the node ends the session in {grace_s:g} s, SIGKILL then"
    else:
        wait, how = STOP_GRACE_S, f"SIGTERM, SIGKILL after {STOP_GRACE_S:g} s"
    os.write(2, f"gpushare run: error: {reason}: stopping the program ({how})\n".encode())

    def kill() -> None:
        time.sleep(wait)
        os.kill(pid, signal.SIGKILL)

    threading.Thread(target=kill, name="gpushare-stop", daemon=True).start()
    os.kill(pid, signal.SIGTERM)


_CLIENT = os.path.dirname(os.path.abspath(__file__))  # gpushare's client package


def _interrupted_hook(session: Session, previous: Callable[..., Any]) -> Callable[..., Any]:
    """``sys.excepthook``: a Ctrl-C that stops the program inside gpushare's hooks (most
    often while it waits for the lease) is one line, not a traceback through gpushare's
    frames; Python then ends the program by SIGINT (a shell shows 130) as it would have.
    Any other exception is the previous hook's."""

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        frames, at = [], tb
        while at is not None:
            frames.append(at.tb_frame)
            at = at.tb_next
        ours = [f for f in frames if f.f_code.co_filename.startswith(_CLIENT + os.sep)]
        if not issubclass(kind, KeyboardInterrupt) or not ours:
            previous(kind, value, tb)
            return
        who = f"session {session.id} ({session.name})"
        waiting = [f for f in ours if f.f_code.co_name == "_await"]
        if waiting or not session.holding:  # in the wait, or on its way to it
            t0 = waiting[-1].f_locals.get("t0") if waiting else None
            after = f" {time.monotonic() - t0:.1f} s" if isinstance(t0, float) else ""
            what = f"while {who} waited{after} for the GPU"
        else:
            what = f"in gpushare's hooks ({who})"
        sys.stderr.write(f"gpushare run: interrupted (Ctrl-C) {what}: stopped\n")
        sys.stderr.flush()

    return hook


def _attach_error(e: Exception) -> str:
    """An attach that failed, in one line naming the flag that fixes it."""
    from gpushare.errors import AttachRefusedError, GpushareError

    text = str(e)
    if isinstance(e, AttachRefusedError) and e.code == "attach":
        if text.startswith("weight"):
            return f"{text} (gpushare run --weight W)"
        if "memory" in text and "mode auto" not in text:
            return f"{text} (gpushare run --memory SIZE, or GPUSHARE_MEMORY)"
    if isinstance(e, GpushareError | ValueError):
        return text
    return f"could not attach ({type(e).__name__}: {text}): the program was not started"


def child_start() -> None:
    """In the command's Python: attach, hook, limit. Called by the sitecustomize."""
    if launchers.launcher(getattr(sys, "orig_argv", sys.argv)):
        return  # a launcher: its workers are the sessions (they inherit the flag)
    # This pid's: Python processes this one starts (spawned DataLoader workers, tools)
    # are not the session, while an exec of this process (os.execv: the same pid) is.
    os.environ[ENV_FLAG] = str(os.getpid())
    from gpushare.client.session import attach_with
    from gpushare.errors import AttachRefusedError

    weight = os.environ.get("GPUSHARE_WEIGHT")
    given = os.environ.get("GPUSHARE_GPU")
    # --gpu, else a launcher's rank on its own GPU (LOCAL_RANK), else the environment's
    gpu = int(given) if given else rank_gpu()
    try:
        name, w = os.environ.get("GPUSHARE_NAME") or None, float(weight) if weight else None
        model = modelled.asked()
        try:
            session = attach_with(
                name=name, weight=w, gpu=gpu, on_ended=_stop_program, resident_model=model
            )
        except AttachRefusedError as e:
            if given or gpu is None or not str(e).startswith(f"no GPU {gpu} "):
                raise
            # More ranks than GPUs (ranks sharing one GPU, or ranks on CPU): the default
            print(
                f"gpushare run: LOCAL_RANK {os.environ.get('LOCAL_RANK')} would be GPU {gpu},"
                f" which the node does not have ({e}): attached to the default GPU instead",
                file=sys.stderr,
                flush=True,
            )
            session = attach_with(name=name, weight=w, on_ended=_stop_program, resident_model=model)
    except Exception as e:  # whatever it is, the program must not run ungated
        # At start-up, before the program: end here (SystemExit is fatal in sitecustomize)
        print(f"gpushare run: error: {_attach_error(e)}", file=sys.stderr, flush=True)
        os._exit(3)
    tq = f", TQ {session.tq_s:g} s" if session.tq_s else ""
    print(
        f"gpushare run: attached as session {session.id} ({session.name}) on GPU"
        f" {session.gpu_index} ({session.gpu_name}{', simulated' if session.simulated else ''}),"
        f"{_memory_words(session)}{tq}",
        file=sys.stderr,
        flush=True,
    )
    # The processes the program starts join this session at their first GPU work.
    os.environ[FAMILY_FLAG] = str(session.id)
    os.environ[FAMILY_SIM_FLAG] = "1" if session.simulated else "0"
    _gate(session)
    try:
        import torch
    except ImportError:
        return
    os.register_at_fork(after_in_child=lambda: _forked(torch))


def _gate(session: Session) -> None:
    """The session gates this process: closed at exit, its hooks installed, its memory
    limit enforced where CUDA is there."""
    atexit.register(session.close)
    sys.excepthook = _interrupted_hook(session, sys.excepthook)
    global SESSION, HOOKS
    SESSION = session
    try:
        from gpushare.client import hooks

        HOOKS = hooks.install(session)
        if session.backend.name != "torch":  # the torch backend sets its own limit
            hooks.limit_cuda_memory(session)
        HOOKS.extend(_model_memory(session))
    except ImportError:
        log.warning("gpushare run: PyTorch is not installed: nothing is gated")


def _model_memory(session: Session) -> list[Any]:
    """On a simulated GPU, ``--sim-resident``'s model of the program's memory: a global
    forward pre hook after gpushare's own (so the forward holds the lease)."""
    model = modelled.asked()
    if not model:
        return []
    if not session.simulated:
        log.warning("gpushare run: --sim-resident is for simulated GPUs: ignored on a real one")
        return []
    from torch.nn.modules.module import register_module_forward_pre_hook

    return [register_module_forward_pre_hook(modelled.ModelledMemory(session, model))]


# --- the processes a session's program starts: members of its family ------------------

FAMILY_FLAG = "GPUSHARE_FAMILY"  # the session a process started by its program joins
FAMILY_SIM_FLAG = "GPUSHARE_FAMILY_SIMULATED"  # "1": its GPU is simulated
MEMBER_MEMORY = "GPUSHARE_MEMBER_MEMORY"  # the most of the session's limit one takes
HOOKS: list[Any] = []  # this process's hooks' handles (a forked child's are its parent's)


def _title() -> str:
    """What the process calls itself (``VLLM::EngineCore``: a process title overwrites
    its command line), else its program's name."""
    from gpushare.client.env import program_name

    try:
        with open("/proc/self/cmdline", "rb") as f:
            words = f.read(256).split(b"\0")[0].decode(errors="replace").split()
    except OSError:
        words = []
    title = os.path.basename(words[0]) if words else ""
    if title and "python" not in title:
        return title[:64]
    return program_name(sys.argv[0], getattr(sys, "orig_argv", sys.argv))[:64]


def join_family(why: str) -> Session | None:
    """This process, started by a session's program, begins GPU work (``why``): it
    attaches as a member of that session (docs/run.md "Processes the program starts"),
    gated from here on. A process that cannot join is stopped, saying why: its GPU work
    would run ungated. None: no family to join (or it is the session already)."""
    family = int(os.environ.get(FAMILY_FLAG) or 0)
    if not family or (SESSION is not None and SESSION._lease.pid == os.getpid()):
        return None
    for h in HOOKS:  # a forked child's: its parent's session's, not its own
        h.remove()
    HOOKS.clear()
    from gpushare.client.session import attach_with

    pid = os.getpid()
    try:
        given = os.environ.get(MEMBER_MEMORY) or None
        session = attach_with(
            memory_limit=parse_size(given) if given else None,
            name=f"{_title()}-{pid}",
            family=family,
            on_ended=_stop_program,
            resident_model=modelled.asked(),
        )
    except Exception as e:  # whatever it is, its GPU work must not run ungated
        os.write(
            2,
            f"gpushare run: error: process {pid}, started by session {family}'s program,"
            f" {why} and could not join the session: {_attach_error(e)}: stopped (its GPU"
            f" work would run ungated)\n".encode(),
        )
        os._exit(3)
    os.write(
        2,
        f"gpushare run: process {pid} ({session.name}) {why}: joined session {family} as"
        f" session {session.id}, one lease with it,{_memory_words(session)} of its"
        f" memory\n".encode(),
    )
    _gate(session)
    return session


def watch_for_gpu_work(torch: Any) -> None:
    """In a process a session's program started: join the session at its first GPU work,
    CUDA's start (``torch.cuda._lazy_init``, which every first use goes through) or, on
    a simulated GPU (where PyTorch runs on the CPU), its first module forward. A
    DataLoader worker's forward (a transform) is CPU work: never joined for."""
    handles: list[Any] = []

    def first_forward(*_args: Any) -> None:
        for h in handles:  # once: a DataLoader worker's first forward tells it is one
            h.remove()
        if torch.utils.data.get_worker_info() is not None:
            return
        session = join_family("runs a model")
        if session is not None:
            session.checkpoint()  # this forward is gated too

    if os.environ.get(FAMILY_SIM_FLAG) == "1":
        from torch.nn.modules.module import register_module_forward_pre_hook

        handles.append(register_module_forward_pre_hook(first_forward))
    names = vars(torch.cuda)
    init = names["_lazy_init"]

    def _lazy_init() -> object:
        names["_lazy_init"] = init  # once: the original from now on
        for h in handles:
            h.remove()
        join_family("starts CUDA")
        return init()

    names["_lazy_init"] = _lazy_init


def _forked(torch: Any) -> None:
    """After a fork in a process of the family (a multiprocessing worker, an engine's
    core): its inherited hooks step aside (client/hooks.py), and it joins at its first GPU
    work. No I/O here: a fork handler runs before the child's own code."""
    if SESSION is not None and not os.environ.get("GPUSHARE_UNGATED_SAID"):
        watch_for_gpu_work(torch)

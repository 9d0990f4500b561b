"""The ``gpushare`` command line."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn, cast

from gpushare._version import __version__
from gpushare.errors import GpushareError
from gpushare.settings import (
    ESCALATIONS,
    MODES,
    POLICIES,
    RANGES,
    Change,
    SettingsError,
    check,
)
from gpushare.units import format_size, parse_duration, parse_size, parse_weight

log = logging.getLogger("gpushare")


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _weight(text: str) -> float:
    try:
        return parse_weight(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_size(text: str) -> int:
    size = _size(text)
    if size <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, like 80GiB, not {text}")
    return size


def _seconds(text: str) -> float:
    try:
        v = parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be positive (a duration like 30s, 5m), not {text}")
    return v


def _setting(key: str) -> Callable[[str], float]:
    """The argparse type of a node setting: read as a duration (``5m``), a whole number or
    a number, then checked by the one validation (gpushare.settings), so a flag, the config
    file and ``ctl`` refuse a value with the same words."""
    r = RANGES[key]

    def parse(text: str) -> float:
        try:
            if r.unit == "s":
                value: float = parse_duration(text)
            elif r.integer and re.fullmatch(r"\s*[-+]?[0-9]+\s*", text):
                value = int(text)
            else:
                value = float(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(
                str(e) if r.unit == "s" else f"cannot read {text!r}: {r.describe()}"
            ) from None
        try:
            return check(key, value)
        except SettingsError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = key
    return parse


ADMIN_SOCKET_HELP = (
    "the node's admin socket (default $GPUSHARE_ADMIN_SOCKET, else /run/gpushare/admin.sock);"
    " --admin-socket is the same"
)
DURATIONS = "30, 30s, 5m, 1.5h, 1d, 250ms, 1e3"


def _admin_socket(parser: argparse.ArgumentParser) -> None:
    """``--socket`` (or ``--admin-socket``) for the commands that administer: the admin
    socket, before or after the subcommand. SUPPRESS: a level that was not given it does
    not override the level that was."""
    parser.add_argument(
        "--socket",
        "--admin-socket",
        dest="admin_socket",
        metavar="ADMIN_SOCKET",
        default=argparse.SUPPRESS,
        help=ADMIN_SOCKET_HELP,
    )


def _parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


class Parser(argparse.ArgumentParser):
    """argparse, with a usage mistake said in one line (the usage is one --help away), and
    no abbreviated options: ``node --sim-gpu 1`` must not pass for ``--sim-gpus`` (a typo
    would start a real node on the default paths)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(
        prog="gpushare",
        description="Share one GPU safely and fairly: exclusive time quanta, swap to host "
        "memory, fraction-weighted shares, per-session figures.",
    )
    ap.add_argument("--version", action="version", version=f"gpushare {__version__}")
    ap.add_argument(
        "--socket",
        metavar="PATH",
        default=argparse.SUPPRESS,
        help="the socket of the command that follows, as if given after it: the workload"
        " socket for node and run, the admin socket for ctl, top and timeline",
    )
    ap.add_argument(
        "--admin-socket", metavar="PATH", default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    n = sub.add_parser(
        "node",
        help="run the node daemon (one per machine)",
        description="Run the node daemon: one arbiter per GPU, a workload socket "
        "and a root-only admin socket. Flags override the config file.",
    )
    n.add_argument(
        "--config",
        metavar="FILE",
        help="TOML config file; may not exist yet (ctl --persist creates it); watched, live",
    )
    n.add_argument(
        "--state",
        metavar="FILE",
        help="where ctl --persist writes (default: the config file); read after it",
    )
    n.add_argument(
        "--socket",
        metavar="PATH",
        default=argparse.SUPPRESS,
        help="workload socket (default /run/gpushare/gpushare.sock)",
    )
    n.add_argument(
        "--admin-socket",
        metavar="PATH",
        default=argparse.SUPPRESS,
        help="admin socket, mode 0600 (default /run/gpushare/admin.sock)",
    )
    n.add_argument(
        "--tq",
        type=_setting("tq"),
        metavar="SECONDS",
        help=f"time quantum (default 30; {DURATIONS}; from 0.05 s to 1 d)",
    )
    n.add_argument("--mode", choices=MODES, help="default auto")
    n.add_argument("--policy", choices=POLICIES, help="default equal")
    n.add_argument(
        "--grace",
        type=_setting("grace"),
        metavar="SECONDS",
        help="how long a revoked holder has to yield (default 5)",
    )
    n.add_argument(
        "--escalation",
        choices=ESCALATIONS,
        help="what happens to a holder that does not yield in time (default log)",
    )
    n.add_argument(
        "--idle-release",
        type=_setting("idle_release"),
        metavar="SECONDS",
        help="an implicit burst ends after this long without GPU work (default 0.5)",
    )
    n.add_argument(
        "--reserve",
        type=_size,
        metavar="SIZE",
        help="GPU memory kept free of sessions, per GPU (default 0)",
    )
    n.add_argument(
        "--sim-gpus", type=_setting("sim_gpus"), metavar="N", help="run N simulated GPUs"
    )
    n.add_argument(
        "--sim-memory",
        type=_size,
        metavar="SIZE",
        help="memory of each simulated GPU (default 80GiB)",
    )
    n.add_argument(
        "--sim-bandwidth",
        type=_setting("sim_bandwidth"),
        metavar="BYTES_PER_S",
        help="modelled swap bandwidth each way of simulated GPUs (default 55e9)",
    )
    n.add_argument(
        "--sim-swap-failure-rate",
        type=_setting("sim_swap_failure_rate"),
        metavar="P",
        help="simulated GPUs: each swap-out fails with probability P (fault drills)",
    )
    n.add_argument(
        "--sequential-switches",
        dest="overlap",
        action="store_false",
        default=None,
        help="swap the next holder in only after the last one swapped out (default: overlap"
        " the two, the link is full duplex)",
    )
    n.add_argument(
        "--no-prefetch",
        dest="prefetch",
        action="store_false",
        default=None,
        help="do not swap the next holder in during the quantum (default: where memory allows)",
    )
    n.add_argument(
        "--turn",
        type=_setting("turn"),
        metavar="SECONDS",
        help="the longest interactive turn, 0 for none (default 1; docs/scheduling.md)",
    )
    n.add_argument("--event-log", metavar="PATH", help="append every event as a JSON line")
    n.add_argument(
        "--proc-root",
        metavar="PATH",
        help="where the host's /proc is mounted "
        "(default /proc; /host/proc in a container without hostPID)",
    )
    n.add_argument(
        "--kubernetes",
        action="store_true",
        default=None,
        help="resolve pod UIDs to pod names through the Kubernetes API (node: $NODE_NAME)",
    )
    n.add_argument(
        "--admin-group", metavar="GROUP", help="members may administer (admin socket mode 0660)"
    )
    n.add_argument(
        "--metrics-port",
        type=_setting("metrics_port"),
        metavar="PORT",
        help="Prometheus exporter port (default 9423; 0: off)",
    )
    n.add_argument(
        "--metrics-address",
        metavar="ADDR",
        help="address the exporter listens on (default 0.0.0.0)",
    )
    n.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])

    c = sub.add_parser(
        "ctl",
        help="administer a running node",
        description="Administer a running node over its admin socket. --socket goes before"
        " or after the action.",
    )
    _admin_socket(c)
    cs = c.add_subparsers(dest="ctl_cmd", required=True, metavar="ACTION")
    st = cs.add_parser("status", help="GPUs, holders, queues and sessions")
    st.add_argument(
        "--json", action="store_true", help="one JSON object (docs/contract.md: Status JSON)"
    )
    _admin_socket(st)
    tq = cs.add_parser(
        "tq",
        help="show the time quantum, or set it live",
        description="Without SECONDS: the TQ in force on each GPU. With it: the new TQ, live"
        " (a shorter one also cuts the quantum running now). SECONDS is a number of seconds"
        f" or a duration ({DURATIONS}), from 0.05 s to 1 d.",
    )
    tq.add_argument(
        "tq_s",
        type=_setting("tq"),
        nargs="?",
        metavar="SECONDS",
        help=f"the new TQ: {DURATIONS} (none: show the TQ in force)",
    )
    tq.add_argument("--gpu", type=int, metavar="INDEX", help="only this GPU (default all)")
    tq.add_argument(
        "--persist",
        action="store_true",
        help="also write it to the node's state file (--state) or config file: a restart keeps it",
    )
    tq.add_argument("--json", action="store_true", help="each GPU's settings as JSON")
    _admin_socket(tq)
    for name, choices, what in [
        ("mode", MODES, "how sessions share a GPU"),
        ("policy", POLICIES, "how quanta are sized"),
        ("escalation", ESCALATIONS, "what happens to a holder that ignores a revoke"),
    ]:
        sp = cs.add_parser(name, help=f"set the {name}: {what}, live")
        sp.add_argument("value", choices=choices)
        sp.add_argument("--gpu", type=int, metavar="INDEX", help="only this GPU (default all)")
        sp.add_argument(
            "--persist", action="store_true", help="also write it down (state or config file)"
        )
        _admin_socket(sp)
    end = cs.add_parser("end", help="end a session (its lease and memory are freed)")
    end.add_argument("session", type=int, metavar="ID")
    end.add_argument("--reason", default="ended by an administrator")
    _admin_socket(end)
    ev = cs.add_parser("events", help="the event stream as JSON lines")
    ev.add_argument("--follow", "-f", action="store_true", help="keep printing new events")
    ev.add_argument("--since", type=_seconds, metavar="DURATION", help="only the last 5m, 1h...")
    ev.add_argument("--session", type=int, metavar="ID", help="only this session's events")
    _admin_socket(ev)

    r = sub.add_parser(
        "run",
        help="run an unmodified PyTorch program as a session",
        description="Run COMMAND with its Python attached as a session: GPU work is gated "
        "on the lease at PyTorch's module-forward and optimizer-step hooks, which are also "
        "its safe points; the lease is released after idle_release without GPU work. "
        "See docs/run.md for what is gated and what is not.",
    )
    r.add_argument(
        "--memory",
        metavar="SIZE",
        help="memory request: what the node guarantees and packs by, and the limit unless"
        " --memory-limit says more (default GPUSHARE_MEMORY, else KAI's gpu-memory or"
        " GPU_PORTION of the GPU)",
    )
    r.add_argument(
        "--memory-limit",
        metavar="SIZE",
        help="the most memory the program may use: above the request it is lent while"
        " free and given back when needed, never a reason to end it (default"
        " GPUSHARE_MEMORY_LIMIT, else KAI's limit annotations, else the request)",
    )
    r.add_argument(
        "--compute-limit",
        metavar="F",
        help="the most of the GPU's time the program may take, a fraction in (0, 1], even"
        " when the GPU would otherwise idle (default GPUSHARE_COMPUTE_LIMIT, else none)",
    )
    r.add_argument(
        "--weight",
        type=_weight,
        metavar="W",
        help="weight under policy weighted, from 0.001 to 1000 (default 1, or KAI's GPU_PORTION)",
    )
    r.add_argument("--name", help="the session's name (default the program's)")
    r.add_argument(
        "--socket",
        metavar="PATH",
        default=argparse.SUPPRESS,
        help="the node's workload socket (default $GPUSHARE_SOCKET, else"
        " /run/gpushare/gpushare.sock)",
    )
    r.add_argument("--gpu", type=int, metavar="INDEX")
    r.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND ...")
    t = sub.add_parser(
        "top",
        help="live view of GPUs and sessions (q quits)",
        description="A live view over the admin socket, refreshed twice a second."
        " SHARE is each session's share of GPU time over the last minute (since it"
        " attached, when younger). Keys: arrows/PgUp/PgDn scroll, Enter a session's"
        " details, s (or 1-6) sort, r reverse, h help, q quits. Needs a terminal: with"
        " stdin or stdout not one it prints one frame, as --once.",
    )
    _admin_socket(t)
    t.add_argument("--once", action="store_true", help="print one frame and exit (scripts)")
    t.add_argument("--json", action="store_true", help="with --once: the frame as JSON")
    t.add_argument(
        "--interval", type=_seconds, default=0.5, metavar="SECONDS", help="seconds between frames"
    )

    tl = sub.add_parser(
        "timeline",
        help="draw who held each GPU when, as a PNG",
        description="A Gantt chart of leases and swaps from the event log: "
        "a file written with --event-log, or the node's own events.",
    )
    tl.add_argument("-o", "--output", required=True, metavar="FILE.png")
    tl.add_argument(
        "--events",
        metavar="FILE",
        help="a JSON-lines event log (default: ask the node over its admin socket)",
    )
    _admin_socket(tl)
    tl.add_argument("--since", type=_seconds, metavar="DURATION", help="only the last 5m, 1h")
    tl.add_argument(
        "--window",
        type=_window,
        default=300.0,
        metavar="DURATION",
        help="draw the last DURATION of the events (default 5m; 0: all of them)",
    )

    sim = sub.add_parser(
        "simulate",
        help="a policy study: goodput, waits and batch loss against TQ (no GPU needed)",
        description="Run model workloads against the real arbiter under a virtual clock, "
        "for each TQ: print a table (goodput against the one-switch-per-quantum ideal, "
        "waits, batch loss) and draw it as a PNG. See docs/scheduling.md.",
    )
    sim.add_argument(
        "--mix",
        choices=["batch", "short", "interactive", "mixed"],
        default="mixed",
        help="three sessions: batch jobs, short bursts, two batch jobs and a notebook, or "
        "one of each (default mixed)",
    )
    sim.add_argument(
        "--fitting",
        action="store_true",
        help="sessions of 1/4 of the GPU each, fitting together (default: 3/8 each, over it)",
    )
    sim.add_argument(
        "--workload",
        action="append",
        metavar="KIND:SIZE[@WEIGHT]",
        help="a session of your own mix instead (repeat): batch, short, interactive or "
        "server; SIZE is its memory request, ',limit=SIZE' a limit above it (packed by"
        " the request in mode auto); a server takes rate=R,service=SECONDS,discard=SIZE",
    )
    sim.add_argument(
        "--gpu-memory",
        type=_positive_size,
        default=80 * 2**30,
        metavar="SIZE",
        help="the modelled GPU's memory (default 80GiB)",
    )
    sim.add_argument(
        "--bandwidth",
        type=_setting("sim_bandwidth"),
        default=55e9,
        metavar="BYTES_PER_S",
        help="the modelled swap bandwidth, each way (default 55e9)",
    )
    sim.add_argument(
        "--tq",
        type=_seconds,
        nargs="+",
        default=[1.0, 5.0, 30.0],
        metavar="SECONDS",
        help="the TQs to compare, a row each (default 1 5 30)",
    )
    sim.add_argument(
        "--seconds",
        type=_seconds,
        default=120.0,
        help="simulated seconds per run (default 120; longer where a long TQ needs it)",
    )
    sim.add_argument(
        "--mode", choices=MODES, default="exclusive", help="as the node's (default exclusive)"
    )
    sim.add_argument(
        "--policy", choices=POLICIES, default="equal", help="as the node's (default equal)"
    )
    sim.add_argument(
        "--no-prefetch",
        dest="prefetch",
        action="store_false",
        help="as the node's flag: no swap-in of the next holder during the quantum",
    )
    sim.add_argument(
        "--turn",
        type=_setting("turn"),
        default=1.0,
        metavar="SECONDS",
        help="the longest interactive turn, 0 for none (default 1; docs/scheduling.md)",
    )
    sim.add_argument(
        "--idle-release",
        type=_setting("idle_release"),
        default=0.5,
        metavar="SECONDS",
        help="the longest a quantum waits for its holder to ask again (default 0.5)",
    )
    sim.add_argument(
        "--seed",
        type=int,
        default=1,
        help="the notebook's think times and bursts (default 1): the same seed, the same table",
    )
    sim.add_argument(
        "-o",
        "--output",
        default="simulate.png",
        metavar="FILE.png",
        help="where the plot goes (default simulate.png)",
    )
    sim.add_argument("--no-plot", action="store_true", help="print the table only")

    d = sub.add_parser(
        "demo",
        help="a node on a simulated GPU, three workloads, a report",
        description="Start a node on a simulated 80 GiB GPU and three 30 GiB "
        "workloads (two batch jobs, one interactive), show progress, then a "
        "table per workload.",
    )
    d.add_argument("--seconds", type=_seconds, default=20.0, help="how long (default 20)")
    d.add_argument("--tq", type=_seconds, default=2.0, help="time quantum (default 2)")
    d.add_argument("--workdir", metavar="DIR", help="keep sockets, logs and events here")
    d.add_argument(
        "--mode",
        choices=MODES,
        default="exclusive",
        help="exclusive (default: one workload at a time, round-robin) or auto (those that"
        " fit together share)",
    )

    comp = sub.add_parser(
        "completion",
        help="print a shell completion script",
        description="Print the completion script for SHELL (needs argcomplete: pip install"
        " 'gpushare[cli]'). bash: eval \"$(gpushare completion bash)\" in ~/.bashrc; zsh the"
        " same in ~/.zshrc; fish: gpushare completion fish | source.",
    )
    comp.add_argument("shell", choices=["bash", "zsh", "fish"], nargs="?", default="bash")

    for p in _parsers(ap):
        # "-1GiB", "-5m", "-5": a value (refused with its reason), never an unknown option
        p._negative_number_matcher = re.compile(r"^-\.?[0-9]")
    return ap


def _window(text: str) -> float:
    try:
        v = parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be 0 (all) or positive, not {text}")
    return v


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    if "_ARGCOMPLETE" in os.environ:  # a shell asks for completions (gpushare completion)
        try:
            import argcomplete
        except ImportError:
            return 1
        argcomplete.autocomplete(parser)
    args = parser.parse_args(argv)
    try:
        rc = _command(args)
        sys.stdout.flush()  # here, so that a reader gone away is seen here
        return rc
    except GpushareError as e:
        print(f"gpushare {args.cmd}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`gpushare ctl events | head`): stop quietly, as `yes | head`
        # does, with the status of a SIGPIPE; nothing more may reach the closed pipe.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


def _admin(args: argparse.Namespace) -> str | None:
    """The admin socket of ctl, top, timeline: --socket or --admin-socket, before or after."""
    return getattr(args, "admin_socket", None) or getattr(args, "socket", None)


def _command(args: argparse.Namespace) -> int:  # noqa: C901
    if args.cmd == "node":
        return _node(args)
    if args.cmd == "ctl":
        return _ctl(args)
    if args.cmd == "run":
        from gpushare.client.runner import run

        cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
        for flag, value in (("--memory", args.memory), ("--memory-limit", args.memory_limit)):
            if value is None:
                continue
            try:
                if parse_size(value) == 0:  # a clear error before anything starts
                    raise ValueError(f"a memory limit must be more than 0: like {flag} 10GiB")
            except ValueError as e:
                print(f"gpushare run: error: {flag}: {e}", file=sys.stderr)
                return 2
        if args.memory is not None and args.memory_limit is not None:
            request, limit = parse_size(args.memory), parse_size(args.memory_limit)
            if limit < request:  # said in the flags' words, before anything starts
                print(
                    f"gpushare run: error: --memory-limit {format_size(limit)} is below"
                    f" --memory {format_size(request)}: give a limit at least as large as"
                    " the request",
                    file=sys.stderr,
                )
                return 2
        socket = getattr(args, "socket", None)
        return run(
            cmd,
            args.memory,
            args.weight,
            args.name,
            socket,
            args.gpu,
            args.memory_limit,
            args.compute_limit,
        )
    if args.cmd == "top":
        from gpushare.tools.top import run_top

        return run_top(_admin(args), args.once, args.interval, as_json=args.json)
    if args.cmd == "timeline":
        return _timeline(args)
    if args.cmd == "simulate":
        return _simulate(args)
    if args.cmd == "demo":
        from gpushare.tools.demo import run_demo

        return run_demo(args.seconds, args.tq, args.workdir, args.mode)
    if args.cmd == "completion":
        return _completion(args.shell)
    return 2


def _simulate(args: argparse.Namespace) -> int:
    from gpushare.settings import GpuSettings
    from gpushare.tools import simulate as sim
    from gpushare.units import format_size

    try:
        if args.workload:
            workloads = [sim.Workload.parse(w) for w in args.workload]
        else:
            workloads = sim.preset(args.mix, not args.fitting, args.gpu_memory)
    except ValueError as e:
        print(f"gpushare simulate: error: {e}", file=sys.stderr)
        return 2
    for w in workloads:  # each must fit on the GPU alone (the arbiter refuses it)
        if not 0 < w.memory <= args.gpu_memory:
            what = "has no memory" if not w.memory else "does not fit on"
            print(
                f"gpushare simulate: error: a {w.kind} workload of {format_size(w.memory)}"
                f" {what} the GPU of {format_size(args.gpu_memory)}: give it from 1 byte to"
                f" {format_size(args.gpu_memory)}, or a larger --gpu-memory",
                file=sys.stderr,
            )
            return 2
    settings = GpuSettings(
        mode=args.mode,
        policy=args.policy,
        prefetch=args.prefetch,
        turn_s=args.turn,
        anticipate_s=args.idle_release,
    )
    title = sim.describe(workloads, args.gpu_memory, settings)
    print(
        f"gpushare simulate: {title}; {args.seconds:g} s per run, or {sim.ROUNDS} rounds of"
        " every session's quantum where longer (run s)"
    )
    sys.stdout.flush()

    def progress(what: str) -> None:  # seconds a run: said on stderr, the table stays clean
        print(f"gpushare simulate: {what}", file=sys.stderr, flush=True)

    rows = sim.study(
        workloads,
        args.tq,
        args.gpu_memory,
        settings,
        args.seconds,
        args.bandwidth,
        args.seed,
        progress=progress,
    )
    print(sim.table(rows))
    print()
    print(sim.FOOTER)
    if args.no_plot:
        return 0
    try:
        sim.plot(rows, args.output, title)
    except ImportError as e:
        print(f"gpushare simulate: error: {e} (or --no-plot)", file=sys.stderr)
        return 1
    print(f"wrote {args.output}")
    return 0


def _completion(shell: str) -> int:
    try:
        from argcomplete.shell_integration import shellcode
    except ImportError:
        raise GpushareError(
            "shell completion needs argcomplete: pip install 'gpushare[cli]'"
        ) from None
    sys.stdout.write(shellcode(["gpushare"], shell=shell))
    return 0


def _timeline(args: argparse.Namespace) -> int:
    import time

    from gpushare.tools.admin import AdminClient
    from gpushare.tools.report import read_events
    from gpushare.tools.timeline import plot

    try:
        import matplotlib  # noqa: F401  (checked first: no node asked for nothing)
    except ImportError:
        raise GpushareError("the timeline needs matplotlib: pip install 'gpushare[plot]'") from None

    if args.events:
        try:
            events = read_events(args.events)
        except OSError as e:
            raise GpushareError(f"cannot read {args.events}: {e.strerror}") from None
        if args.since:
            events = [e for e in events if e["ts"] >= time.time() - args.since]
    else:
        with AdminClient(_admin(args)) as c:
            events = [e for e in c.events(since_s=args.since) if e is not None]
    if not events:
        raise GpushareError("no events to draw (is the node busy? try a longer --since)")
    w, h = plot(events, args.output, window_s=args.window)
    print(f"wrote {args.output} ({w}x{h} px, {len(events)} events)")
    return 0


def _ctl(args: argparse.Namespace) -> int:
    from gpushare.tools import ctl

    path = _admin(args)
    if args.ctl_cmd == "status":
        return ctl.status(path, args.json)
    if args.ctl_cmd == "tq":
        if args.tq_s is None:
            if args.persist:
                raise GpushareError("--persist needs a value to write: ctl tq SECONDS --persist")
            return ctl.show_settings(path, args.gpu, args.json)
        return ctl.set_config(path, args.gpu, args.persist, {"tq_s": args.tq_s}, args.json)
    if args.ctl_cmd in ("mode", "policy", "escalation"):  # the node checks the value
        change = cast(Change, {args.ctl_cmd: args.value})
        return ctl.set_config(path, args.gpu, args.persist, change)
    if args.ctl_cmd == "end":
        return ctl.end_session(path, args.session, args.reason)
    return ctl.events(path, args.follow, args.since, args.session)


def _node(args: argparse.Namespace) -> int:

    from gpushare.node.daemon import Node
    from gpushare.node.host.gpus import find_gpus, simulated_gpus
    from gpushare.node.keep.config import ConfigError, load
    from gpushare.units import format_size

    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    flags = {
        "socket": getattr(args, "socket", None),
        "admin_socket": getattr(args, "admin_socket", None),
        "tq": args.tq,
        "mode": args.mode,
        "policy": args.policy,
        "grace": args.grace,
        "escalation": args.escalation,
        "idle_release": args.idle_release,
        "reserve": args.reserve,
        "sim_gpus": args.sim_gpus,
        "sim_memory": args.sim_memory,
        "sim_bandwidth": args.sim_bandwidth,
        "event_log": args.event_log,
        "metrics_port": args.metrics_port,
        "proc_root": args.proc_root,
        "sim_swap_failure_rate": args.sim_swap_failure_rate,
        "admin_group": args.admin_group,
        "kubernetes": args.kubernetes,
        "metrics_address": args.metrics_address,
        "overlap": args.overlap,
        "prefetch": args.prefetch,
        "turn": args.turn,
    }
    flags = {k: v for k, v in flags.items() if v is not None}
    try:
        cfg = load(args.config, args.state, flags)
    except ConfigError as e:
        print(f"gpushare node: error: {e}", file=sys.stderr)
        return 2
    sim_memory = parse_size(cfg.sim_memory)  # checked with the rest of the configuration
    nvml = None
    if cfg.sim_gpus:
        gpus = simulated_gpus(cfg.sim_gpus, sim_memory)
    else:
        gpus, why, nvml = find_gpus()
        if not gpus:
            log.warning(
                "%s: running 1 SIMULATED GPU of %s instead (choose with --sim-gpus N "
                "--sim-memory SIZE)",
                why,
                format_size(sim_memory),
            )
            gpus = simulated_gpus(1, sim_memory)
    try:
        node = Node(
            cfg,
            gpus,
            config_path=args.config or "",
            nvml=nvml,
            state_path=args.state or "",
            flags=flags,
        )
        asyncio.run(node.run())
    except (OSError, ValueError) as e:
        print(f"gpushare node: error: {e}", file=sys.stderr)
        return 2
    return 0

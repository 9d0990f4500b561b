"""``gpushare node``: its parser and its command (the daemon started on its GPUs)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from gpushare.settings import ESCALATIONS, MODES, POLICIES
from gpushare.tools.cli.args import DURATIONS, Subparsers, _setting, _size
from gpushare.units import parse_size

log = logging.getLogger("gpushare")


def add_parser(sub: Subparsers) -> None:
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


def command(args: argparse.Namespace) -> int:

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

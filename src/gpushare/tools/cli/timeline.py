"""``gpushare timeline``: its parser and its command (leases and swaps drawn as a PNG)."""

from __future__ import annotations

import argparse

from gpushare.errors import GpushareError
from gpushare.tools.cli.args import Subparsers, _admin, _admin_socket, _seconds
from gpushare.units import parse_duration


def add_parser(sub: Subparsers) -> None:
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


def _window(text: str) -> float:
    try:
        v = parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be 0 (all) or positive, not {text}")
    return v


def command(args: argparse.Namespace) -> int:
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

"""``gpushare simulate``'s study: for each TQ, the mix run on the model of
:mod:`gpushare.tools.simulate`, beside the same sessions as batch jobs (the ideal) and the
mix's batch jobs alone, and the table and plot of what they show."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from gpushare.settings import GpuSettings
from gpushare.tools.simulate import KINDS, GiB, Run, Simulation, Workload
from gpushare.units import format_size


@dataclass
class Row:
    tq: float
    goodput: float
    ideal: float  # the same sessions as batch jobs: one switch per quantum
    batch_loss: float  # GPU time the batch jobs lose beyond the others' own work
    waits: dict[str, tuple[float, float, float]]  # kind: (p50, p99, max) of a burst's wait
    switches_per_min: float
    swapped_gib_per_min: float
    seconds: float  # simulated: at least ROUNDS rounds of every session at this TQ
    # servers: MiB copied to host memory per request answered, and MiB dropped instead
    # (None: no server in the mix)
    per_request_mib: tuple[float, float] | None = None


ROUNDS = 4  # a run covers at least this many quanta of every session


def run_seconds(seconds: float, tq: float, sessions: int) -> float:
    """How long a run at ``tq`` lasts: ``seconds``, or longer where a round of quanta
    would not come ``ROUNDS`` times (at TQ 30 with three sessions a 120 s run sees a
    session's wait for its turn about once, and no percentile shows it)."""
    return max(seconds, ROUNDS * tq * sessions)


def percentile(xs: Sequence[float], q: float) -> float:
    if not xs:
        return math.nan
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def study(
    workloads: Sequence[Workload],
    tqs: Sequence[float],
    capacity: int,
    settings: GpuSettings,
    seconds: float = 120.0,
    bandwidth: float = 55e9,
    seed: int = 1,
    progress: Callable[[str], None] | None = None,
) -> list[Row]:
    """One :class:`Row` per TQ. ``progress`` is told of each run as it starts (a study of
    three TQs is up to nine runs, seconds each)."""
    rows = []
    batch_only = [w for w in workloads if w.kind == "batch"]
    as_batch = [replace(w, kind="batch") for w in workloads]
    per_tq = (
        1 + (as_batch != list(workloads)) + bool(batch_only and len(batch_only) < len(workloads))
    )
    done = itertools.count(1)
    for tq in tqs:
        st = replace(settings, tq_s=tq)
        secs = run_seconds(seconds, tq, len(workloads))

        def run(ws: Sequence[Workload], what: str, st: GpuSettings = st, secs: float = secs) -> Run:
            if progress is not None:
                progress(
                    f"run {next(done)} of {per_tq * len(tqs)}: TQ {st.tq_s:g} s, {what},"
                    f" {secs:g} simulated s"
                )
            return Simulation(ws, capacity, st, bandwidth, seed=seed).run(secs)

        mix = run(workloads, "the mix")
        ideal = (
            run(as_batch, "the same sessions as batch jobs (ideal)").goodput
            if as_batch != list(workloads)
            else mix.goodput
        )
        loss = math.nan
        if batch_only and len(batch_only) < len(workloads):
            alone = run(batch_only, "its batch jobs alone (batch loss)").work()
            loss = 1 - mix.goodput * secs / alone if alone else math.nan
        # the max beside the percentiles: a wait for one's turn comes once a round, a
        # short burst's anticipated re-ask hundreds of times, and p99 hides the former
        waits: dict[str, tuple[float, float, float]] = {
            k: (percentile(mix.waits(k), 0.5), percentile(mix.waits(k), 0.99), max(mix.waits(k)))
            for k in KINDS
            if mix.waits(k)
        }
        moved = sum(s.swapped_out for s in mix.sessions)
        servers = [s for s in mix.sessions if s.kind == "server"]
        answered = sum(s.requests for s in servers)
        per_request = (
            (
                sum(s.swapped_out for s in servers) / 2**20 / max(1, answered),
                sum(s.discarded for s in servers) / 2**20 / max(1, answered),
            )
            if servers
            else None
        )
        rows.append(
            Row(
                tq,
                mix.goodput,
                ideal,
                loss,
                waits,
                mix.switches * 60 / secs,
                moved / GiB * 60 / secs,
                secs,
                per_request,
            )
        )
    return rows


def table(rows: Sequence[Row]) -> str:
    kinds = sorted({k for r in rows for k in r.waits})
    head = ["TQ s", "goodput", "ideal", "/ideal", "batch loss"]
    head += [f"{k} wait p50/p99/max s" for k in kinds]
    head += ["switches/min", "swapped GiB/min", "run s"]
    serving = any(r.per_request_mib is not None for r in rows)
    if serving:
        head += ["server MiB/request to host (dropped)"]
    out = [head]
    for r in rows:
        line = [
            f"{r.tq:g}",
            f"{r.goodput:.3f}",
            f"{r.ideal:.3f}",
            f"{r.goodput / r.ideal:.2f}" if r.ideal else "-",
            "-" if math.isnan(r.batch_loss) else f"{r.batch_loss:.1%}",
        ]
        line += [
            f"{r.waits[k][0]:.2f} / {r.waits[k][1]:.2f} / {r.waits[k][2]:.2f}"
            if k in r.waits
            else "none"  # no burst of this kind asked again within the run
            for k in kinds
        ]
        line += [f"{r.switches_per_min:.1f}", f"{r.swapped_gib_per_min:.0f}", f"{r.seconds:g}"]
        if serving:
            pr = r.per_request_mib
            line += ["-" if pr is None else f"{pr[0]:.0f} ({pr[1]:.0f})"]
        out.append(line)
    widths = [max(len(x[i]) for x in out) for i in range(len(head))]
    return "\n".join("  ".join(x[i].rjust(widths[i]) for i in range(len(head))) for x in out)


# What the table's columns mean: printed under it.
FOOTER = """\
goodput: GPU seconds of work done per second (1.000: the GPU never idle, switches hidden).
ideal: the goodput of the same sessions run as batch jobs, each holding its whole quantum:
  one switch per quantum, the least switching there can be; 1.000 where the swaps hide
  behind work (prefetch, overlapped switches), lower where a switch stalls the GPU.
  /ideal: goodput against it, what short bursts and notebooks cost beyond that.
batch loss: the GPU time the batch jobs lose beside the others, beyond the others' own work.
wait p50/p99/max: a burst's wait from its ask to its work, in s; none: no burst waited.
  A server's: a request's time from its arrival to its answer (its own GPU time included).
server MiB/request: bytes of its memory copied to host memory per request answered, and in
  brackets those dropped instead (its discard=, made again empty when next granted).
run s: simulated seconds per run (at least 4 rounds of every session's quantum)."""


def plot(rows: Sequence[Row], path: str, title: str) -> None:
    """Goodput, waits and batch loss against TQ, as a PNG (matplotlib: the plot extra)."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError(
            "gpushare simulate draws with matplotlib: pip install 'gpushare[plot]'"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tqs = [r.tq for r in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=100)
    a1.plot(tqs, [r.goodput for r in rows], "o-", label="goodput")
    a1.plot(tqs, [r.ideal for r in rows], "s--", label="ideal (one switch per quantum)")
    if not all(math.isnan(r.batch_loss) for r in rows):
        a1.plot(tqs, [r.batch_loss for r in rows], "^-", label="batch loss")
    a1.set_xscale("log")
    a1.set_xlabel("TQ (s)")
    a1.set_ylim(bottom=0)
    a1.legend()
    a1.grid(alpha=0.3)
    for k in sorted({k for r in rows for k in r.waits}):
        a2.plot(tqs, [r.waits.get(k, (math.nan,) * 3)[0] for r in rows], "o-", label=f"{k} p50")
        a2.plot(tqs, [r.waits.get(k, (math.nan,) * 3)[1] for r in rows], "^--", label=f"{k} p99")
        a2.plot(tqs, [r.waits.get(k, (math.nan,) * 3)[2] for r in rows], "v:", label=f"{k} max")
    a2.set_xscale("log")
    a2.set_xlabel("TQ (s)")
    a2.set_ylabel("wait of a burst (s)")
    a2.legend()
    a2.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def describe(workloads: Sequence[Workload], capacity: int, settings: GpuSettings) -> str:
    ws = ", ".join(f"{w.kind} {format_size(w.memory)}" for w in workloads)
    return (
        f"{ws} on {format_size(capacity)}; mode {settings.mode}, policy {settings.policy},"
        f" prefetch {'on' if settings.prefetch else 'off'}, turn {settings.turn_s:g} s"
    )

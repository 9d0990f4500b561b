"""Simulated workloads for the demo, the tests and the benchmarks.

Each is a real process with a real session on a simulated GPU: its memory is real bytes
with a known pattern, verified after every grant, so a swap that lost or mixed up bytes
shows. Run one with ``python -m gpushare.tools.workloads batch|interactive ...``; it prints one
JSON line with its figures.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

from gpushare.client.session import Session, attach
from gpushare.client.swap.sim import SimBackend, SimMemory
from gpushare.units import parse_size

STEP_S = 0.01  # one simulated GPU step


def _memory(s: Session, nbytes: int, seed: int) -> SimMemory:
    assert isinstance(s.backend, SimBackend), "simulated workloads need the sim backend"
    with s.gpu():
        m = s.backend.allocate(nbytes)
        m.fill(seed)
    return m


class TimeUp(Exception):
    """SIGTERM: the run's time is up (the demo ends every workload at its one deadline,
    whatever it is doing, waiting for its turn included)."""


_checkers: list[_Checker] = []  # this process's: their figures are reported at TimeUp


class _Checker:
    """Verifies the pattern whenever the session got a new lease (others ran meanwhile),
    and counts the workload's steps."""

    def __init__(self, s: Session, m: SimMemory, seed: int) -> None:
        self.s, self.m, self.seed = s, m, seed
        self.seen = s.grants
        self.checks = 0
        self.failures = 0
        self.steps = 0
        self.extra: SimMemory | None = None  # a burst's memory past the request, while held
        self.cache: SimMemory | None = None  # discardable: rebuilt when it was dropped
        self.cache_drops = 0
        self.rebuilds = 0
        _checkers.append(self)

    def figures(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "checks": self.checks,
            "failures": self.failures,
            "rebuilds": self.rebuilds,
        }

    def __call__(self) -> None:
        if self.s.grants != self.seen:
            self.seen = self.s.grants
            self.checks += 1
            if not self.m.verify(self.seed):
                self.failures += 1
            if self.extra is not None and not self.extra.verify(self.seed + 1):
                self.failures += 1
            if self.cache is not None:
                if self.cache.drops != self.cache_drops:  # dropped: made again, empty
                    self.cache_drops = self.cache.drops
                    self.rebuilds += 1
                    self.cache.fill(self.seed + 2)
                elif not self.cache.verify(self.seed + 2):
                    self.failures += 1

    def grow(self, nbytes: int) -> None:
        """Allocate ``nbytes`` more (inside the burst: past a lent bound it waits for
        room), with a pattern of its own."""
        self.extra = self.s.backend.allocate(nbytes)  # type: ignore[attr-defined]
        self.extra.fill(self.seed + 1)

    def shrink(self) -> None:
        if self.extra is not None:
            if not self.extra.verify(self.seed + 1):
                self.failures += 1
            self.extra.free()
            self.extra = None


def _turn_s(s: Session) -> float:
    """How long a yield may wait for the next turn, about: near the end, a workload ends
    its burst instead of waiting past its deadline."""
    return 2 * (s.tq_s or 1.0)


@dataclass(frozen=True)
class Burst:
    """A batch job's stretch past its request: ``extra`` bytes more from ``at`` seconds
    into the run, for ``seconds`` (then freed, its pattern checked)."""

    extra: int = 0
    at: float = 0.0
    seconds: float = 0.0
    cache: int = 0  # discardable memory besides (a server's KV cache), rebuilt when dropped


def batch(
    s: Session,
    seconds: float,
    memory: int,
    seed: int,
    deadline: bool = False,
    burst: Burst = Burst(),
) -> dict[str, Any]:
    """One long burst of steps until time is up, yielding at checkpoints when revoked;
    with ``deadline`` (``--until``), ending the burst rather than waiting past the end;
    with a ``burst``, growing past its memory for a while."""
    m = _memory(s, memory, seed)
    check = _Checker(s, m, seed)
    if burst.cache:
        with s.gpu():
            check.cache = s.backend.allocate(burst.cache, discardable=True)  # type: ignore[attr-defined]
            check.cache.fill(seed + 2)
    start = time.monotonic()
    end = start + seconds
    grown = False
    with s.gpu():
        while time.monotonic() < end:
            t = time.monotonic() - start
            if burst.extra and not grown and t >= burst.at:
                check.grow(burst.extra)
                grown = True
            elif check.extra is not None and t >= burst.at + burst.seconds:
                check.shrink()
            check()
            time.sleep(STEP_S)
            check.steps += 1
            if deadline and s._revoked and end - time.monotonic() < _turn_s(s):
                break  # the burst ends here, the lease goes back: no wait past the end
            s.checkpoint()
    return check.figures()


def interactive(
    s: Session, seconds: float, memory: int, seed: int, deadline: bool = False
) -> dict[str, Any]:
    """Short bursts (a notebook cell) with think time between them; with ``deadline``, no
    burst that could wait past the end."""
    rng = random.Random(seed)
    m = _memory(s, memory, seed)
    check = _Checker(s, m, seed)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if deadline and end - time.monotonic() < _turn_s(s):  # it could wait past the end
            time.sleep(max(0.0, end - time.monotonic()))
            break
        with s.gpu():
            check()
            for _ in range(rng.randint(10, 30)):
                time.sleep(STEP_S)
                check.steps += 1
                if deadline and s._revoked and end - time.monotonic() < _turn_s(s):
                    break
                s.checkpoint()
        time.sleep(max(0.0, min(rng.uniform(0.5, 1.5), end - time.monotonic())))
    return check.figures()


def short(
    s: Session, seconds: float, memory: int, seed: int, bursts: int | None = None
) -> dict[str, Any]:
    """Short bursts back to back (``with s.gpu():`` around 100 ms of work, a loop); with
    ``bursts``, that many (``seconds`` then only bounds the run)."""
    m = _memory(s, memory, seed)
    check = _Checker(s, m, seed)
    end = time.monotonic() + seconds
    done = 0
    while time.monotonic() < end and (bursts is None or done < bursts):
        done += 1
        with s.gpu():
            check()
            for _ in range(10):
                time.sleep(STEP_S)
                check.steps += 1
                s.checkpoint()
    return check.figures()


def cycles(s: Session, seconds: float, memory: int, seed: int, bursts: int = 100) -> dict[str, Any]:
    """Many short bursts, each a swap cycle when another session waits: between bursts it
    stays away for the node's ``idle_release`` (over half of it), so its quantum does not
    wait for it (docs/scheduling.md) and the GPU goes to the other (nodes that test swap
    cycles run with a short ``--idle-release``)."""
    m = _memory(s, memory, seed)
    check = _Checker(s, m, seed)
    end = time.monotonic() + seconds
    for i in range(bursts):
        if time.monotonic() > end:
            break
        if i:
            time.sleep(s.idle_release_s)
        with s.gpu():
            check()
    return check.figures()


KINDS = {"batch": batch, "interactive": interactive, "short": short, "cycles": cycles}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gpushare.tools.workloads")
    ap.add_argument("kind", choices=sorted(KINDS))
    ap.add_argument("--socket", required=True)
    ap.add_argument("--memory", default="30GiB")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument(
        "--until", type=float, help="stop at this Unix time instead (the demo's one deadline)"
    )
    ap.add_argument("--name", default="")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--bursts", type=int, default=None, help="cycles (100), short (no end): how many bursts"
    )
    ap.add_argument("--weight", type=float, default=None, help="under policy weighted")
    ap.add_argument("--memory-limit", default=None, help="the limit, when above --memory")
    ap.add_argument("--allocate", default=None, help="what it allocates (default --memory)")
    ap.add_argument("--grow", default="0", help="batch: allocate this much more, at --grow-at")
    ap.add_argument("--grow-at", type=float, default=0.0, help="batch: seconds into the run")
    ap.add_argument("--grow-for", type=float, default=0.0, help="batch: seconds it is kept")
    ap.add_argument(
        "--discardable", default="0", help="batch: this much more as a discardable cache"
    )
    a = ap.parse_args(argv)
    if a.until is not None:  # however late this process started, all end together
        a.seconds = max(0.0, a.until - time.time())
    memory = parse_size(a.memory)
    allocated = parse_size(a.allocate) if a.allocate else memory

    def time_up(_sig: int, _frame: object) -> None:
        raise TimeUp

    signal.signal(signal.SIGTERM, time_up)
    s = attach(
        memory=memory,
        memory_limit=a.memory_limit,
        socket=a.socket,
        name=a.name or a.kind,
        weight=a.weight,
    )
    try:
        if a.kind == "cycles":
            out = cycles(s, a.seconds, allocated, a.seed, 100 if a.bursts is None else a.bursts)
        elif a.kind == "batch":
            grow = Burst(parse_size(a.grow), a.grow_at, a.grow_for, parse_size(a.discardable))
            out = batch(s, a.seconds, allocated, a.seed, a.until is not None, grow)
        elif a.kind == "short":
            out = short(s, a.seconds, allocated, a.seed, a.bursts)
        else:
            out = interactive(s, a.seconds, allocated, a.seed, deadline=a.until is not None)
    except TimeUp:  # stopped where it was: what it did until then
        out = _checkers[-1].figures() if _checkers else {"steps": 0, "checks": 0, "failures": 0}
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # nothing more interrupts the close
        s.close()
    waits = s.waits[1:] or [0.0]  # the first grant is the allocation's
    out.update(
        name=s.name,
        session=s.id,
        kind=a.kind,
        bursts=s.bursts,
        grants=s.grants,
        wait_mean_s=sum(waits) / len(waits),
        wait_max_s=max(waits),
        grows=s._lease.grows,
    )
    print(json.dumps(out), flush=True)
    return 1 if out["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())

"""What a lease tells its node: each message with the figures the session's memory has
now, the numbering of its asks (a grant names the ask it answers), and what the node
heard last (so a new connection is told only what changed)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from gpushare import protocol as p

Figures = tuple[int, int, int]  # resident, swapped, discarded bytes
MAX_ERROR = 1000  # characters of a swap's error sent: the node takes no more than 1024


class Messages:
    def __init__(self, figures: Callable[[], Figures]) -> None:
        self.figures = figures
        self.asks = 0  # asks numbered so far (Acquire, Release again)
        self.told: Figures = (0, 0, 0)  # what this connection heard last

    def heard(self, hello: p.Hello) -> None:
        """A new connection's hello told these figures."""
        self.told = hello.resident, hello.swapped, hello.discarded

    def changed(self) -> bool:
        """Memory moved since the node last heard."""
        return self.figures() != self.told

    def report(self) -> p.Report:
        self.told = resident, swapped, discarded = self.figures()
        return p.Report(resident=resident, swapped=swapped, discarded=discarded)

    def acquire(self) -> p.Acquire:
        self.asks += 1
        return p.Acquire(ask=self.asks)

    def release(
        self, again: bool = False, swapping_out: int = 0, need: int = 0, idle_s: float = 0.0
    ) -> p.Release:
        self.told = resident, swapped, discarded = self.figures()
        if again:
            self.asks += 1
        return p.Release(
            resident=resident,
            swapped=swapped,
            discarded=discarded,
            again=again,
            swapping_out=swapping_out,
            ask=self.asks if again else 0,
            need=need,
            idle_s=idle_s,
        )

    def swap_done(
        self,
        direction: Literal["in", "out"],
        nbytes: int,
        seconds: float,
        error: str = "",
        prefetch: int = 0,
    ) -> p.SwapDone:
        self.told = resident, swapped, discarded = self.figures()
        return p.SwapDone(
            direction=direction,
            bytes=nbytes,
            seconds=seconds,
            resident=resident,
            swapped=swapped,
            discarded=discarded,
            error=error[:MAX_ERROR],
            prefetch=prefetch,
        )

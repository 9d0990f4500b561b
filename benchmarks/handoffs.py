"""What the benchmarks share: handoffs from client timestamps, and percentiles."""

from __future__ import annotations


def handoffs(bursts: list[tuple[float, float, float]]) -> list[float]:
    """Seconds from a holder's release to the next grant, for grants to sessions that
    were already waiting then. ``bursts``: (asked, granted, released) per burst, all on
    one GPU, read from CLOCK_MONOTONIC (shared by all processes)."""
    grants = sorted((g, ask) for ask, g, _ in bursts)
    releases = sorted(r for _, _, r in bursts)
    out = []
    j = 0
    for g, ask in grants[1:]:
        while j + 1 < len(releases) and releases[j + 1] <= g:
            j += 1
        if ask < releases[j] <= g:  # the latest release before the grant
            out.append(g - releases[j])
    return out


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

"""Fixtures of the core's tests: time is a test input."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gpushare.core.arbiter import Arbiter
from gpushare.core.clock import ManualClock


@pytest.fixture(scope="package", autouse=True)
def _check_every_input() -> Iterator[None]:
    """Here every arbiter (the model's too) checks its running totals and deadline
    structures against scans of every session after every input: the core's tests are
    where a drift would show first. Elsewhere (nodes, clients) it is off, as in
    production: those checks are quadratic and made the suite minutes longer."""
    before = Arbiter.check_every_input
    Arbiter.check_every_input = True
    yield
    Arbiter.check_every_input = before


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()

"""Fixtures of the core's tests: time is a test input."""

from __future__ import annotations

import pytest

from gpushare.core.clock import ManualClock


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()

"""Client tests: gpushare's allocator library, which ``gpushare run`` builds for the
command's LD_PRELOAD, is built once per test session in a folder of its own."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def _shim_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("gpushare-cache"))


@pytest.fixture(autouse=True)
def _private_shim_cache(_shim_cache: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUSHARE_CACHE", _shim_cache)
    monkeypatch.delenv("GPUSHARE_SHIM", raising=False)

"""Client tests: gpushare's allocator library, which ``gpushare run`` builds for the
command's LD_PRELOAD, is built once per test session in a folder of its own."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def _shim_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("gpushare-cache"))


@pytest.fixture(autouse=True)
def _private_shim_cache(
    _shim_cache: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    monkeypatch.setenv("GPUSHARE_CACHE", _shim_cache)
    # A prebuilt library is kept for the GPU tests: the GPU machine may have no C
    # compiler, and the GPU check carries one there (benchmarks/gpu_check.sh).
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.delenv("GPUSHARE_SHIM", raising=False)

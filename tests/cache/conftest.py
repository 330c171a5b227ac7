"""Fixtures of the cache tests; the shared helpers live in ``cache_helpers``."""

from __future__ import annotations

import pytest
from cache_helpers import FakeClock

from tests.conftest import ENGINE_CORES, use_engine_core


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Every test function runs on both cores (see ``tests/conftest.py``)."""
    if "engine_core" in metafunc.fixturenames:
        metafunc.parametrize(
            "engine_core", ENGINE_CORES, indirect=True, ids=lambda core: f"core={core}"
        )


@pytest.fixture(autouse=True)
def engine_core(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str | None:
    return use_engine_core(request, monkeypatch)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()

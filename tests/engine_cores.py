"""Run every test of a folder on both cores of the cache engine: a folder's conftest imports
``pytest_generate_tests`` and ``engine_core`` from here (see ``ENGINE_CORES`` in
``tests/conftest.py``)."""

from __future__ import annotations

import pytest

from tests.conftest import ENGINE_CORES, use_engine_core


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Every test function runs on both cores."""
    if "engine_core" in metafunc.fixturenames:
        metafunc.parametrize(
            "engine_core", ENGINE_CORES, indirect=True, ids=lambda core: f"core={core}"
        )


@pytest.fixture(autouse=True)
def engine_core(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str | None:
    return use_engine_core(request, monkeypatch)

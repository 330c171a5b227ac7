"""Fixtures of the cache tests, which run on both cores of the engine
(``tests/engine_cores.py``); the shared helpers live in ``cache_helpers``."""

from __future__ import annotations

import pytest
from cache_helpers import FakeClock

from tests.engine_cores import engine_core, pytest_generate_tests

__all__ = ["clock", "engine_core", "pytest_generate_tests"]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()

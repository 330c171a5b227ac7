"""Fixtures of the cache tests; the shared helpers live in ``cache_helpers``."""

from __future__ import annotations

import pytest
from cache_helpers import FakeClock


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()

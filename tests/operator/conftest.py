"""Fixtures of the operator unit tests."""

from __future__ import annotations

from typing import Any

import pytest
from kvp_cases import pool_manifest


@pytest.fixture
def pool_body() -> dict[str, Any]:
    """A fresh copy of a valid pool manifest (edit it freely)."""
    return pool_manifest()

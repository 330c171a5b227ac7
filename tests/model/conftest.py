"""Every test here runs torch single-threaded (``single_torch_thread`` in tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _single_torch_thread(single_torch_thread: None) -> None:
    """Applies the shared fixture to every test of this folder."""

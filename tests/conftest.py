"""Fixtures shared across test folders (each folder's conftest decides whether to use them)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture
def single_torch_thread() -> Iterator[None]:
    """Small tensors run fastest single-threaded: on a shared, loaded machine torch's intra-op
    thread pool turns microsecond matmuls into milliseconds of spinning."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

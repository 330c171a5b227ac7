"""Small tensors run fastest single-threaded: on a shared, loaded machine torch's intra-op
thread pool turns microsecond matmuls into milliseconds of spinning."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

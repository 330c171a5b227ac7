"""The tensor frame: lossless round trip; every damaged frame is refused with the field named."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool_agent.server.payload import DTYPE_CODES, PayloadError, decode_tensor, encode_tensor

DTYPES = [d for d in DTYPE_CODES if d not in (torch.float8_e4m3fn,)]


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(DTYPES),
    st.lists(st.integers(0, 5), min_size=0, max_size=5),
    st.integers(0, 2**32 - 1),
)
def test_roundtrip(dtype: torch.dtype, shape: list[int], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(shape, generator=g) * 50).to(dtype)
    back = decode_tensor(encode_tensor(t))
    assert back.dtype == dtype and back.shape == t.shape and torch.equal(back, t)


def test_fp8_roundtrip() -> None:
    t = torch.linspace(-4, 4, 64).to(torch.float8_e4m3fn).view(4, 16)
    assert torch.equal(decode_tensor(encode_tensor(t)).view(torch.uint8), t.view(torch.uint8))


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_any_single_byte_change_or_truncation_is_refused(data: st.DataObject) -> None:
    frame = encode_tensor(torch.arange(24, dtype=torch.float32).view(2, 3, 4))
    if data.draw(st.booleans()):
        cut = data.draw(st.integers(0, len(frame) - 1))
        damaged = frame[:cut]
    else:
        i = data.draw(st.integers(0, len(frame) - 1))
        flip = data.draw(st.integers(1, 255))
        damaged = frame[:i] + bytes([frame[i] ^ flip]) + frame[i + 1 :]
    with pytest.raises(PayloadError):
        decode_tensor(damaged)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_garbage_is_refused(blob: bytes) -> None:
    with pytest.raises(PayloadError):
        decode_tensor(blob)

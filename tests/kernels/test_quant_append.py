"""fp8/int8 round-trip error bounds and exactness of KV appends."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool_kernels import (
    PagedKvTable,
    append_kv,
    append_slots,
    dequantize,
    new_pool,
    quantize,
    scale_for,
)

finite = st.floats(-1e4, 1e4, allow_nan=False, allow_infinity=False, width=32)
scales = st.floats(1e-3, 1e2, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(st.lists(finite, min_size=1, max_size=64), scales)
def test_fp8_roundtrip_within_half_ulp(values: list[float], scale: float) -> None:
    """e4m3 keeps 3 mantissa bits: relative error <= 2^-4, or 2^-10 * scale when subnormal."""
    x = torch.tensor(values, dtype=torch.float32)
    back = dequantize(quantize(x, torch.float8_e4m3fn, scale), scale)
    in_range = x.abs() <= 448 * scale
    bound = torch.maximum(x.abs() * 2**-4, torch.full_like(x, scale * 2**-10)) * (1 + 1e-6)
    assert bool(((back - x).abs() <= bound)[in_range].all())
    # Out of range values saturate to the largest finite value with the right sign.
    sat = back[~in_range]
    assert torch.equal(sat, torch.sign(x[~in_range]) * 448 * torch.tensor(scale).float())


@settings(max_examples=200, deadline=None)
@given(st.lists(finite, min_size=1, max_size=64), scales)
def test_int8_roundtrip_within_half_step(values: list[float], scale: float) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    stored = quantize(x, torch.int8, scale)
    assert stored.dtype == torch.int8
    assert int(stored.abs().max()) <= 127
    back = dequantize(stored, scale)
    in_range = x.abs() <= 127 * scale
    assert bool(((back - x).abs() <= scale * 0.5 * (1 + 1e-5) + 1e-6)[in_range].all())


def test_quantize_follows_inverse_scale_convention() -> None:
    """stored = value * (1 / scale); read = stored * scale."""
    x = torch.tensor([2.0, -3.0, 0.5])
    assert quantize(x, torch.int8, 0.5).tolist() == [4, -6, 1]
    assert dequantize(torch.tensor([4, -6, 1], dtype=torch.int8), 0.5).tolist() == [2.0, -3.0, 0.5]
    assert quantize(x, torch.float8_e4m3fn, 0.25).float().tolist() == [8.0, -12.0, 2.0]


def test_scale_for_maps_absmax_to_range_top() -> None:
    x = torch.tensor([-254.0, 3.0])
    assert scale_for(x, torch.int8) == pytest.approx(2.0)
    assert scale_for(x, torch.float8_e4m3fn) == pytest.approx(254.0 / 448)
    assert scale_for(x, torch.float16) == 1.0


@pytest.mark.parametrize("scale", [0.0, -1.0, float("inf"), float("nan")])
def test_quantize_rejects_bad_scale(scale: float) -> None:
    with pytest.raises(ValueError, match="scale"):
        quantize(torch.ones(2), torch.int8, scale)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_append_is_bit_exact_and_lands_in_its_slots(layout: str, dtype: torch.dtype) -> None:
    page, heads, dim = 4, 2, 8
    table = PagedKvTable.from_block_lists([[5, 2, 7], [0]], [10, 3], page)
    cache = new_pool(1, 8, page, heads, dim, dtype=dtype, layout=layout)[0]
    k = torch.randn(13, heads, dim).to(dtype)
    v = torch.randn(13, heads, dim).to(dtype)
    slots = append_slots(table, [10, 3])
    assert slots.tolist() == [20, 21, 22, 23, 8, 9, 10, 11, 28, 29, 0, 1, 2]
    append_kv(cache, k, v, slots, layout=layout)
    nhd = cache if layout == "NHD" else cache.transpose(2, 3)
    flat_k = nhd[:, 0].reshape(-1, heads, dim)
    flat_v = nhd[:, 1].reshape(-1, heads, dim)
    assert torch.equal(flat_k[slots], k)
    assert torch.equal(flat_v[slots], v)
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert not flat_k[untouched].any() and not flat_v[untouched].any()


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8])
def test_append_quantizes_on_write(dtype: torch.dtype) -> None:
    cache = new_pool(1, 2, 4, 1, 4, dtype=dtype)[0]
    k = torch.randn(3, 1, 4)
    v = torch.randn(3, 1, 4)
    slots = torch.tensor([1, 2, 6])
    append_kv(cache, k, v, slots, k_scale=0.05, v_scale=0.02)
    flat_k = cache[:, 0].reshape(-1, 1, 4)
    flat_v = cache[:, 1].reshape(-1, 1, 4)
    assert flat_k.view(torch.uint8)[slots].equal(quantize(k, dtype, 0.05).view(torch.uint8))
    assert flat_v.view(torch.uint8)[slots].equal(quantize(v, dtype, 0.02).view(torch.uint8))


def test_incremental_appends_equal_one_shot_write() -> None:
    """Prefill of 6 tokens then 3 single-token decode steps == writing all 9 tokens at once."""
    page, blocks = 4, [3, 1, 2]
    k = torch.randn(9, 2, 4).half()
    v = torch.randn(9, 2, 4).half()
    once = new_pool(1, 4, page, 2, 4)[0]
    t9 = PagedKvTable.from_block_lists([blocks], [9], page)
    append_kv(once, k, v, append_slots(t9, [9]))
    steps = new_pool(1, 4, page, 2, 4)[0]
    append_kv(
        steps, k[:6], v[:6], append_slots(PagedKvTable.from_block_lists([blocks], [6], page), [6])
    )
    for n in (7, 8, 9):
        t = PagedKvTable.from_block_lists([blocks], [n], page)
        append_kv(steps, k[n - 1 : n], v[n - 1 : n], append_slots(t, [1]))
    assert torch.equal(once, steps)


def test_append_validates_before_writing() -> None:
    cache = new_pool(1, 2, 4, 1, 4)[0]
    k = torch.ones(2, 1, 4).half()
    with pytest.raises(IndexError, match="slot 8"):
        append_kv(cache, k, k, torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="k: expected shape"):
        append_kv(cache, k[:, :, :2], k, torch.tensor([0, 1]))
    assert not cache.any()


@pytest.mark.parametrize(
    ("blocks", "lens", "last", "match"),
    [
        ([[1]], [0], None, "block_ids"),
        ([[1]], [5], None, "block_ids"),
        ([[1, 2]], [5, 1], None, "kv_lens"),
        ([[1]], [4], [5], "kv_last_page_len"),
    ],
)
def test_table_validation(blocks: list, lens: list, last: list | None, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        if last is None:
            PagedKvTable.from_block_lists(blocks, lens, 4)
        else:
            PagedKvTable(
                torch.tensor([0, 1], dtype=torch.int32),
                torch.tensor([1], dtype=torch.int32),
                torch.tensor(last, dtype=torch.int32),
                4,
            )

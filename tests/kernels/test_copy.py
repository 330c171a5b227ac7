"""Batched block copies: within a pool, between pools, prefixes, validation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool_kernels import copy as copy_module
from kvpool_kernels import copy_block_prefix, copy_block_prefixes, copy_blocks, new_pool
from kvpool_kernels.copy import chunk_ids


def pool(
    num_blocks: int = 8, dtype: torch.dtype = torch.float16, layout: str = "NHD"
) -> torch.Tensor:
    p = new_pool(3, num_blocks, 4, 2, 8, dtype=torch.float32, layout=layout)
    return torch.randn(p.shape).to(dtype)


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_copy_blocks_matches_a_per_block_loop(data: st.DataObject) -> None:
    src_n = data.draw(st.integers(1, 10))
    dst_n = data.draw(st.integers(1, 10))
    n = data.draw(st.integers(0, min(src_n, dst_n)))
    src_ids = data.draw(st.lists(st.integers(0, src_n - 1), min_size=n, max_size=n))
    dst_ids = data.draw(st.permutations(range(dst_n)))[:n]
    dtype = data.draw(st.sampled_from([torch.float16, torch.float8_e4m3fn, torch.int8]))
    src, dst = pool(src_n, dtype), pool(dst_n, dtype)
    expected = dst.clone()
    for s, d in zip(src_ids, dst_ids, strict=True):
        expected[:, d] = src[:, s]
    copy_blocks(src, dst, src_ids, torch.tensor(dst_ids, dtype=torch.int32))
    assert torch.equal(dst.view(torch.uint8), expected.view(torch.uint8))


def test_copy_within_a_pool_reads_before_it_writes() -> None:
    p = pool()
    before = p.clone()
    copy_blocks(p, p, [0, 1, 2], [1, 2, 3])  # overlapping chains shift by one
    for s, d in ((0, 1), (1, 2), (2, 3)):
        assert torch.equal(p[:, d], before[:, s])
    assert torch.equal(p[:, 0], before[:, 0])
    assert torch.equal(p[:, 4:], before[:, 4:])


def test_offload_and_onboard_round_trip_on_cpu() -> None:
    device, host = pool(8), pool(5)
    copy_blocks(device, host, [6, 1, 3], [0, 4, 2])
    wiped = torch.zeros_like(device)
    copy_blocks(host, wiped, [0, 4, 2], [6, 1, 3])
    for b in (6, 1, 3):
        assert torch.equal(wiped[:, b], device[:, b])
    assert not wiped[:, [0, 2, 4, 5, 7]].any()


@pytest.mark.parametrize(
    ("src_ids", "dst_ids", "err", "match"),
    [
        ([0, 8], [0, 1], IndexError, "src_ids: block id 8"),
        ([0], [-1], IndexError, "dst_ids: block id -1"),
        ([0, 1], [2], ValueError, "length mismatch"),
        ([0, 1], [2, 2], ValueError, "distinct"),
        ([0.5], [1], ValueError, "ints"),
        ([True], [1], ValueError, "ints"),
        (torch.tensor([[0]]), [1], ValueError, "1-D"),
        (torch.tensor([0.0]), [1], ValueError, "integer tensor"),
    ],
)
def test_copy_blocks_validates_before_writing(
    src_ids: object, dst_ids: object, err: type[Exception], match: str
) -> None:
    p = pool()
    before = p.clone()
    with pytest.raises(err, match=match):
        copy_blocks(p, p, src_ids, dst_ids)
    assert torch.equal(p, before)


def test_copy_blocks_accepts_numpy_and_tensor_ids() -> None:
    import numpy as np

    p = pool()
    before = p.clone()
    copy_blocks(p, p, np.array([1, 2]), torch.tensor([5, 6], dtype=torch.int32))
    assert torch.equal(p[:, 5:7], before[:, 1:3])


def test_copy_blocks_rejects_mismatched_pools() -> None:
    with pytest.raises(ValueError, match="dtype"):
        copy_blocks(pool(), pool(dtype=torch.float32), [0], [0])
    with pytest.raises(ValueError, match="shapes"):
        copy_blocks(pool(), pool(layout="HND"), [0], [0])


def test_copy_blocks_names_the_ways_across_the_link() -> None:
    src, dst = pool(), pool()
    before = dst.clone()
    with pytest.raises(ValueError, match="via: must be auto, direct or staged"):
        copy_blocks(src, dst, [0], [1], via="dma")  # type: ignore[arg-type]
    assert torch.equal(dst, before)
    assert copy_module.device_alias(src, torch.device("cpu")) is None


@pytest.mark.parametrize(("layout", "token_dim"), [("NHD", 3), ("HND", 4)])
def test_copy_block_prefixes_copies_only_leading_tokens(layout: str, token_dim: int) -> None:
    p = pool(layout=layout, dtype=torch.float8_e4m3fn)
    before = p.clone()
    copy_block_prefixes(p, [2, 5, 1], [6, 0, 7], [1, 4, 0], token_dim=token_dim)
    raw, old = p.view(torch.uint8), before.view(torch.uint8)
    for s, d, n in ((2, 6, 1), (5, 0, 4), (1, 7, 0)):
        head = [slice(None)] * 4
        head[token_dim - 2] = slice(0, n)
        tail = list(head)
        tail[token_dim - 2] = slice(n, None)
        assert torch.equal(
            raw[:, d][tuple([slice(None), *head])], old[:, s][tuple([slice(None), *head])]
        )
        assert torch.equal(
            raw[:, d][tuple([slice(None), *tail])], old[:, d][tuple([slice(None), *tail])]
        )
    assert torch.equal(raw[:, [1, 2, 3, 4, 5]], old[:, [1, 2, 3, 4, 5]])


def test_copy_block_prefix_single_and_validation() -> None:
    p = pool()
    before = p.clone()
    copy_block_prefix(p, 3, 4, 2)
    assert torch.equal(p[:, 4, :, :2], before[:, 3, :, :2])
    assert torch.equal(p[:, 4, :, 2:], before[:, 4, :, 2:])
    with pytest.raises(IndexError, match="num_tokens"):
        copy_block_prefix(p, 3, 4, 5)
    with pytest.raises(ValueError, match="token_dim"):
        copy_block_prefix(p, 3, 4, 1, token_dim=6)


def test_chunk_ids_bounds_each_transfer() -> None:
    s, d = torch.arange(10), torch.arange(10, 20)
    chunks = chunk_ids(s, d, block_bytes=100, chunk_bytes=350)
    assert [c[0].tolist() for c in chunks] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert torch.equal(torch.cat([c[1] for c in chunks]), d)
    assert len(chunk_ids(s, d, block_bytes=1000, chunk_bytes=10)) == 10  # one block minimum


def test_chunked_onboard_pipeline_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The staged, chunked path (used between CPU and CUDA) places every block correctly."""
    monkeypatch.setattr(copy_module, "CHUNK_BYTES", 3 * pool()[:, 0].numel() * 2)
    src, dst = pool(8), pool(10)
    expected = dst.clone()
    s, d = [7, 0, 3, 3, 5, 1, 2], [9, 0, 1, 2, 8, 4, 5]
    for a, b in zip(s, d, strict=True):
        expected[:, b] = src[:, a]
    copy_module._onboard(src, dst, torch.tensor(s), torch.tensor(d))
    assert torch.equal(dst, expected)

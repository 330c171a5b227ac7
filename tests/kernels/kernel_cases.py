"""Random paged batches and an independent dense oracle for the kernel tests."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvpool_kernels import PagedKvTable, append_kv, append_slots, dequantize, new_pool, scale_for
from kvpool_kernels.layout import KvLayout


@dataclass
class PagedBatch:
    """A batch written into one layer's paged cache, with the dense K/V it should hold."""

    cache: torch.Tensor
    table: PagedKvTable
    qo_indptr: torch.Tensor
    q: torch.Tensor
    keys: list[torch.Tensor]  # dense float64 [kv_len, kv_heads, dim], as stored (dequantized)
    values: list[torch.Tensor]
    k_scale: float
    v_scale: float


def make_batch(
    kv_lens: list[int],
    qo_lens: list[int],
    *,
    page_size: int,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    kv_dtype: torch.dtype,
    q_dtype: torch.dtype = torch.float32,
    layout: KvLayout = "NHD",
    seed: int = 0,
    device: str = "cpu",
    spare_pages: int = 3,
) -> PagedBatch:
    """Scatter random sequences over shuffled pages of a fresh cache through ``append_kv``."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-n // page_size) for n in kv_lens]
    total = sum(pages_per_seq) + spare_pages
    order = torch.randperm(total, generator=gen).tolist()
    block_lists, start = [], 0
    for n in pages_per_seq:
        block_lists.append(order[start : start + n])
        start += n
    table = PagedKvTable.from_block_lists(block_lists, kv_lens, page_size, device=device)
    k = torch.randn(sum(kv_lens), num_kv_heads, head_dim, generator=gen)
    v = torch.randn(sum(kv_lens), num_kv_heads, head_dim, generator=gen)
    k_scale, v_scale = scale_for(k, kv_dtype), scale_for(v, kv_dtype)
    cache = new_pool(1, total, page_size, num_kv_heads, head_dim, dtype=kv_dtype, layout=layout)
    cache = cache[0].to(device)
    # Fill the unused slots with garbage so that reading past kv_len would show up.
    cache.view(torch.uint8).copy_(torch.randint(0, 50, cache.view(torch.uint8).shape))
    slots = append_slots(table, kv_lens)
    append_kv(
        cache, k.to(device), v.to(device), slots, layout=layout, k_scale=k_scale, v_scale=v_scale
    )
    # What the cache holds, read back densely without any paging code.
    kq = dequantize(_roundtrip(k, kv_dtype, k_scale), k_scale, torch.float64)
    vq = dequantize(_roundtrip(v, kv_dtype, v_scale), v_scale, torch.float64)
    bounds = [0, *torch.cumsum(torch.tensor(kv_lens), 0).tolist()]
    keys = [kq[bounds[i] : bounds[i + 1]] for i in range(len(kv_lens))]
    values = [vq[bounds[i] : bounds[i + 1]] for i in range(len(kv_lens))]
    qo_indptr = torch.tensor([0, *torch.cumsum(torch.tensor(qo_lens), 0).tolist()])
    q = torch.randn(sum(qo_lens), num_qo_heads, head_dim, generator=gen).to(device, q_dtype)
    return PagedBatch(cache, table, qo_indptr.to(torch.int32), q, keys, values, k_scale, v_scale)


def _roundtrip(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    from kvpool_kernels import quantize

    return quantize(x, dtype, scale)


def dense_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    *,
    causal: bool = True,
    window_left: int = -1,
    q_scaling: float = 1.0,
    logits_soft_cap: float = 0.0,
    sink_tokens: int = 0,
) -> torch.Tensor:
    """Plain attention of one sequence in float64, mask built token by token.

    ``q`` ``[qo_len, qo_heads, dim]`` holds the last ``qo_len`` positions of the sequence.
    """
    qo_len, hq, dim = q.shape
    kv_len, hkv, _ = keys.shape
    group = hq // hkv
    out = torch.zeros(qo_len, hq, dim, dtype=torch.float64)
    scale = 1.0 / (q_scaling * math.sqrt(dim))
    allowed = torch.zeros(qo_len, kv_len, dtype=torch.bool)
    for i in range(qo_len):
        pos = kv_len - qo_len + i
        for j in range(kv_len):
            ok = j <= pos or not causal
            if window_left >= 0 and pos - j > window_left and j >= sink_tokens:
                ok = False
            allowed[i, j] = ok
    for h in range(hq):
        kh, vh = keys[:, h // group], values[:, h // group]
        logits = q[:, h].double() @ kh.T * scale
        if logits_soft_cap > 0:
            logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
        logits[~allowed] = float("-inf")
        out[:, h] = torch.softmax(logits, dim=-1) @ vh
    return out

"""kvpool attention and cache-copy kernels: flashinfer on CUDA, a torch reference elsewhere.

Layout (agreed with the cache engine): a pool is one layer-major tensor
``[num_layers, num_blocks, 2, page_size, kv_heads, head_dim]`` (NHD; ``HND`` swaps
``page_size`` and ``kv_heads``), K at index 0 and V at index 1 of the ``2`` dim, so
``pool[layer]`` is a flashinfer paged cache. Block tables are flashinfer's CSR arrays
(``PagedKvTable``). fp8 (e4m3) and int8 caches store ``value * (1 / scale)`` with one scale
for K and one for V per pool; readers multiply by the scale.

API:

* ``copy_blocks(src, dst, src_ids, dst_ids)``: blocks ``src[:, src_ids] -> dst[:, dst_ids]``
  in one batched call, within a pool or between a CUDA pool and a pinned host pool;
  ``copy_block_prefixes`` copies the first tokens of blocks (copy-on-partial-reuse).
* ``append_kv(pool[layer], k, v, slots, k_scale=, v_scale=)`` writes new tokens' K/V, with
  ``append_slots(table, append_lens)`` giving the slots of the last tokens of each sequence.
* ``PagedAttention(backend="auto"|"torch"|"flashinfer", layout=...)``: ``plan(qo_indptr,
  kv_indptr, kv_indices, kv_last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
  causal=, window_left=, q_scaling=, logits_soft_cap=, sink_tokens=, q_dtype=, kv_dtype=)``
  then ``run(q, pool[layer], k_scale=, v_scale=)`` per layer. Batched prefill (packed, with
  cached prefixes) and decode; MHA/GQA/MQA; ``sm_scale = 1 / (q_scaling * sqrt(head_dim))``.

flashinfer is never imported at module import time; only a CUDA plan with the ``gpu`` extra
installed loads it.
"""

from .append import append_kv
from .attention import Backend, PagedAttention
from .copy import copy_block_prefix, copy_block_prefixes, copy_blocks
from .layout import KvLayout, PagedKvTable, append_slots, kv_cache_shape, new_pool
from .params import AttentionParams, AttentionPlan, window_left_for
from .quant import dequantize, quantize, scale_for
from .reference import reference_attention

__all__ = [
    "AttentionParams",
    "AttentionPlan",
    "Backend",
    "KvLayout",
    "PagedAttention",
    "PagedKvTable",
    "append_kv",
    "append_slots",
    "copy_block_prefix",
    "copy_block_prefixes",
    "copy_blocks",
    "dequantize",
    "kv_cache_shape",
    "new_pool",
    "quantize",
    "reference_attention",
    "scale_for",
    "window_left_for",
]

"""Batched attention over the cache for open sequences (``kvpool_kernels.PagedAttention``).

The queries of a sequence are its last ``q_len`` tokens; each attends (causally, within its
pool's window) to the KV the sequence's block table holds. flashinfer runs on CUDA, the torch
reference elsewhere; ``backend_in_use`` says which.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvpool_agent.cache import KVCacheManager, SequenceHandle
from kvpool_kernels import PagedAttention, window_left_for


class AttentionRequestError(ValueError):
    """A batch the cache cannot run: the message names the field."""


@dataclass(frozen=True)
class AttentionBatch:
    handles: tuple[SequenceHandle, ...]
    q_lens: tuple[int, ...]
    layer: int
    num_qo_heads: int
    causal: bool = True


def run_attention(
    engine: KVCacheManager, attention: PagedAttention, batch: AttentionBatch, q: torch.Tensor
) -> tuple[torch.Tensor, str]:
    """Output ``[sum(q_lens), num_qo_heads, head_dim]`` and the backend that computed it."""
    plan = engine.plan
    if not 0 <= batch.layer < len(plan.layer_pool):
        raise AttentionRequestError(
            f"layer: {batch.layer} is outside the model's {len(plan.layer_pool)} layers"
        )
    pool = plan.pools[plan.layer_pool[batch.layer]]
    if batch.num_qo_heads < 1 or batch.num_qo_heads % pool.kv_heads:
        raise AttentionRequestError(
            f"num_qo_heads: must be a positive multiple of the layer's {pool.kv_heads} kv heads"
        )
    tpb = plan.tokens_per_block
    indptr, indices, last, qo = [0], [], [], [0]
    for handle, q_len in zip(batch.handles, batch.q_lens, strict=True):
        kv_len = handle.num_tokens - handle.first_token[pool.index]
        if not 1 <= q_len <= kv_len:
            raise AttentionRequestError(
                f"q_lens: sequence {handle.seq_id} can take 1..{kv_len} query tokens, got {q_len}"
            )
        table = handle.block_tables[pool.index][: -(-kv_len // tpb)]
        indices.extend(table)
        indptr.append(len(indices))
        last.append((kv_len - 1) % tpb + 1)
        qo.append(qo[-1] + q_len)
    view = engine.pool_view(pool.index)
    expected = (qo[-1], batch.num_qo_heads, pool.head_dim)
    if tuple(q.shape) != expected:
        raise AttentionRequestError(f"q: expected shape {list(expected)}, got {list(q.shape)}")
    dev = view.device
    attention.plan(
        _ints(qo, dev),
        _ints(indptr, dev),
        _ints(indices, dev),
        _ints(last, dev),
        batch.num_qo_heads,
        pool.kv_heads,
        pool.head_dim,
        tpb,
        causal=batch.causal,
        window_left=window_left_for(pool.window),
        q_dtype=q.dtype,
        kv_dtype=view.dtype,
        device=dev,
    )
    local_layer = pool.layers.index(batch.layer)
    out = attention.run(q.to(dev), view[local_layer])
    return out.cpu(), attention.backend_in_use


def _ints(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int32, device=device)

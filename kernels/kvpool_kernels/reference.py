"""Torch reference backend: paged attention computed densely per sequence in float32.

Runs anywhere torch runs (CPU and CUDA) and supports every feature of ``AttentionParams``,
including fp8/int8 caches, sink tokens and per-head sink logits. It is the oracle the
flashinfer backend is tested against and the backend used on CPU-only machines.
"""

from __future__ import annotations

import torch

from .layout import layer_geometry
from .params import AttentionParams, AttentionPlan
from .quant import dequantize

__all__ = ["attention_mask", "gather_kv", "reference_attention"]


def gather_kv(
    kv_cache: torch.Tensor,
    pages: torch.Tensor,
    kv_len: int,
    params: AttentionParams,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one sequence as dense float32 ``[kv_len, kv_heads, head_dim]`` tensors."""
    raw = kv_cache.view(torch.uint8) if kv_cache.dtype == torch.float8_e4m3fn else kv_cache
    blocks = raw.index_select(0, pages.to(kv_cache.device, torch.int64))
    if raw is not kv_cache:
        blocks = blocks.view(kv_cache.dtype)
    if params.layout == "HND":
        blocks = blocks.transpose(2, 3)  # -> [pages, 2, page_size, heads, dim]
    k = blocks[:, 0].reshape(-1, params.num_kv_heads, params.head_dim)[:kv_len]
    v = blocks[:, 1].reshape(-1, params.num_kv_heads, params.head_dim)[:kv_len]
    return dequantize(k, k_scale), dequantize(v, v_scale)


def attention_mask(
    qo_len: int, kv_len: int, params: AttentionParams, device: torch.device
) -> torch.Tensor:
    """Boolean ``[qo_len, kv_len]``: True where query i may attend to key j."""
    q_pos = torch.arange(kv_len - qo_len, kv_len, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    allowed = torch.ones(qo_len, kv_len, dtype=torch.bool, device=device)
    if params.causal:
        allowed &= k_pos <= q_pos
    if params.window_left >= 0:
        in_window = k_pos >= q_pos - params.window_left
        if params.sink_tokens:
            in_window |= k_pos < params.sink_tokens
        allowed &= in_window
    return allowed


def reference_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    plan: AttentionPlan,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of packed ``q`` ``[tokens, qo_heads, head_dim]`` over one layer's paged cache.

    ``sinks`` (float ``[qo_heads]``) adds one virtual key per head whose logit is ``sinks[h]``
    and whose value is zero, as flashinfer's attention-sink variant does.
    """
    params = plan.params
    geo = layer_geometry(kv_cache, params.layout)
    if (geo.page_size, geo.num_kv_heads, geo.head_dim) != (
        params.page_size,
        params.num_kv_heads,
        params.head_dim,
    ):
        raise ValueError(
            f"kv_cache: page/heads/dim {(geo.page_size, geo.num_kv_heads, geo.head_dim)} do not "
            f"match the plan {(params.page_size, params.num_kv_heads, params.head_dim)}"
        )
    expected = (plan.num_qo_tokens, params.num_qo_heads, params.head_dim)
    if tuple(q.shape) != expected:
        raise ValueError(f"q: expected shape {expected}, got {tuple(q.shape)}")
    out = torch.empty_like(q)
    qo = plan.qo_indptr.cpu().tolist()
    ip = plan.table.kv_indptr.cpu().tolist()
    kv_lens = plan.table.kv_lens().tolist()
    for b in range(plan.table.batch_size):
        if qo[b + 1] == qo[b]:
            continue
        pages = plan.table.kv_indices[ip[b] : ip[b + 1]]
        k, v = gather_kv(kv_cache, pages, kv_lens[b], params, k_scale, v_scale)
        qb = q[qo[b] : qo[b + 1]].float()
        out[qo[b] : qo[b + 1]] = _dense(qb, k, v, params, sinks).to(q.dtype)
    return out


def _dense(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    params: AttentionParams,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Dense float32 attention of one sequence; ``q`` holds its last ``len(q)`` positions."""
    k = k.repeat_interleave(params.group_size, dim=1)
    v = v.repeat_interleave(params.group_size, dim=1)
    logits = torch.einsum("qhd,khd->hqk", q, k) * params.sm_scale
    if params.logits_soft_cap > 0:
        cap = params.logits_soft_cap
        logits = cap * torch.tanh(logits / cap)
    mask = attention_mask(q.shape[0], k.shape[0], params, q.device)
    logits = logits.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.to(logits).view(-1, 1, 1).expand(-1, q.shape[0], 1)
        probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(logits, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)

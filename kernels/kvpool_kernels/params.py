"""What one batched attention call computes: shapes, masking and scaling, validated once."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .layout import KvLayout, PagedKvTable, check_layout
from .quant import FULL_PRECISION, check_kv_dtype

__all__ = ["AttentionParams", "AttentionPlan", "window_left_for"]


def window_left_for(attention_window: int) -> int:
    """flashinfer's ``window_left`` for a window of ``attention_window`` tokens.

    TensorRT-LLM's ``attention_window_size = N`` attends to the last N tokens, the current one
    included; flashinfer's ``window_left = w`` attends to the last ``w + 1``. Returns ``-1``
    (full attention) for windows that cover any realistic sequence.
    """
    if attention_window <= 0:
        raise ValueError(f"attention_window: must be positive, got {attention_window}")
    return -1 if attention_window >= 1 << 31 else attention_window - 1


@dataclass(frozen=True)
class AttentionParams:
    """Per-layer attention settings, with the names of flashinfer's ``plan()``.

    ``sm_scale = 1 / (q_scaling * sqrt(head_dim))`` (TensorRT-LLM's norm factor).
    ``window_left = -1`` is full attention; ``w >= 0`` keeps the last ``w + 1`` keys of each query.
    ``logits_soft_cap > 0`` maps scaled logits ``s`` to ``cap * tanh(s / cap)``.
    ``sink_tokens`` (StreamingLLM) keeps the first keys of a sequence inside every window.
    """

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    causal: bool = True
    window_left: int = -1
    q_scaling: float = 1.0
    logits_soft_cap: float = 0.0
    sink_tokens: int = 0
    q_dtype: torch.dtype = torch.float16
    kv_dtype: torch.dtype = torch.float16
    layout: KvLayout = "NHD"

    def __post_init__(self) -> None:
        for name in ("num_qo_heads", "num_kv_heads", "head_dim", "page_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")
        if self.num_qo_heads % self.num_kv_heads:
            raise ValueError(
                f"num_qo_heads: {self.num_qo_heads} is not a multiple of "
                f"num_kv_heads {self.num_kv_heads}"
            )
        if self.window_left < -1:
            raise ValueError(f"window_left: must be -1 (full) or >= 0, got {self.window_left}")
        if not self.q_scaling > 0:
            raise ValueError(f"q_scaling: must be positive, got {self.q_scaling}")
        if self.logits_soft_cap < 0:
            raise ValueError(f"logits_soft_cap: must be >= 0, got {self.logits_soft_cap}")
        if self.sink_tokens < 0:
            raise ValueError(f"sink_tokens: must be >= 0, got {self.sink_tokens}")
        if self.q_dtype not in FULL_PRECISION:
            raise ValueError(f"q_dtype: must be float16, bfloat16 or float32, got {self.q_dtype}")
        check_kv_dtype(self.kv_dtype)
        check_layout(self.layout)

    @property
    def group_size(self) -> int:
        """Query heads per KV head: 1 for MHA, ``num_qo_heads`` for MQA."""
        return self.num_qo_heads // self.num_kv_heads

    @property
    def sm_scale(self) -> float:
        return 1.0 / (self.q_scaling * math.sqrt(self.head_dim))


@dataclass(frozen=True)
class AttentionPlan:
    """One batch: packed queries (``qo_indptr``) against paged KV (``table``).

    Query token ``i`` of sequence ``b`` sits at position ``kv_len[b] - qo_len[b] + i``: the new
    tokens are the last ones of their sequence and their K/V are already appended, so a cached
    prefix is simply ``kv_len - qo_len`` tokens that need no query rows.
    """

    params: AttentionParams
    qo_indptr: torch.Tensor
    table: PagedKvTable

    def __post_init__(self) -> None:
        qo = self.qo_indptr
        if qo.dim() != 1 or qo.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"qo_indptr: must be a 1-D int32 tensor, got {qo.dtype}")
        if qo.numel() != self.table.batch_size + 1:
            raise ValueError(
                f"qo_indptr: needs batch_size + 1 = {self.table.batch_size + 1} entries, "
                f"got {qo.numel()}"
            )
        if self.table.page_size != self.params.page_size:
            raise ValueError(
                f"page_size: table uses {self.table.page_size}, params {self.params.page_size}"
            )
        lens = self.qo_lens()
        if int(qo[0]) != 0 or bool((lens < 0).any()):
            raise ValueError("qo_indptr: must start at 0 and be non-decreasing")
        if bool((lens > self.table.kv_lens()).any()):
            raise ValueError("qo_indptr: a sequence has more query tokens than KV tokens")

    def qo_lens(self) -> torch.Tensor:
        qo = self.qo_indptr.cpu().long()
        return qo[1:] - qo[:-1]

    @property
    def num_qo_tokens(self) -> int:
        return int(self.qo_indptr[-1])

    @property
    def is_decode(self) -> bool:
        """Every sequence has exactly one query token."""
        return bool((self.qo_lens() == 1).all())

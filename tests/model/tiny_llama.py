"""A tiny random-weight Llama-style decoder that runs through the cache engine and kernels.

RoPE, grouped-query attention and alternating full / sliding-window layers, as in the models
kvpool serves. ``TinyLlama.dense_logits`` recomputes a whole sequence without any cache
(plain masked attention); ``CachedRunner`` runs the same weights over the paged cache: it
opens sequences in ``KVCacheManager`` (which finds reusable prefixes, onboards offloaded
blocks and hands back block tables), appends the new tokens' K/V with ``append_kv`` and runs
``PagedAttention`` per layer. Reuse is correct when both give the same logits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from kvpool_agent.cache import KVCacheManager, SequenceHandle
from kvpool_agent.config import FULL_ATTENTION
from kvpool_kernels import PagedAttention, PagedKvTable, append_kv, append_slots, window_left_for
from kvpool_kernels.attention import Backend


@dataclass(frozen=True)
class TinyLlamaConfig:
    vocab_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    windows: tuple[int, ...] = (FULL_ATTENTION, 12)
    """Attention window per layer, repeated over the layers (TensorRT-LLM's rule)."""
    rope_theta: float = 10_000.0
    rms_eps: float = 1e-6

    @property
    def hidden_size(self) -> int:
        return self.num_heads * self.head_dim

    def window(self, layer: int) -> int:
        return self.windows[layer % len(self.windows)]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama (GPT-NeoX style) rotary embedding of ``x`` ``[tokens, heads, dim]``."""
    dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, device=x.device).float() / dim)
    angles = positions.float()[:, None] * inv_freq[None, :]
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)[:, None, :]
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1)[:, None, :]
    xf = x.float()
    rotated = torch.cat([-xf[..., dim // 2 :], xf[..., : dim // 2]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


class Layer(nn.Module):
    def __init__(self, cfg: TinyLlamaConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.attn_norm = RMSNorm(h, cfg.rms_eps)
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)
        self.mlp_norm = RMSNorm(h, cfg.rms_eps)
        self.gate = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, h, bias=False)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        y = self.mlp_norm(x)
        return self.down(nn.functional.silu(self.gate(y)) * self.up(y))


class TinyLlama(nn.Module):
    """Random weights, fixed by ``seed``; inference only."""

    def __init__(self, cfg: TinyLlamaConfig, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        gen = torch.Generator().manual_seed(seed)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                if p.dim() == 2:
                    p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
            self.embed.weight.copy_(torch.randn(self.embed.weight.shape, generator=gen))
        self.requires_grad_(False)

    def blocks(self) -> list[Layer]:
        """The decoder layers, typed."""
        return [cast(Layer, m) for m in self.layers]

    def qkv(
        self, layer: Layer, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        y = layer.attn_norm(x)
        q = layer.q_proj(y).view(-1, cfg.num_heads, cfg.head_dim)
        k = layer.k_proj(y).view(-1, cfg.num_kv_heads, cfg.head_dim)
        v = layer.v_proj(y).view(-1, cfg.num_kv_heads, cfg.head_dim)
        return rope(q, positions, cfg.rope_theta), rope(k, positions, cfg.rope_theta), v

    @torch.no_grad()
    def dense_logits(self, tokens: Sequence[int]) -> torch.Tensor:
        """Logits ``[len(tokens), vocab]`` recomputed from scratch with dense masked attention."""
        cfg = self.cfg
        dev = self.embed.weight.device
        ids = torch.tensor(list(tokens), device=dev)
        n = ids.numel()
        pos = torch.arange(n, device=dev)
        x = self.embed(ids)
        group = cfg.num_heads // cfg.num_kv_heads
        for i, layer in enumerate(self.blocks()):
            q, k, v = self.qkv(layer, x, pos)
            dist = pos[:, None] - pos[None, :]
            allowed = (dist >= 0) & (dist < cfg.window(i))
            k = k.float().repeat_interleave(group, dim=1)
            v = v.float().repeat_interleave(group, dim=1)
            logits = torch.einsum("qhd,khd->hqk", q.float(), k) / math.sqrt(cfg.head_dim)
            probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
            attn = torch.einsum("hqk,khd->qhd", probs, v).to(x.dtype)
            x = x + layer.o_proj(attn.reshape(n, -1))
            x = x + layer.mlp(x)
        return self.lm_head(self.norm(x)).float()


@dataclass
class Step:
    """One sequence's part of a batched forward: its handle and the tokens to compute."""

    handle: SequenceHandle
    tokens: list[int]
    """The sequence's new tokens (its last ``len(tokens)`` tokens)."""


class CachedRunner:
    """Runs ``TinyLlama`` over the engine's paged pools with the kvpool kernels."""

    def __init__(
        self, model: TinyLlama, manager: KVCacheManager, backend: Backend = "auto"
    ) -> None:
        self.model = model
        self.manager = manager
        self.pools = manager.plan.pools
        self.attn = [PagedAttention(backend=backend) for _ in self.pools]
        self.dtype = model.embed.weight.dtype
        self.device = model.embed.weight.device

    @property
    def backends(self) -> set[str]:
        return {a.backend_in_use for a in self.attn}

    def prefill(
        self, prompts: Sequence[Sequence[int]], cache_salt: str | None = None
    ) -> tuple[list[SequenceHandle], list[torch.Tensor]]:
        """Open every prompt, compute only its uncached tokens in one batch.

        Returns the handles and, per prompt, the logits of its computed tokens.
        """
        steps = []
        for prompt in prompts:
            handle = self.manager.open_sequence(prompt, cache_salt=cache_salt)
            steps.append(Step(handle, list(prompt[handle.num_reused_tokens :])))
        return [s.handle for s in steps], self.forward(steps)

    def decode(self, seq_ids: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        """Append one token to each sequence and return their next-token logits ``[B, vocab]``."""
        steps = [
            Step(self.manager.append_tokens(sid, [tok]), [tok])
            for sid, tok in zip(seq_ids, tokens, strict=True)
        ]
        return torch.cat(self.forward(steps))

    @torch.no_grad()
    def forward(self, steps: Sequence[Step]) -> list[torch.Tensor]:
        """One packed forward over every step's new tokens; logits split per step."""
        model, cfg = self.model, self.model.cfg
        lens = [len(s.tokens) for s in steps]
        ids = torch.tensor([t for s in steps for t in s.tokens], device=self.device)
        positions = torch.tensor(
            [
                p
                for s in steps
                for p in range(s.handle.num_tokens - len(s.tokens), s.handle.num_tokens)
            ],
            device=self.device,
        )
        qo_indptr = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        slots = []
        for p, pool in enumerate(self.pools):
            table = PagedKvTable.from_block_lists(
                [s.handle.block_tables[p] for s in steps],
                [s.handle.num_tokens - s.handle.first_token[p] for s in steps],
                pool.tokens_per_block,
                device=self.device,
            )
            slots.append(append_slots(table, lens))
            window = -1 if pool.window >= FULL_ATTENTION else window_left_for(pool.window)
            self.attn[p].plan(
                qo_indptr, table.kv_indptr, table.kv_indices, table.kv_last_page_len,
                cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, pool.tokens_per_block,
                window_left=window, q_dtype=self.dtype, kv_dtype=self.dtype,
                device=self.device,
            )  # fmt: skip
        x = model.embed(ids)
        for i, layer in enumerate(model.blocks()):
            p = self.manager.plan.layer_pool[i]
            cache = self.manager.pool_view(p)[self.pools[p].layers.index(i)]
            q, k, v = model.qkv(layer, x, positions)
            append_kv(cache, k, v, slots[p])
            attn = self.attn[p].run(q, cache)
            x = x + layer.o_proj(attn.reshape(ids.numel(), -1))
            x = x + layer.mlp(x)
        logits = model.lm_head(model.norm(x)).float()
        return list(logits.split(lens))

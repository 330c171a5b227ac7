"""Where a block's K and V sit in vLLM's per-layer KV tensors, seen in the pool's layout.

The pool moves a block of one layer as ``[2, block_size, kv_heads, head_dim]`` (K then V).
vLLM (0.32, RFC 42082) hands every attention backend's per-layer cache over as a logical
``[blocks, kv_heads, block_size, 2 * head_dim]`` view, but what the last dimension holds is
the backend's own business:

* ``halves`` (FlashAttention, FlashInfer, Triton, ...): per token, K in ``[..., :head_dim]``
  and V in ``[..., head_dim:]``;
* ``rows`` (the CPU backend): a block-head's memory is ``[2, block_size, head_dim]``, K's rows
  then V's (the backend views it as ``2 * block_size`` rows and splits them).

``BlockLayout`` views a layer as ``[blocks, 2, block_size, kv_heads, head_dim]`` for either,
so that copying a block is one indexed copy per layer. A backend not in ``BACKENDS`` is an
error at start-up, never a guess.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

BACKENDS: dict[str, str] = {
    "CPU_ATTN": "rows",
    "FLASH_ATTN": "halves",
    "FLASHINFER": "halves",
    "TRITON_ATTN": "halves",
}
"""vLLM attention backend name -> how its content dimension holds K and V."""


class LayoutError(ValueError):
    """vLLM's KV tensors cannot be read as blocks the pool stores (the message says why)."""


@dataclass(frozen=True)
class BlockLayout:
    """How to view one layer's tensor as ``[blocks, 2, block_size, kv_heads, head_dim]``."""

    block_size: int
    kv_heads: int
    head_dim: int
    content: str
    """``rows`` or ``halves`` (see the module docstring)."""

    @classmethod
    def for_backend(
        cls, backend: str, block_size: int, kv_heads: int, head_dim: int
    ) -> BlockLayout:
        content = BACKENDS.get(backend)
        if content is None:
            raise LayoutError(
                f"attention backend {backend!r} is not supported by the kvpool connector "
                f"(supported: {', '.join(sorted(BACKENDS))})"
            )
        return cls(block_size, kv_heads, head_dim, content)

    def blocks_view(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (one layer, as vLLM registered it) as ``[blocks, 2, bs, heads, dim]``
        (a view: writes reach vLLM's memory)."""
        bs, heads, dim = self.block_size, self.kv_heads, self.head_dim
        if tensor.dim() != 4 or tuple(tensor.shape[1:]) != (heads, bs, 2 * dim):
            raise LayoutError(
                f"KV tensor {tuple(tensor.shape)}: expected [blocks, {heads}, {bs}, {2 * dim}]"
            )
        blocks = tensor.shape[0]
        try:
            if self.content == "rows":
                return tensor.view(blocks, heads, 2, bs, dim).permute(0, 2, 3, 1, 4)
            return tensor.view(blocks, heads, bs, 2, dim).permute(0, 3, 2, 1, 4)
        except RuntimeError as err:
            raise LayoutError(
                f"KV tensor {tuple(tensor.shape)} with strides {tensor.stride()}: a block's "
                f"K and V cannot be viewed without a copy ({err})"
            ) from None


def gather(views: Sequence[torch.Tensor], block_ids: Sequence[int]) -> torch.Tensor:
    """The blocks ``block_ids`` of every layer, as one host tensor
    ``[layers, n, 2, bs, heads, dim]`` (the pool's layout for a PUT)."""
    first = views[0]
    index = torch.tensor(block_ids, dtype=torch.long, device=first.device)
    out = torch.empty((len(views), len(block_ids), *first.shape[1:]), dtype=first.dtype)
    for layer, view in enumerate(views):
        picked = view.index_select(0, index)
        out[layer].copy_(picked)
    return out


def scatter(views: Sequence[torch.Tensor], block_ids: Sequence[int], kv: torch.Tensor) -> None:
    """Write ``kv`` (``[layers, n, 2, bs, heads, dim]``, as a GET returns it) into the
    blocks ``block_ids`` of every layer."""
    if kv.shape[0] != len(views) or kv.shape[1] != len(block_ids):
        raise LayoutError(
            f"KV {tuple(kv.shape)}: expected {len(views)} layers of {len(block_ids)} blocks"
        )
    first = views[0]
    index = torch.tensor(block_ids, dtype=torch.long, device=first.device)
    for layer, view in enumerate(views):
        view.index_copy_(0, index, kv[layer].to(view.device, non_blocking=True))

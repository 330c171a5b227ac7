"""Write K and V of new tokens into their cache slots, quantizing on write.

One scatter per call (per K and V) for all tokens of the batch, on any device: the slots
(``block_id * page_size + offset``) come from the block tables (see ``layout.append_slots``).
"""

from __future__ import annotations

import torch

from .layout import KvLayout, layer_geometry
from .quant import check_kv_dtype, quantize

__all__ = ["append_kv"]


def append_kv(
    kv_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    *,
    layout: KvLayout = "NHD",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store ``k[i]``, ``v[i]`` (``[tokens, kv_heads, head_dim]``) at slot ``slots[i]``.

    ``kv_cache`` is one layer ``[pages, 2, ...]`` in ``layout``. fp8/int8 caches store
    ``value * (1 / scale)``; other dtypes store the values cast to the cache dtype, so an
    append into a cache of the model's dtype is bit-exact. Slots must be distinct.
    """
    geo = layer_geometry(kv_cache, layout)
    check_kv_dtype(kv_cache.dtype)
    expected = (slots.numel(), geo.num_kv_heads, geo.head_dim)
    for name, t in (("k", k), ("v", v)):
        if tuple(t.shape) != expected:
            raise ValueError(f"{name}: expected shape {expected}, got {tuple(t.shape)}")
    if slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slots: must be a 1-D integer tensor, got {slots.dtype}")
    if slots.numel() == 0:
        return
    capacity = geo.num_pages * geo.page_size
    slots = slots.to(kv_cache.device, torch.int64)
    lo, hi = int(slots.min()), int(slots.max())
    if lo < 0 or hi >= capacity:
        raise IndexError(f"slots: slot {lo if lo < 0 else hi} out of range [0, {capacity})")
    pages = torch.div(slots, geo.page_size, rounding_mode="floor")
    offsets = slots % geo.page_size
    # fp8 has no index_put kernel on every device: write its bytes through a uint8 view.
    raw = kv_cache.view(torch.uint8) if kv_cache.dtype == torch.float8_e4m3fn else kv_cache
    for which, values, scale in ((0, k, k_scale), (1, v, v_scale)):
        stored = quantize(values.to(kv_cache.device), kv_cache.dtype, scale)
        if raw.dtype == torch.uint8:
            stored = stored.view(torch.uint8)
        if layout == "NHD":
            raw[pages, which, offsets] = stored
        else:
            raw[pages, which, :, offsets] = stored

"""The paged KV layout shared with the cache engine, and the block tables that address it.

A pool is one layer-major tensor; ``pool[layer]`` is a flashinfer paged cache for one layer:

* ``NHD``: ``[num_layers, num_blocks, 2, page_size, kv_heads, head_dim]``
* ``HND``: ``[num_layers, num_blocks, 2, kv_heads, page_size, head_dim]``

Index 0 of the ``2`` dim is K, index 1 is V. A block id is an index into the blocks dim and means
the same slot in every layer. Block tables use flashinfer's CSR form: ``kv_indptr`` ``[B+1]``,
``kv_indices`` ``[kv_indptr[-1]]`` and ``kv_last_page_len`` ``[B]`` (1..page_size), all int32.
A token's *slot* is ``block_id * page_size + offset_in_block``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = [
    "KvLayout",
    "PagedKvTable",
    "append_slots",
    "kv_cache_shape",
    "layer_geometry",
    "new_pool",
]

KvLayout = Literal["NHD", "HND"]
LAYOUTS: tuple[KvLayout, ...] = ("NHD", "HND")


def check_layout(layout: str) -> KvLayout:
    """Return ``layout`` as a ``KvLayout`` or raise naming the allowed values."""
    if layout == "NHD":
        return "NHD"
    if layout == "HND":
        return "HND"
    raise ValueError(f"layout: must be one of {', '.join(LAYOUTS)}, got {layout!r}")


def kv_cache_shape(
    num_layers: int,
    num_blocks: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    layout: KvLayout = "NHD",
) -> tuple[int, int, int, int, int, int]:
    """Shape of a layer-major pool tensor in ``layout``."""
    if check_layout(layout) == "NHD":
        return (num_layers, num_blocks, 2, page_size, num_kv_heads, head_dim)
    return (num_layers, num_blocks, 2, num_kv_heads, page_size, head_dim)


def new_pool(
    num_layers: int,
    num_blocks: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    dtype: torch.dtype = torch.float16,
    device: torch.device | str = "cpu",
    layout: KvLayout = "NHD",
    pin_memory: bool = False,
) -> torch.Tensor:
    """Allocate a zeroed pool (pinned when asked, for a host tier that copies asynchronously)."""
    shape = kv_cache_shape(num_layers, num_blocks, page_size, num_kv_heads, head_dim, layout)
    if pin_memory:
        return torch.zeros(shape, dtype=dtype, pin_memory=True)
    return torch.zeros(shape, dtype=dtype, device=device)


@dataclass(frozen=True)
class LayerGeometry:
    """Dimensions read off one layer's cache tensor ``[pages, 2, ...]``."""

    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int


def layer_geometry(cache: torch.Tensor, layout: KvLayout) -> LayerGeometry:
    """Read pages, page size, heads and head dim from one layer's cache, checking its rank."""
    if cache.dim() != 5 or cache.shape[1] != 2:
        raise ValueError(
            f"kv_cache: expected one layer [pages, 2, ...] (5-D), got shape {tuple(cache.shape)}"
        )
    pages, _, a, b, dim = cache.shape
    if check_layout(layout) == "NHD":
        return LayerGeometry(pages, a, b, dim)
    return LayerGeometry(pages, b, a, dim)


@dataclass(frozen=True)
class PagedKvTable:
    """Block tables of a batch in flashinfer's CSR form, validated once.

    ``kv_lens[b] = (pages of b - 1) * page_size + kv_last_page_len[b]``; every sequence holds at
    least one page.
    """

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    page_size: int

    def __post_init__(self) -> None:
        indptr, indices, last = self.kv_indptr, self.kv_indices, self.kv_last_page_len
        if self.page_size <= 0:
            raise ValueError(f"page_size: must be positive, got {self.page_size}")
        for name, t in (("kv_indptr", indptr), ("kv_indices", indices), ("kv_last_page_len", last)):
            if t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
                raise ValueError(
                    f"{name}: must be a 1-D int32 tensor, got {t.dtype} {tuple(t.shape)}"
                )
        if indptr.numel() < 1 or last.numel() != indptr.numel() - 1:
            raise ValueError(
                f"kv_last_page_len: needs batch_size = len(kv_indptr) - 1 = {indptr.numel() - 1} "
                f"entries, got {last.numel()}"
            )
        ip = indptr.cpu()
        if int(ip[0]) != 0 or bool((ip[1:] <= ip[:-1]).any()):
            raise ValueError("kv_indptr: must start at 0 and give every sequence at least 1 page")
        if indices.numel() != int(ip[-1]):
            raise ValueError(
                f"kv_indices: kv_indptr[-1] = {int(ip[-1])} pages but {indices.numel()} indices"
            )
        lp = last.cpu()
        if lp.numel() and (int(lp.min()) < 1 or int(lp.max()) > self.page_size):
            raise ValueError(f"kv_last_page_len: entries must be in 1..{self.page_size}")

    @property
    def batch_size(self) -> int:
        return self.kv_indptr.numel() - 1

    def kv_lens(self) -> torch.Tensor:
        """KV length of each sequence (CPU int64)."""
        ip = self.kv_indptr.cpu().long()
        return (ip[1:] - ip[:-1] - 1) * self.page_size + self.kv_last_page_len.cpu().long()

    @classmethod
    def from_block_lists(
        cls,
        block_ids: Sequence[Sequence[int]],
        kv_lens: Sequence[int],
        page_size: int,
        device: torch.device | str = "cpu",
    ) -> PagedKvTable:
        """Build the CSR table from one block list and one token count per sequence."""
        if len(block_ids) != len(kv_lens):
            raise ValueError(f"kv_lens: {len(kv_lens)} lengths for {len(block_ids)} block lists")
        indptr = [0]
        indices: list[int] = []
        last: list[int] = []
        for i, (blocks, n) in enumerate(zip(block_ids, kv_lens, strict=True)):
            need = -(-n // page_size)
            if n <= 0 or len(blocks) < need:
                raise ValueError(
                    f"block_ids[{i}]: {n} tokens need {max(need, 1)} blocks, got {len(blocks)}"
                )
            indices.extend(int(b) for b in blocks[:need])
            indptr.append(len(indices))
            last.append(n - (need - 1) * page_size)
        return cls(
            torch.tensor(indptr, dtype=torch.int32, device=device),
            torch.tensor(indices, dtype=torch.int32, device=device),
            torch.tensor(last, dtype=torch.int32, device=device),
            page_size,
        )


def append_slots(table: PagedKvTable, append_lens: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Slots of the last ``append_lens[b]`` tokens of each sequence (the ones being written).

    The table already counts the appended tokens (as flashinfer's append does), so the new
    tokens of sequence ``b`` sit at positions ``kv_len[b] - append_lens[b] .. kv_len[b] - 1``.
    Returns an int64 tensor on the device of ``kv_indices``, in packed (ragged) order.
    """
    lens = torch.as_tensor(append_lens, dtype=torch.int64).cpu()
    if lens.dim() != 1 or lens.numel() != table.batch_size:
        raise ValueError(
            f"append_lens: needs {table.batch_size} entries, got shape {tuple(lens.shape)}"
        )
    kv_lens = table.kv_lens()
    if bool((lens < 0).any()) or bool((lens > kv_lens).any()):
        raise ValueError("append_lens: each entry must be in 0..kv_len of its sequence")
    batch = torch.repeat_interleave(torch.arange(lens.numel()), lens)
    starts = torch.cumsum(lens, 0) - lens
    offset_in_append = torch.arange(int(lens.sum())) - starts[batch]
    positions = (kv_lens - lens)[batch] + offset_in_append
    page_in_seq = positions // table.page_size
    indptr = table.kv_indptr.cpu().long()
    blocks = table.kv_indices.cpu().long()[indptr[batch] + page_in_seq]
    slots = blocks * table.page_size + positions % table.page_size
    return slots.to(table.kv_indices.device)

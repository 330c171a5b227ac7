"""Batched block copies between and within KV pools (offload, onboard, copy-on-partial-reuse).

A pool is one layer-major tensor ``[num_layers, num_blocks, ...]``: dim 1 is the block dim, and a
block id names the same slot in every layer. Every function here moves N blocks with a constant
number of torch calls (one gather, one scatter), never one call per block, because one small
page copy costs less on the wire than one call's overhead.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any, Literal

import torch

__all__ = [
    "as_block_ids",
    "chunk_ids",
    "copy_block_prefix",
    "copy_block_prefixes",
    "copy_blocks",
]

BLOCK_DIM = 1


def as_block_ids(ids: Sequence[int] | torch.Tensor, num_blocks: int, name: str) -> torch.Tensor:
    """Validate block ids against ``num_blocks`` and return them as a CPU int64 tensor.

    Raises ``ValueError`` for a wrong shape or dtype and ``IndexError`` for an id out of range,
    naming the argument, so a bad request fails before anything is written.
    """
    if isinstance(ids, torch.Tensor):
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise ValueError(f"{name}: block ids must be an integer tensor, got {ids.dtype}")
        if ids.dim() != 1:
            raise ValueError(f"{name}: block ids must be 1-D, got shape {tuple(ids.shape)}")
        out = ids.detach().to(device="cpu", dtype=torch.int64)
    else:
        values = []
        for v in ids:
            try:
                if isinstance(v, bool):
                    raise TypeError
                values.append(operator.index(v))
            except TypeError:
                raise ValueError(f"{name}: block ids must be ints, got {v!r}") from None
        out = torch.tensor(values, dtype=torch.int64)
    if out.numel():
        lo, hi = int(out.min()), int(out.max())
        if lo < 0 or hi >= num_blocks:
            bad = lo if lo < 0 else hi
            raise IndexError(f"{name}: block id {bad} out of range [0, {num_blocks})")
    return out


def _check_pools(src: torch.Tensor, dst: torch.Tensor) -> None:
    if src.dim() < 2 or dst.dim() < 2:
        raise ValueError(
            f"src/dst: pools need a layer dim and a block dim, got shapes "
            f"{tuple(src.shape)} and {tuple(dst.shape)}"
        )
    if src.dtype != dst.dtype:
        raise ValueError(f"src/dst: dtype mismatch {src.dtype} vs {dst.dtype}")
    if src.shape[0] != dst.shape[0] or src.shape[2:] != dst.shape[2:]:
        raise ValueError(
            f"src/dst: shapes must match except in dim 1 (blocks), got "
            f"{tuple(src.shape)} and {tuple(dst.shape)}"
        )


def _raw(t: torch.Tensor) -> torch.Tensor:
    """View 1-byte float storage (fp8) as uint8: copies move bytes, and not every torch
    indexing kernel is implemented for the float8 dtypes."""
    if t.element_size() == 1 and t.dtype.is_floating_point:
        return t.view(torch.uint8)
    return t


def _index_on(ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Move an index tensor to ``device``; pinned staging keeps the H2D copy asynchronous."""
    if device.type == "cpu":
        return ids
    if torch.cuda.is_available():
        ids = ids.pin_memory()
    return ids.to(device, non_blocking=True)


HostCopy = Literal["auto", "direct", "staged"]
"""How blocks cross between pinned host memory and a GPU:

* ``direct``: the GPU's own gather/scatter kernels read or write the host pool in place
  through its device address (pinned memory is mapped into the GPU's address space), so
  scattered blocks cross the link in one pass with no work on the host;
* ``staged``: the host gathers/scatters ~64 MiB chunks into pinned staging buffers that
  one DMA each moves (the CPU's memory copies bound it);
* ``auto``: ``direct`` where the host pool is pinned and CUDA can map it, else ``staged``.
"""


def copy_blocks(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_ids: Sequence[int] | torch.Tensor,
    dst_ids: Sequence[int] | torch.Tensor,
    *,
    via: HostCopy = "auto",
) -> None:
    """Copy blocks ``src[:, src_ids]`` into ``dst[:, dst_ids]`` in one batched call.

    ``src`` and ``dst`` may be the same tensor (a copy within a pool; overlapping ids read the
    old contents because the gather completes before the scatter) or live on different devices
    (offload CUDA -> pinned host, onboard pinned host -> CUDA; ``via`` says how, see
    ``HostCopy``). Onboard returns with the work queued on the current CUDA stream (later
    kernels on that stream see the blocks), offload returns once the blocks are on the host.
    ``dst_ids`` must be distinct. All ids are validated before anything is written.
    """
    if via not in ("auto", "direct", "staged"):
        raise ValueError(f"via: must be auto, direct or staged, got {via!r}")
    _check_pools(src, dst)
    s = as_block_ids(src_ids, src.shape[BLOCK_DIM], "src_ids")
    d = as_block_ids(dst_ids, dst.shape[BLOCK_DIM], "dst_ids")
    if s.numel() != d.numel():
        raise ValueError(f"src_ids/dst_ids: length mismatch {s.numel()} vs {d.numel()}")
    if d.numel() and torch.unique(d).numel() != d.numel():
        raise ValueError("dst_ids: block ids must be distinct")
    if s.numel() == 0:
        return
    if src.device != dst.device and "cpu" not in (src.device.type, dst.device.type):
        raise ValueError(
            f"src/dst: copies run within a device or between CPU and one device, "
            f"got {src.device} -> {dst.device}"
        )
    src, dst = _raw(src), _raw(dst)
    to_host = dst.device.type == "cpu" and src.device.type != "cpu"
    if src.device != dst.device and via != "staged":
        host, device = (src, dst.device) if src.device.type == "cpu" else (dst, src.device)
        alias = device_alias(host, device)
        if alias is None and via == "direct":
            raise ValueError(
                "via direct: the host pool is not pinned memory that CUDA can map "
                "(use via auto or staged)"
            )
        if alias is not None:
            src, dst = (alias, dst) if src.device.type == "cpu" else (src, alias)
    if src.device == dst.device:
        gathered = _gather(src, _index_on(s, src.device))
        _scatter(dst, _index_on(d, dst.device), gathered)
        if to_host:  # the host reads the blocks as soon as this returns
            torch.cuda.current_stream(dst.device).synchronize()
    elif src.device.type == "cpu":
        _onboard(src, dst, s, d)
    else:
        _offload(src, dst, s, d)


class _HostMemory:
    """A pinned host buffer described as CUDA memory (``__cuda_array_interface__``): with
    unified addressing its host address is its device address too."""

    def __init__(self, host: torch.Tensor) -> None:
        storage = host.untyped_storage()
        self._storage = storage  # the memory must outlive the alias
        self.__cuda_array_interface__: dict[str, Any] = {
            "shape": (storage.nbytes(),),
            "typestr": "|u1",
            "data": (storage.data_ptr(), False),
            "version": 3,
        }


def device_alias(host: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """``host`` (a pinned CPU tensor, any view) as a tensor of ``device`` over the same
    memory, so that GPU kernels read and write it in place across the link; None when the
    memory is not pinned or CUDA cannot map it. The alias must not outlive ``host``."""
    if device.type != "cuda" or not torch.cuda.is_available() or not host.is_pinned():
        return None
    memory = _HostMemory(host)
    try:
        raw = torch.as_tensor(memory, device=device)
        typed = raw.view(host.dtype)
    except (RuntimeError, TypeError, ValueError):
        return None
    if raw.data_ptr() != memory.__cuda_array_interface__["data"][0]:
        # CUDA placed the memory on another device (pinned in another device's context), and
        # torch copied it over: a copy is no alias, so writes would never reach the host.
        return None
    return typed.as_strided(host.shape, host.stride(), host.storage_offset())


def _gather(pool: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``pool[:, ids]`` by advanced indexing: ``index_select`` makes a strided pool view (the
    engine's views of its tier arena) contiguous first, costing the whole arena per call."""
    return pool[:, ids]


def _scatter(pool: torch.Tensor, ids: torch.Tensor, values: torch.Tensor) -> None:
    """``pool[:, ids] = values`` in place, strided views included."""
    pool[:, ids] = values


CHUNK_BYTES = 64 << 20
"""Transfer size per pipeline stage: big enough to run at the link's rate, small enough that
the host-side gather/scatter of one chunk overlaps the DMA of the next."""


def chunk_ids(
    src_ids: torch.Tensor,
    dst_ids: torch.Tensor,
    block_bytes: int,
    chunk_bytes: int | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Split paired id lists into runs of at most ``chunk_bytes`` (default ``CHUNK_BYTES``),
    at least one block each."""
    limit = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    per_chunk = max(1, limit // max(block_bytes, 1))
    return list(zip(src_ids.split(per_chunk), dst_ids.split(per_chunk), strict=True))


def _block_bytes(pool: torch.Tensor) -> int:
    return pool[:, 0].numel() * pool.element_size()


def _onboard(src: torch.Tensor, dst: torch.Tensor, s: torch.Tensor, d: torch.Tensor) -> None:
    """Host -> device: gather each chunk into pinned staging, send it, scatter on the device.

    Everything after the host gather is asynchronous on the current stream, so the host
    gathers chunk i+1 while chunk i is on the wire. torch's pinned-memory allocator does not
    reuse a staging buffer until the copy that reads it has finished.
    """
    pin = dst.device.type == "cuda" and torch.cuda.is_available()
    for s_chunk, d_chunk in chunk_ids(s, d, _block_bytes(src)):
        shape = list(src.shape)
        shape[BLOCK_DIM] = s_chunk.numel()
        staging = torch.empty(shape, dtype=src.dtype, pin_memory=pin)
        staging.copy_(_gather(src, s_chunk))
        on_device = staging.to(dst.device, non_blocking=pin)
        _scatter(dst, _index_on(d_chunk, dst.device), on_device)


def _offload(src: torch.Tensor, dst: torch.Tensor, s: torch.Tensor, d: torch.Tensor) -> None:
    """Device -> host: gather each chunk on the device, send it to pinned staging, scatter it
    into the host pool once its copy has landed, while the next chunk is on the wire.

    Returns when every block is on the host: the host pool is read by the CPU right after.
    """
    stream = torch.cuda.current_stream(src.device)
    pending: tuple[torch.Tensor, torch.cuda.Event, torch.Tensor] | None = None
    for s_chunk, d_chunk in chunk_ids(s, d, _block_bytes(src)):
        gathered = _gather(src, _index_on(s_chunk, src.device))
        staging = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
        staging.copy_(gathered, non_blocking=True)
        landed = torch.cuda.Event()
        landed.record(stream)
        if pending is not None:
            _scatter_on_host(dst, *pending)
        pending = (staging, landed, d_chunk)
    if pending is not None:
        _scatter_on_host(dst, *pending)


def _scatter_on_host(
    dst: torch.Tensor, staging: torch.Tensor, landed: torch.cuda.Event, ids: torch.Tensor
) -> None:
    landed.synchronize()
    _scatter(dst, ids, staging)


def copy_block_prefixes(
    pool: torch.Tensor,
    src_ids: Sequence[int] | torch.Tensor,
    dst_ids: Sequence[int] | torch.Tensor,
    num_tokens: Sequence[int] | torch.Tensor,
    *,
    token_dim: int = 3,
) -> None:
    """Copy the first ``num_tokens[i]`` tokens of block ``src_ids[i]`` into ``dst_ids[i]``.

    Used for copy-on-partial-reuse: a new sequence shares only part of a cached block, so the
    matching prefix is copied into a fresh block it owns. ``token_dim`` is the pool dim that
    indexes tokens within a block: 3 for NHD ``[L, N, 2, page, heads, dim]``, 4 for HND
    ``[L, N, 2, heads, page, dim]``. Done as one masked gather/scatter over all pairs.
    """
    _check_pools(pool, pool)
    if not 2 <= token_dim < pool.dim():
        raise ValueError(f"token_dim: {token_dim} is not a dim of a {pool.dim()}-D pool")
    page = pool.shape[token_dim]
    s = as_block_ids(src_ids, pool.shape[BLOCK_DIM], "src_ids")
    d = as_block_ids(dst_ids, pool.shape[BLOCK_DIM], "dst_ids")
    n = as_block_ids(num_tokens, page + 1, "num_tokens")
    if not s.numel() == d.numel() == n.numel():
        raise ValueError(
            f"src_ids/dst_ids/num_tokens: length mismatch {s.numel()}/{d.numel()}/{n.numel()}"
        )
    if d.numel() and torch.unique(d).numel() != d.numel():
        raise ValueError("dst_ids: block ids must be distinct")
    if s.numel() == 0:
        return
    pool = _raw(pool)
    dev = pool.device
    s_dev, d_dev, n_dev = (_index_on(t, dev) for t in (s, d, n))
    src_blocks = _gather(pool, s_dev)
    dst_blocks = _gather(pool, d_dev)
    # mask[b, t] is True where token t of pair b comes from the source block.
    mask = torch.arange(page, device=dev)[None, :] < n_dev[:, None]
    shape = [1] * pool.dim()
    shape[BLOCK_DIM] = mask.shape[0]
    shape[token_dim] = page
    merged = torch.where(mask.view(shape), src_blocks, dst_blocks)
    _scatter(pool, d_dev, merged)


def copy_block_prefix(
    pool: torch.Tensor, src_id: int, dst_id: int, num_tokens: int, *, token_dim: int = 3
) -> None:
    """Copy the first ``num_tokens`` tokens of one block into another (see the batched form)."""
    copy_block_prefixes(pool, [src_id], [dst_id], [num_tokens], token_dim=token_dim)

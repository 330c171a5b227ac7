"""The memory behind each tier: one byte arena, seen by every pool as a paged KV tensor.

A tier is one flat allocation (CUDA memory for the primary tier when present, otherwise CPU;
pinned host memory for the secondary tier on CUDA machines; CPU memory advised for 2 MiB
pages, ``kvpool_agent/hugepages.py``). Each pool sees the whole arena
through a strided view in the layout the kernels read (``kvpool_kernels``, flashinfer's NHD
paged layout, layer-major):

    pool view: [layers_in_pool, num_blocks, 2, tokens_per_block, kv_heads, head_dim]

so ``view[layer]`` is flashinfer's ``[pages, 2, page_size, kv_heads, head_dim]`` with a page
stride of one group block. Block ``i`` of a group occupies arena bytes
``[i * group_block_bytes, (i + 1) * group_block_bytes)``, each pool of the group at its offset
inside it. Because every group addresses the same arena, moving a chunk of bytes from one
group to another needs no reallocation: rebalancing only changes which ids are handed out.
"""

from __future__ import annotations

import mmap
import os

import torch

from kvpool_agent.cache.sizing import PoolPlan, PoolSpec, TierPlan
from kvpool_agent.hugepages import advise_huge_pages, huge_page_bytes
from kvpool_kernels.copy import copy_blocks

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "fp8": torch.float8_e4m3fn,
    "int8": torch.int8,
}


class TierStorage:
    """The arena of one tier and the per-pool views into it."""

    def __init__(self, plan: PoolPlan, tier: TierPlan, device: torch.device, *, pin: bool) -> None:
        self.plan = plan
        self.tier = tier
        self.device = device
        nbytes = tier.arena_bytes
        self._mapping: mmap.mmap | None = None
        if device.type == "cpu" and not pin and nbytes > 0:
            self._mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            advise_huge_pages(self._mapping)
            self.arena = torch.frombuffer(self._mapping, dtype=torch.uint8, count=nbytes)
            self.arena.zero_()  # committed up front, as torch.zeros did (and its pages huge)
        elif device.type == "cpu":
            self.arena = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin and nbytes > 0)
        else:
            self.arena = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.views: list[torch.Tensor] = [self._pool_view(p) for p in plan.pools]
        """One paged tensor per pool, indexed by the pool's index."""
        self.shared_fd: int | None = None
        """The memfd behind the arena once ``share`` moved it there (None: private memory)."""
        self._huge_bytes: int | None = None

    def share(self) -> int:
        """Move a CPU arena into a memfd and return its fd, so that a same-node engine can
        map the very bytes the pools use (``transfer.unix_socket``). The contents are copied
        and the pool views rebuilt over the new memory; call it before anyone caches a view
        or a pointer into the arena (the transfer server does, at construction). Idempotent.
        A memfd has no name in any file system: only a process the fd is handed to (over
        the Unix socket, after AUTH) can map it."""
        if self.shared_fd is not None:
            return self.shared_fd
        if self.device.type != "cpu":
            raise ValueError(
                f"tier on {self.device}: only a CPU arena can live in shared memory "
                "(a CUDA arena is exported with CUDA IPC instead)"
            )
        nbytes = self.nbytes
        fd = os.memfd_create("kvpool-arena", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, max(nbytes, 1))
            mapping = mmap.mmap(fd, max(nbytes, 1))
            advise_huge_pages(mapping)  # before the copy below faults the pages in
        except BaseException:
            os.close(fd)
            raise
        arena = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes) if nbytes else None
        if arena is not None:
            arena.copy_(self.arena)
            if torch.cuda.is_available() and self.arena.is_pinned():  # a CUDA host tier
                _cuda_host_register(arena)
            self.arena = arena
            self.views = [self._pool_view(p) for p in self.plan.pools]
        self._mapping = mapping
        self.shared_fd = fd
        self._huge_bytes = None  # other memory now
        return fd

    @property
    def huge_page_bytes(self) -> int:
        """Bytes of a host arena that 2 MiB pages back (``advise_huge_pages``; 0 on a GPU),
        read from the kernel once (a read of ``/proc/self/smaps`` walks the mapping)."""
        if self._huge_bytes is None:
            on_host = self.device.type == "cpu" and self.nbytes > 0
            self._huge_bytes = huge_page_bytes(self.arena.data_ptr(), self.nbytes) if on_host else 0
        return self._huge_bytes

    @property
    def nbytes(self) -> int:
        return self.arena.numel()

    def _pool_view(self, pool: PoolSpec) -> torch.Tensor:
        group = self.plan.groups[pool.group]
        offset = group.pool_offsets[group.pools.index(pool.index)]
        dtype = TORCH_DTYPES[pool.dtype]
        elem = torch.empty((), dtype=dtype).element_size()
        typed = self.arena.view(dtype)
        num_blocks = self.nbytes // group.block_bytes if group.block_bytes else 0
        t, h, d = pool.tokens_per_block, pool.kv_heads, pool.head_dim
        layer_elems = 2 * t * h * d
        return torch.as_strided(
            typed,
            size=(len(pool.layers), num_blocks, 2, t, h, d),
            stride=(layer_elems, group.block_bytes // elem, t * h * d, h * d, d, 1),
            storage_offset=offset // elem,
        )

    def num_blocks(self, group: int) -> int:
        """Ids a group can address in this arena (owned or not)."""
        block_bytes = self.plan.groups[group].block_bytes
        return self.nbytes // block_bytes if block_bytes else 0


def _cuda_host_register(arena: torch.Tensor) -> None:
    """Page-lock a shared host arena for fast device copies, as ``pin_memory`` did for the
    private one (``cudaHostRegister`` on the mapping; portable so any context may use it)."""
    cudart = torch.cuda.cudart()
    host_register_portable = 1
    err = cudart.cudaHostRegister(arena.data_ptr(), arena.numel(), host_register_portable)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of the shared host arena failed: {err}")


def copy_group_blocks(
    plan: PoolPlan,
    group: int,
    src: TierStorage,
    dst: TierStorage,
    src_ids: list[int],
    dst_ids: list[int],
) -> None:
    """Copy blocks of one group between (or within) tiers: one batched call per pool."""
    if not src_ids:
        return
    for pool_index in plan.groups[group].pools:
        copy_blocks(src.views[pool_index], dst.views[pool_index], src_ids, dst_ids)

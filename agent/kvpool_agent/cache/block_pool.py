"""The block pool: which block ids are free, in each tier and pool group. It never evicts.

A tier's arena is cut into equal chunks; each chunk belongs to one group, which hands out
the ids of its blocks that lie wholly inside it (``sizing.block_ids_in_chunk``). Free ids
come lowest first, so a group fills its low chunks and leaves whole chunks free at the top:
those are what a group that runs short takes from another (``take``, counted in
``chunk_moves``). When no id is free the caller evicts (``tiers.Tiers.allocate``) and
hands the victims' ids on; the pool only learns of ids given back.

The pool also counts the blocks sequences pin (``pinned``): those can be neither evicted
nor taken, which is what ``shortfall`` checks before a request changes anything.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from kvpool_agent.cache.block import PRIMARY, SECONDARY, Block
from kvpool_agent.cache.sizing import block_ids_in_chunk
from kvpool_agent.cache.stats import CacheStats


@dataclass(frozen=True)
class TierLayout:
    """How one tier's arena is cut (``sizing.TierPlan``, as plain numbers)."""

    chunk_bytes: int
    num_chunks: int
    group_chunks: tuple[int, ...]
    """Chunks each group owns at start, in arena order (group 0's first)."""
    group_blocks: tuple[int, ...]
    """Blocks each group holds at start (what the queues and curves are sized for)."""


class TierPool:
    """Free ids and chunk ownership of one tier."""

    def __init__(self, layout: TierLayout, block_bytes: Sequence[int]) -> None:
        self._block_bytes = list(block_bytes)
        self._chunk_bytes = layout.chunk_bytes
        self.num_chunks = layout.num_chunks
        n = len(self._block_bytes)
        self.owner: list[int] = []
        for group, count in enumerate(layout.group_chunks):
            self.owner.extend([group] * count)
        self.used_in_chunk = [0] * self.num_chunks
        self._free: list[list[int]] = [[] for _ in range(n)]
        self.capacity = [0] * n
        for chunk, group in enumerate(self.owner):
            ids = self.ids_in_chunk(group, chunk)
            self._free[group].extend(ids)
            self.capacity[group] += len(ids)
        for heap in self._free:
            heapq.heapify(heap)

    def ids_in_chunk(self, group: int, chunk: int) -> range:
        return block_ids_in_chunk(chunk, self._chunk_bytes, self._block_bytes[group])

    def chunk_of(self, group: int, block_id: int) -> int:
        return (block_id * self._block_bytes[group]) // self._chunk_bytes

    def num_free(self, group: int) -> int:
        return len(self._free[group])

    def allocate(self, group: int) -> int | None:
        """The lowest free id of ``group``, or None."""
        heap = self._free[group]
        if not heap:
            return None
        block_id = heapq.heappop(heap)
        self.used_in_chunk[self.chunk_of(group, block_id)] += 1
        return block_id

    def allocate_many(self, group: int, count: int) -> list[int]:
        """Up to ``count`` lowest free ids of ``group`` (``allocate`` repeated, at once)."""
        heap = self._free[group]
        ids = [heapq.heappop(heap) for _ in range(min(count, len(heap)))]
        used = self.used_in_chunk
        block_bytes, chunk_bytes = self._block_bytes[group], self._chunk_bytes
        for block_id in ids:
            used[(block_id * block_bytes) // chunk_bytes] += 1  # ``chunk_of``, inlined
        return ids

    def release(self, group: int, block_id: int) -> None:
        self.used_in_chunk[self.chunk_of(group, block_id)] -= 1
        heapq.heappush(self._free[group], block_id)

    def free_chunks(self, group: int) -> list[int]:
        """Chunks of ``group`` with no id in use, highest first."""
        return [
            c
            for c in range(self.num_chunks - 1, -1, -1)
            if self.owner[c] == group and self.used_in_chunk[c] == 0
        ]

    def move_free_chunk(self, chunk: int, to_group: int) -> int:
        """Give a wholly free chunk to another group; returns the ids it gained."""
        src = self.owner[chunk]
        if self.used_in_chunk[chunk]:
            raise RuntimeError(f"chunk {chunk} still has blocks in use")
        lost = set(self.ids_in_chunk(src, chunk))
        self._free[src] = [i for i in self._free[src] if i not in lost]
        heapq.heapify(self._free[src])
        self.capacity[src] -= len(lost)
        self.owner[chunk] = to_group
        gained = self.ids_in_chunk(to_group, chunk)
        for i in gained:
            heapq.heappush(self._free[to_group], i)
        self.capacity[to_group] += len(gained)
        return len(gained)


class BlockPool:
    """The free ids of both tiers, and the blocks pinned in each (tier, group)."""

    def __init__(
        self, block_bytes: Sequence[int], tiers: tuple[TierLayout, TierLayout], stats: CacheStats
    ) -> None:
        self.num_groups = len(block_bytes)
        self.tiers = tuple(TierPool(layout, block_bytes) for layout in tiers)
        self.pinned = [[0] * self.num_groups, [0] * self.num_groups]
        """Blocks with a reference count, per tier and group: neither free nor evictable."""
        self._stats = stats
        primary = self.tiers[PRIMARY]
        self.max_blocks = [
            sum(len(primary.ids_in_chunk(g, c)) for c in range(primary.num_chunks))
            for g in range(self.num_groups)
        ]
        """Most primary blocks each group could ever hold (every chunk of the tier)."""

    def has_host(self) -> bool:
        """Whether any group has host-tier capacity (else no block ever sits there)."""
        return any(self.tiers[SECONDARY].capacity)

    def take(self, tier: int, g: int) -> int | None:
        """A free id of group ``g``: its lowest free one, else one of a wholly free chunk
        moved from another group; None when neither is left (the caller evicts)."""
        pool = self.tiers[tier]
        block_id = pool.allocate(g)
        if block_id is None and self.steal_chunk(tier, g):
            block_id = pool.allocate(g)
        return block_id

    def take_many(self, tier: int, g: int, count: int) -> list[int]:
        """Up to ``count`` free ids of group ``g``, as ``take`` repeated would give them."""
        pool = self.tiers[tier]
        ids = pool.allocate_many(g, count)
        while len(ids) < count and self.steal_chunk(tier, g):
            ids += pool.allocate_many(g, count - len(ids))
        return ids

    def allocate(self, tier: int, g: int) -> int | None:
        """The lowest free id of group ``g`` in ``tier``, or None (no chunk is moved)."""
        return self.tiers[tier].allocate(g)

    def release(self, tier: int, g: int, block_id: int) -> None:
        self.tiers[tier].release(g, block_id)

    def num_free(self, tier: int, g: int) -> int:
        return self.tiers[tier].num_free(g)

    def steal_chunk(self, tier: int, g: int) -> bool:
        """Move a wholly free chunk from the group with the most free chunks to ``g``."""
        pool = self.tiers[tier]
        best: list[int] = []
        for h in range(self.num_groups):
            if h != g:
                chunks = pool.free_chunks(h)
                if len(chunks) > len(best):
                    best = chunks
        for chunk in best:
            if pool.ids_in_chunk(g, chunk):
                pool.move_free_chunk(chunk, g)
                self._stats.chunk_moves += 1
                return True
        return False

    def shortfall(self, needed: list[int]) -> str | None:
        """Why ``needed`` primary blocks per group cannot be had now, or None if they can
        (free, evictable, or in free chunks other groups could give up)."""
        pool = self.tiers[PRIMARY]
        spare_chunks = {g: pool.free_chunks(g) for g in range(self.num_groups)}
        for g, want in enumerate(needed):
            if want <= 0:
                continue
            have = pool.capacity[g] - self.pinned[PRIMARY][g]  # free or evictable
            if have >= want:
                continue
            for h, chunks in spare_chunks.items():
                if h != g:
                    have += sum(len(pool.ids_in_chunk(g, c)) for c in chunks)
            if have < want:
                return (
                    f"need {want} blocks in pool group {g} but only {have} are free or evictable; "
                    "the rest are pinned by open sequences"
                )
        return None

    def new_private(self, g: int, count: int, ids: list[int]) -> list[Block | None]:
        """``count`` pinned private primary blocks of group ``g``, from ``ids`` (consumed)."""
        taken, ids[:] = ids[:count], ids[count:]
        out: list[Block | None] = []
        for block_id in taken:
            block = Block(g, PRIMARY, block_id)
            block.ref_count = 1
            out.append(block)
        self.pinned[PRIMARY][g] += len(taken)
        return out

    def usage(self, tier: int, g: int) -> tuple[int, int, int]:
        """Blocks total, free and pinned of group ``g`` in ``tier``."""
        pool = self.tiers[tier]
        return pool.capacity[g], pool.num_free(g), self.pinned[tier][g]

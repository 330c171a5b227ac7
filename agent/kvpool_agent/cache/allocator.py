"""Free block ids of one tier, per group, and the chunks each group owns.

A tier's arena is cut into equal chunks; each chunk belongs to one group, which hands out
the ids of its blocks that lie wholly inside it (``sizing.block_ids_in_chunk``). Free ids
come lowest first, so a group fills its low chunks and leaves whole chunks free at the top:
those are what ``move_free_chunk`` gives to a group that runs short.
"""

from __future__ import annotations

import heapq

from kvpool_agent.cache.sizing import PoolPlan, TierPlan, block_ids_in_chunk


class TierAllocator:
    """Free lists and chunk ownership of one tier."""

    def __init__(self, plan: PoolPlan, tier: TierPlan) -> None:
        self._block_bytes = [g.block_bytes for g in plan.groups]
        self._chunk_bytes = tier.chunk_bytes
        self.num_chunks = tier.num_chunks
        n = len(plan.groups)
        self.owner: list[int] = []
        for group, count in enumerate(tier.group_chunks):
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

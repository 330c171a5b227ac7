"""The offline optimum for prefix caching: Belady's MIN on a prefix-closed cache.

A request reuses the longest run of its leading blocks that are cached. Its other blocks
are computed; the optimum may cache each of them (evicting if full) or not, in order, but a
block is only cached with its whole prefix, and only a cached block with no cached child
that the running request does not use can be evicted: the cache stays prefix-closed.

MIN caches a missed block when it will be used again sooner than the evictable block used
farthest in the future, which it then evicts. A block is used by every request that uses
a block below it, so its next use is never later than its children's: the farthest next
use is always found at a leaf, evicting leaves keeps the cache prefix-closed, and once a
block is passed over, nothing below it is worth caching either. Time is the request index;
all blocks of one request share it. The tests check the result against an exhaustive
search over every cache/evict choice on small random traces.

Cost: one max-heap of (next use, leaf) with lazy deletion, so about O(B log B) for B block
accesses (gsp_zipf's 2.2M accesses take a few seconds).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from kvpool_agent.replay.prefix import PrefixPaths


@dataclass(frozen=True, slots=True)
class OptimalResult:
    """Hits of the optimum: per request, how many leading blocks were cached."""

    capacity: int
    hit_blocks: int
    total_blocks: int
    per_request: list[int]

    @property
    def block_hit_rate(self) -> float:
        return self.hit_blocks / self.total_blocks if self.total_blocks else 0.0


def next_uses(prefix: PrefixPaths) -> list[list[int]]:
    """For each request and position, the index of the next request using that block.

    ``len(prefix.paths)`` stands for "never again".
    """
    never = len(prefix.paths)
    last = [never] * prefix.num_nodes
    out: list[list[int]] = [[] for _ in prefix.paths]
    for r in range(len(prefix.paths) - 1, -1, -1):
        path = prefix.paths[r]
        nxt = [last[n] for n in path]
        for n in path:
            last[n] = r
        out[r] = nxt
    return out


def optimal_hits(
    prefix: PrefixPaths, capacity: int, nexts: list[list[int]] | None = None
) -> OptimalResult:
    """Replay ``prefix`` through Belady's MIN with ``capacity`` blocks.

    ``nexts`` (from :func:`next_uses`) can be passed in when several capacities are tried on
    the same trace.
    """
    if capacity < 1:
        raise ValueError(f"capacity must be at least one block, got {capacity}")
    if nexts is None:
        nexts = next_uses(prefix)
    never = len(prefix.paths)
    parent = prefix.parent
    n_nodes = prefix.num_nodes
    cached = bytearray(n_nodes)
    children = [0] * n_nodes  # cached children of each node
    cur_next = [0] * n_nodes  # next use of each cached node, as of its last use
    heap: list[tuple[int, int]] = []  # (-next use, leaf); stale entries skipped on pop
    size = 0
    hits = 0
    per_request: list[int] = []
    push, pop = heapq.heappush, heapq.heappop
    for r, path in enumerate(prefix.paths):
        nxt = nexts[r]
        length = len(path)
        h = 0
        while h < length and cached[path[h]]:
            h += 1
        hits += h
        per_request.append(h)
        # Blocks of this request have next use r until updated below, so they sort last
        # and are never taken as victims (a victim must be used later than the new block).
        end = h
        while end < length:
            want = nxt[end]
            if want == never:
                break
            if size >= capacity:
                victim = -1
                while heap:
                    neg, cand = heap[0]
                    if not cached[cand] or children[cand] or cur_next[cand] != -neg:
                        pop(heap)
                        continue
                    if -neg > want:
                        pop(heap)
                        victim = cand
                    break
                if victim < 0:
                    break
                cached[victim] = 0
                size -= 1
                p = parent[victim]
                if p >= 0:
                    children[p] -= 1
                    if not children[p]:
                        push(heap, (-cur_next[p], p))
            node = path[end]
            cached[node] = 1
            cur_next[node] = r
            size += 1
            p = parent[node]
            if p >= 0:
                children[p] += 1
            end += 1
        for i in range(end):
            cur_next[path[i]] = nxt[i]
        if end:
            last = path[end - 1]
            if not children[last]:
                push(heap, (-nxt[end - 1], last))
    return OptimalResult(capacity, hits, prefix.total_blocks, per_request)

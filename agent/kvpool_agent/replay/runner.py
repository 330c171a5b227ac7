"""Replay a trace through the real cache engine and count its hits.

Each trace block becomes ``block_size`` tokens derived from its hash id (block ``h`` holds
tokens ``h * B .. h * B + B - 1``), so equal ids give equal token blocks and the engine's
radix tree, pools and eviction queues see the trace unchanged. Requests are opened and
released in arrival order with ``recompute_last_token=False``: every leading cached block
counts as a hit, as in the trace README. The KV storage is a 1-layer, 1-head, head-dim-1
model so that memory stays tiny whatever the capacity.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

from kvpool_agent.config import KvCacheConfig, ModelGeometry
from kvpool_agent.traces import HitRates, Trace

REPLAY_MODEL = ModelGeometry(name="replay", num_layers=1, num_kv_heads=1, head_dim=1)
"""The smallest geometry the engine accepts: only block counts matter to a replay."""

Progress = Callable[[int], None]
"""Called with the number of requests just replayed (for a progress bar)."""


@dataclass(frozen=True, slots=True)
class ReplayResult(HitRates):
    """Hit figures of one replay: blocks as the trace counts them, and prompt tokens."""

    trace: str
    policy: str
    capacity_blocks: int
    requests: int
    query_blocks: int
    hit_blocks: int
    query_tokens: int
    hit_tokens: int
    evictions: int

    def as_dict(self) -> dict[str, float | int | str]:
        out: dict[str, float | int | str] = dict(asdict(self))
        out["block_hit_rate"] = self.block_hit_rate
        out["token_hit_rate"] = self.token_hit_rate
        return out


def block_tokens(hash_id: int, block_size: int) -> range:
    """The tokens standing for trace block ``hash_id``."""
    start = hash_id * block_size
    return range(start, start + block_size)


def replay(
    trace: Trace,
    capacity_blocks: int,
    policy: str = "lru",
    progress: Progress | None = None,
) -> ReplayResult:
    """Replay ``trace`` through a ``KVCacheManager`` holding ``capacity_blocks`` blocks.

    Token hits are the reused blocks' tokens, capped at the request's ``input_length``
    (the last block of a prompt may be partial). Raises the engine's
    ``RequestTooLargeError`` when one request alone needs more than the capacity.
    """
    from kvpool_agent.cache.manager import KVCacheManager

    size = trace.block_size
    config = KvCacheConfig(tokens_per_block=size, event_buffer_max_size=0, eviction_policy=policy)
    manager = KVCacheManager.with_capacity(REPLAY_MODEL, config, num_blocks=capacity_blocks)
    query_blocks = hit_blocks = query_tokens = hit_tokens = 0
    done = 0
    for request in trace.requests:
        ids = request.hash_ids
        query_blocks += len(ids)
        query_tokens += request.input_length
        done += 1
        if not ids:
            continue
        tokens: list[int] = []
        for h in ids:
            tokens.extend(block_tokens(h, size))
        handle = manager.open_sequence(tokens, recompute_last_token=False)
        reused = handle.num_reused_tokens // size
        manager.release(handle.seq_id)
        hit_blocks += reused
        hit_tokens += min(reused * size, request.input_length)
        if progress is not None and done % 64 == 0:
            progress(64)
    if progress is not None and done % 64:
        progress(done % 64)
    return ReplayResult(
        trace=trace.name,
        policy=policy,
        capacity_blocks=capacity_blocks,
        requests=len(trace.requests),
        query_blocks=query_blocks,
        hit_blocks=hit_blocks,
        query_tokens=query_tokens,
        hit_tokens=hit_tokens,
        evictions=manager.stats.evictions[0],
    )

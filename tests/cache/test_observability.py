"""Counters, the ghost list of capacity misses, usage and KV events."""

from __future__ import annotations

from cache_helpers import make_manager

from kvpool_agent.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, BlockUpdated


def test_query_and_hit_counters() -> None:
    mgr = make_manager(16)
    mgr.release(mgr.open_sequence(list(range(10))).seq_id)
    mgr.release(mgr.open_sequence(list(range(10))).seq_id)
    s = mgr.stats
    assert s.queries_tokens == 20 and s.queries_blocks == 6
    assert s.hits_tokens == [8, 0]  # the unfilled third block was never stored
    assert s.hits_blocks == [2, 0]
    assert s.partial_hit_tokens == 0
    assert s.miss_tokens == 12


def test_ghost_list_counts_capacity_misses() -> None:
    mgr = make_manager(3)
    mgr.release(mgr.open_sequence([1] * 8 + [0]).seq_id)  # 2 nodes
    mgr.release(mgr.open_sequence([2] * 8 + [0]).seq_id)  # evicts both
    assert mgr.stats.evictions[0] >= 2
    mgr.release(mgr.open_sequence([1] * 8 + [0]).seq_id)
    # A bigger cache would have hit both blocks of the first prompt.
    assert mgr.stats.capacity_miss_blocks == 2
    assert mgr.stats.capacity_miss_tokens == 8
    # A prompt never seen is a compulsory miss, not a capacity miss.
    mgr.release(mgr.open_sequence([5] * 8 + [0]).seq_id)
    assert mgr.stats.capacity_miss_blocks == 2


def test_usage_per_pool_and_tier() -> None:
    mgr = make_manager(8, host_blocks=4)
    h = mgr.open_sequence(list(range(10)))
    rows = {(r["pool"], r["tier"]): r for r in mgr.usage()}
    assert rows[(0, "primary")]["blocks_used"] == 3
    assert rows[(0, "primary")]["blocks_pinned"] == 3
    assert rows[(0, "primary")]["blocks_total"] == 8
    assert rows[(0, "secondary")]["blocks_total"] == 4
    mgr.release(h.seq_id)
    rows = {(r["pool"], r["tier"]): r for r in mgr.usage()}
    assert rows[(0, "primary")]["blocks_used"] == 2  # two reusable blocks stay
    assert rows[(0, "primary")]["blocks_pinned"] == 0


def test_events_stored_updated_removed() -> None:
    mgr = make_manager(2, host_blocks=1)
    events = mgr.events.drain()
    assert events == [AllBlocksCleared()]
    mgr.release(mgr.open_sequence([1] * 4 + [0]).seq_id)
    (stored,) = mgr.events.drain()
    assert isinstance(stored, BlockStored)
    assert (
        stored.token_ids == (1, 1, 1, 1) and stored.parent_key is None and stored.tier == "primary"
    )
    mgr.release(mgr.open_sequence([2] * 4 + [0]).seq_id)  # offloads [1]
    mgr.release(mgr.open_sequence([3] * 4 + [0]).seq_id)  # offloads [2], drops [1] from host
    kinds = [type(e) for e in mgr.events.drain()]
    assert BlockUpdated in kinds and BlockRemoved in kinds
    removed = [e for e in mgr.events.drain()]
    assert removed == []


def test_event_queue_is_bounded() -> None:
    mgr = make_manager(64, event_buffer_max_size=5)
    for i in range(10):
        mgr.release(mgr.open_sequence([i] * 5).seq_id)
    assert len(mgr.events) == 5
    assert mgr.events.dropped == 6  # AllBlocksCleared + 10 stored - 5 kept

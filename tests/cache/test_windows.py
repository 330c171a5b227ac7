"""Limited attention windows: sliding release, interior eviction in window groups only."""

from __future__ import annotations

import pytest
from cache_helpers import TPB, make_manager

from kvpool_agent.config import ModelGeometry

# Layer 0 full attention, layer 1 a window of 8 tokens (two blocks).
MODEL = ModelGeometry(num_layers=2, num_kv_heads=1, head_dim=2, dtype="float32")


def _mgr(blocks: int = 16, **kw):  # type: ignore[no-untyped-def]
    return make_manager(blocks, model=MODEL, max_attention_window=[1 << 20, 8], **kw)


def test_two_groups_and_window_tables() -> None:
    mgr = _mgr()
    assert [g.window for g in mgr.plan.groups] == [1 << 20, 8]
    h = mgr.open_sequence(list(range(20)))
    assert len(h.block_tables[0]) == 5 and len(h.block_tables[1]) == 5  # prefill needs all


def test_blocks_leaving_the_window_are_released_to_the_tree() -> None:
    mgr = _mgr()
    tokens = list(range(20))
    h = mgr.open_sequence(tokens)
    h = mgr.append_tokens(h.seq_id, [20])
    # Queries from position 20 on see keys 13..20: window blocks 0..2 are released.
    assert h.first_token == (0, 12)
    assert len(h.block_tables[1]) == 3
    window_pinned = next(u for u in mgr.usage() if u["pool"] == 1 and u["tier"] == "primary")
    assert window_pinned["blocks_pinned"] == 3
    # Released window blocks stay in the tree: reusable by a prefix ending near them.
    nodes = {n.tokens[0]: n for n in mgr.iter_nodes()}
    assert nodes[0].blocks[1] is not None and nodes[0].blocks[1].ref_count == 0


def test_reuse_needs_only_the_window_blocks() -> None:
    mgr = _mgr()
    tokens = list(range(24))
    mgr.release(mgr.open_sequence(tokens).seq_id)
    h = mgr.open_sequence(tokens + [99])
    assert h.num_reused_tokens == 24
    # The full group pins all 6 blocks, the window group only those covering 17..24.
    assert len(h.block_tables[0]) == 7
    assert h.first_token[1] == 16 and len(h.block_tables[1]) == 3


@pytest.mark.python_core
def test_window_group_evicts_interior_blocks_and_later_blocks_stay_reusable() -> None:
    # Window group share is small: it must evict while the full group still has room.
    mgr = _mgr(12)
    a = list(range(100, 124))  # 6 blocks
    mgr.release(mgr.open_sequence(a).seq_id)
    nodes = {n.tokens[0]: n for n in mgr.iter_nodes()}
    # Evict the window copy of the first (interior) block by hand through the policy path.
    first = nodes[100]
    window_block = first.blocks[1]
    assert window_block is not None
    mgr._core.tiers.evict(0, 1, 0, mgr.clock())  # no-op: nothing requested
    victim_ids = []
    queue = mgr._core.tree.queues[0][1]
    while len(victim_ids) < 1:
        victim_ids = mgr._core.tiers.evict(0, 1, 1, mgr.clock())
    assert first.blocks[1] is None  # the interior window block went (LRU: oldest first)
    assert first.blocks[0] is not None  # the full-attention copy stays
    assert len(queue) >= 1
    # The whole prefix is still reusable: its end only needs the last window blocks.
    h = mgr.open_sequence(a + [1])
    assert h.num_reused_tokens == 24
    # A prefix that ends inside the evicted window block cannot be reused that far.
    mgr.release(h.seq_id)
    short = mgr.open_sequence(a[:4] + [5], recompute_last_token=False)
    assert short.num_reused_tokens == 0


@pytest.mark.python_core
def test_full_attention_group_evicts_leaves_only() -> None:
    mgr = make_manager(6)
    mgr.release(mgr.open_sequence(list(range(17))).seq_id)  # a chain of 4 nodes
    chain = sorted(mgr.iter_nodes(), key=lambda n: n.depth)
    queue = mgr._core.tree.queues[0][0]
    assert len(queue) == 1  # only the leaf is evictable
    victim = queue.pop(0.0)
    assert victim is not None and victim.node is chain[-1]
    queue.push(victim, 0.0)


@pytest.mark.python_core
def test_free_capacity_moves_to_the_group_that_needs_it() -> None:
    from kvpool_agent.cache import KVCacheManager
    from kvpool_agent.config import KvCacheConfig

    cfg = KvCacheConfig(tokens_per_block=TPB, max_attention_window=[1 << 20, 8])
    group_bytes = 2 * 1 * 1 * 2 * TPB * 4
    mgr = KVCacheManager(MODEL, cfg, primary_bytes=256 * 256, max_seq_len=64)
    start = list(mgr._core.pool.tiers[0].capacity)
    assert start[1] < start[0] // 3  # the window group starts small
    assert group_bytes > 0
    # One long prefill needs as many window blocks as full blocks.
    n_blocks = start[1] + 10
    h = mgr.open_sequence(list(range(n_blocks * TPB)))
    assert len(h.block_tables[1]) == n_blocks
    assert mgr.stats.chunk_moves > 0
    after = mgr._core.pool.tiers[0].capacity
    assert after[1] > start[1] and after[0] < start[0]
    assert mgr.stats.evictions == [0, 0]  # free capacity moved; nothing reusable was dropped

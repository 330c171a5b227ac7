"""The host tier: offload by priority, findable when offloaded, onboard on reuse, batched."""

from __future__ import annotations

import pytest
from cache_helpers import expected_kv, make_manager, read_kv, write_kv

from kvpool_agent.cache import KvCacheRetentionConfig, TokenRangeRetentionConfig
from kvpool_agent.cache import storage as storage_mod


def _fill(mgr, tokens, retention=None):  # type: ignore[no-untyped-def]
    h = mgr.open_sequence(tokens, retention=retention)
    write_kv(mgr, h, tokens)
    mgr.release(h.seq_id)
    return h


def test_evicted_block_is_offloaded_and_onboarded_intact() -> None:
    mgr = make_manager(4, host_blocks=8)
    first = list(range(100, 109))
    _fill(mgr, first)
    for i in range(3):
        _fill(mgr, [i] * 9)
    assert mgr.stats.offloads >= 2
    tiers = {n.tokens: n.blocks[0].tier for n in mgr.iter_nodes()}
    assert tiers[tuple(first[:4])] == 1  # still in the tree, on the host
    h = mgr.open_sequence(first)
    assert h.num_reused_tokens == 8
    assert mgr.stats.onboards >= 2
    assert mgr.stats.hits_tokens[1] == 8
    assert read_kv(mgr, h, 8) == expected_kv(h, first, 8)


def test_blocks_below_the_threshold_are_dropped_not_offloaded() -> None:
    mgr = make_manager(2, host_blocks=8, secondary_offload_min_priority=35)
    low = KvCacheRetentionConfig(
        token_range_retention_configs=[TokenRangeRetentionConfig(priority=34)]
    )
    _fill(mgr, [1] * 5, retention=low)
    _fill(mgr, [2] * 5)
    _fill(mgr, [3] * 5)
    stored = {n.tokens[0]: n.blocks[0].tier for n in mgr.iter_nodes()}
    assert 1 not in stored  # priority 34 < 35: dropped
    assert stored[2] == 1  # priority 35 >= 35: offloaded to the host tier


def test_host_tier_evicts_with_the_same_policy() -> None:
    mgr = make_manager(2, host_blocks=2)
    for i in range(4):
        _fill(mgr, [i] * 5)
    # primary holds 3, host holds 2 and 1; 0 fell off the host tier (oldest).
    assert mgr.stats.evictions[1] == 1
    stored = {n.tokens[0]: n.blocks[0].tier for n in mgr.iter_nodes()}
    assert stored == {1: 1, 2: 1, 3: 0}


def test_tier_copies_are_batched(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = storage_mod.copy_blocks

    def counting(src, dst, src_ids, dst_ids):  # type: ignore[no-untyped-def]
        calls.append(len(src_ids))
        real(src, dst, src_ids, dst_ids)

    monkeypatch.setattr(storage_mod, "copy_blocks", counting)
    mgr = make_manager(9, host_blocks=16)
    tokens = list(range(33))
    _fill(mgr, tokens)  # 8 full blocks
    calls.clear()
    _fill(mgr, [7] * 33)  # evicts (offloads) all 8 at once
    assert calls == [8]
    calls.clear()
    h = mgr.open_sequence(tokens)  # onboards 8 blocks in one call (and offloads the other 8)
    assert h.num_reused_tokens == 32
    assert sorted(calls) == [8, 8]


def test_partial_reuse_from_the_host_tier_copies_directly() -> None:
    mgr = make_manager(2, host_blocks=4)
    _fill(mgr, [1, 2, 3, 4, 5])
    _fill(mgr, [9, 9, 9, 9, 9])
    _fill(mgr, [8, 8, 8, 8, 8])
    h = mgr.open_sequence([1, 2, 7, 7])
    assert h.num_reused_tokens == 2
    assert read_kv(mgr, h, 2) == expected_kv(h, [1, 2], 2)

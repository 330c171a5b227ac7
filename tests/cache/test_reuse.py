"""Reuse across requests: the radix tree, sharing, tenant isolation, switching reuse off."""

from __future__ import annotations

from cache_helpers import TPB, expected_kv, make_manager, read_kv, write_kv


def test_full_blocks_are_reused_and_read_back() -> None:
    mgr = make_manager()
    tokens = list(range(10))
    h = mgr.open_sequence(tokens)
    assert h.num_reused_tokens == 0 and len(h.block_tables[0]) == 3
    write_kv(mgr, h, tokens)
    mgr.release(h.seq_id)
    h2 = mgr.open_sequence(tokens + [99])
    assert h2.num_reused_tokens == 8  # two full blocks
    assert h2.block_tables[0][:2] == h.block_tables[0][:2]
    assert read_kv(mgr, h2, 8) == expected_kv(h2, tokens, 8)


def test_last_token_is_recomputed_unless_asked() -> None:
    mgr = make_manager()
    tokens = list(range(8))
    h = mgr.open_sequence(tokens)
    mgr.release(h.seq_id)
    assert mgr.open_sequence(tokens).num_reused_tokens == 7  # partial reuse of the last block
    assert mgr.open_sequence(tokens, recompute_last_token=False).num_reused_tokens == 8


def test_block_enters_tree_when_full_on_append() -> None:
    mgr = make_manager()
    h = mgr.open_sequence([1, 2, 3])
    mgr.append_tokens(h.seq_id, [4])  # block 0 now full, its KV not yet declared written
    assert mgr.num_nodes == 0
    mgr.append_tokens(h.seq_id, [5])  # tokens 1..4 written: block 0 enters the tree at once
    assert mgr.num_nodes == 1
    other = mgr.open_sequence([1, 2, 3, 4, 9], recompute_last_token=False)
    assert other.num_reused_tokens == 4


def test_shared_blocks_are_reference_counted() -> None:
    mgr = make_manager()
    tokens = list(range(12))
    first = mgr.open_sequence(tokens)
    mgr.release(first.seq_id)
    a = mgr.open_sequence(tokens + [100])
    b = mgr.open_sequence(tokens + [200])
    shared = a.block_tables[0][:3]
    assert shared == b.block_tables[0][:3]
    node_blocks = {n.blocks[0].block_id: n.blocks[0].ref_count for n in mgr.iter_nodes()}
    assert all(node_blocks[i] == 2 for i in shared)
    mgr.release(a.seq_id)
    node_blocks = {n.blocks[0].block_id: n.blocks[0].ref_count for n in mgr.iter_nodes()}
    assert all(node_blocks[i] == 1 for i in shared)
    mgr.release(b.seq_id)
    assert all(n.blocks[0].ref_count == 0 for n in mgr.iter_nodes())


def test_cache_salt_isolates_tenants() -> None:
    mgr = make_manager()
    tokens = list(range(9))
    mgr.release(mgr.open_sequence(tokens, cache_salt="tenant-a").seq_id)
    assert mgr.open_sequence(tokens, cache_salt="tenant-b").num_reused_tokens == 0
    assert mgr.open_sequence(tokens).num_reused_tokens == 0
    assert mgr.open_sequence(tokens, cache_salt="tenant-a").num_reused_tokens == 8


def test_extra_keys_isolate_adapters() -> None:
    mgr = make_manager()
    tokens = list(range(9))
    mgr.release(mgr.open_sequence(tokens, extra_keys=["lora-1"]).seq_id)
    assert mgr.open_sequence(tokens, extra_keys=["lora-2"]).num_reused_tokens == 0
    assert mgr.open_sequence(tokens, extra_keys=["lora-1"]).num_reused_tokens == 8


def test_reuse_can_be_switched_off() -> None:
    mgr = make_manager(enable_block_reuse=False)
    tokens = list(range(9))
    h = mgr.open_sequence(tokens)
    mgr.release(h.seq_id)
    assert mgr.num_nodes == 0
    assert mgr.open_sequence(tokens).num_reused_tokens == 0
    assert mgr.usage()[0]["blocks_used"] == 3  # only the open sequence's blocks


def test_concurrent_identical_blocks_keep_one_copy() -> None:
    mgr = make_manager()
    tokens = list(range(8))
    a = mgr.open_sequence(tokens)
    b = mgr.open_sequence(tokens)  # nothing stored yet: computes its own copy
    assert b.num_reused_tokens == 0
    mgr.release(a.seq_id)
    mgr.release(b.seq_id)
    assert mgr.num_nodes == 2
    assert mgr.usage()[0]["blocks_used"] == 2  # b's duplicates were freed
    assert mgr.open_sequence(tokens, recompute_last_token=False).num_reused_tokens == TPB * 2

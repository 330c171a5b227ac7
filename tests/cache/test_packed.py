"""Tree nodes keep a key and their tokens packed (``cache/packed.py``), not a tuple of ints:
matches are found by key and confirmed by the packed tokens, partial matches read them, and
snapshots still restore the same tree."""

from __future__ import annotations

import pytest
from cache_helpers import TPB, expected_kv, make_manager, read_kv, write_kv

from kvpool_agent.cache import KVCacheManager, SequenceHandle
from kvpool_agent.cache.block import TreeNode
from kvpool_agent.cache.packed import (
    block_key,
    confirmed,
    first_token,
    pack,
    pack_all,
    pack_blocks,
    shared_prefix,
    slice_blocks,
    unpack,
)
from kvpool_agent.server.snapshot import export_snapshot, import_snapshot

BIG = 2**40
"""A token id past 32 bits: such blocks are kept as tuples."""


def _store(mgr: KVCacheManager, tokens: list[int]) -> SequenceHandle:
    h = mgr.open_sequence(tokens)
    write_kv(mgr, h, tokens)
    mgr.release(h.seq_id)
    return h


def _node(mgr: KVCacheManager, tokens: tuple[int, ...]) -> TreeNode:
    (node,) = [n for n in mgr.iter_nodes() if n.tokens == tokens]
    return node


# ----------------------------------------------------------------- the packed form


def test_pack_is_4_bytes_a_token_and_round_trips() -> None:
    tokens = [0, 1, 2**31, 2**32 - 1]
    packed = pack(tokens)
    assert isinstance(packed, bytes) and len(packed) == 4 * len(tokens)
    assert unpack(packed) == tuple(tokens)
    assert first_token(packed) == 0


def test_tokens_past_32_bits_stay_a_tuple_and_never_equal_a_packed_block() -> None:
    packed = pack([1, BIG])
    assert packed == (1, BIG) and unpack(packed) == (1, BIG)
    assert pack([1, 2**32]) != pack([1, 0])  # no wrap-around
    assert pack([1, 2]) != (1, 2)  # the canonical forms of equal tokens are equal, and only those


def test_pack_all_packs_the_uint32_range_only() -> None:
    assert pack_all([0, 1, 2**32 - 1]) == pack([0, 1, 2**32 - 1])
    assert pack_all([0, 2**32]) is None
    assert pack_all([3, -1]) is None
    assert slice_blocks(pack_all(list(range(12))) or b"", 1, 3, 4) == pack_blocks(
        list(range(4, 12)), 4
    )


def test_pack_blocks_packs_each_block_alone() -> None:
    tokens = [1, 2, 3, 4, BIG, 6, 7, 8, 9, 10, 11, 12]
    assert pack_blocks(tokens, 4) == [pack(tokens[i : i + 4]) for i in (0, 4, 8)]
    assert [type(p) for p in pack_blocks(tokens, 4)] == [bytes, tuple, bytes]
    small = list(range(8))
    assert pack_blocks(small, 4) == [pack(small[:4]), pack(small[4:])]


def test_shared_prefix_counts_leading_equal_tokens() -> None:
    assert shared_prefix(pack([5, 6, 7, 8]), [5, 6, 9]) == 2
    assert shared_prefix(pack([5, 6, 7, 8]), [4]) == 0
    assert shared_prefix(pack([5, 6, 7, 8]), [5, 6, 7, 8]) == 4
    assert shared_prefix(pack([5, BIG, 7, 8]), [5, BIG, 9]) == 2
    for block in ([5, 6, 7, 8], [4, 6, 7, 8], [5, BIG, 7, 8], [BIG, 6]):
        for rest in ([5, 6, 9], [4], [BIG, 6], [5, BIG]):
            head = pack(rest[:1])
            assert shared_prefix(pack(block), rest, head) == shared_prefix(pack(block), rest)


def test_confirmed_stops_at_the_first_block_that_differs() -> None:
    tokens = list(range(12))
    blocks = [pack(tokens[0:4]), pack(tokens[4:8]), pack(tokens[8:12])]
    assert confirmed(blocks, tokens, 4) == 3
    assert confirmed([blocks[0], pack([9, 9, 9, 9]), blocks[2]], tokens, 4) == 1
    big = [BIG, *range(1, 8)]
    assert confirmed([pack(big[:4]), pack(big[4:])], big, 4) == 2
    assert confirmed([pack(big[:4]), pack([0, 0, 0, 0])], big, 4) == 1


def test_nodes_keep_packed_tokens_not_tuples() -> None:
    mgr = make_manager()
    _store(mgr, [1000, 1001, 1002, 1003, 2000, 2001, 2002, 2003, 0])
    nodes = sorted(mgr.iter_nodes(), key=lambda n: n.depth)
    assert [type(n.packed) for n in nodes] == [bytes, bytes]
    assert [len(n.packed) for n in nodes] == [4 * TPB, 4 * TPB]
    assert [n.tokens for n in nodes] == [(1000, 1001, 1002, 1003), (2000, 2001, 2002, 2003)]
    root = nodes[0].parent
    assert root is not None
    assert root.children == {nodes[0].key: nodes[0]}
    assert nodes[0].key == block_key(root.key, (1000, 1001, 1002, 1003))
    assert nodes[1].key == block_key(nodes[0].key, (2000, 2001, 2002, 2003))


# ----------------------------------------------------------------- matching


def test_partial_match_reads_the_packed_tokens() -> None:
    mgr = make_manager(copy_on_partial_reuse=True)
    _store(mgr, [1, 2, 3, 4, 5000, 6000, 7000, 8000, 0])
    h = mgr.open_sequence([1, 2, 3, 4, 5000, 6000, 70, 80, 90])
    assert h.num_reused_tokens == 6
    assert read_kv(mgr, h, 6) == expected_kv(h, [1, 2, 3, 4, 5000, 6000], 6)


def test_partial_match_among_many_children_uses_the_first_token_index() -> None:
    mgr = make_manager(64, copy_on_partial_reuse=True)
    for first in range(20):  # past HEADS_FROM children of the root
        _store(mgr, [100 + first, 7, 8, 9, 0])
    assert mgr.open_sequence([105, 7, 1, 1, 1]).num_reused_tokens == 2
    assert mgr.open_sequence([99, 7, 8, 9, 1]).num_reused_tokens == 0


def test_big_token_ids_match_fully_and_partially() -> None:
    mgr = make_manager(copy_on_partial_reuse=True)
    tokens = [BIG, BIG + 1, 3, 4, BIG + 5, 6, 7, 8, 0]
    _store(mgr, tokens)
    assert {type(n.packed) for n in mgr.iter_nodes()} == {tuple}
    assert mgr.open_sequence(tokens).num_reused_tokens == 8
    assert mgr.open_sequence([BIG, BIG + 1, 3, 4, BIG + 5, 6, 0, 0, 0]).num_reused_tokens == 6
    # the same tokens mod 2**32 are other tokens
    low = [t % 2**32 for t in tokens]
    assert mgr.open_sequence(low).num_reused_tokens == 0


def _collide(mgr: KVCacheManager, stored: tuple[int, ...], other: tuple[int, ...]) -> TreeNode:
    """Re-key ``stored``'s node under ``other``'s key, as if their keys had collided."""
    node = _node(mgr, stored)
    parent = node.parent
    assert parent is not None
    del parent.children[node.key]
    node.key = block_key(parent.key, other)
    parent.children[node.key] = node
    return node


@pytest.mark.python_core
def test_a_key_collision_is_a_miss_never_another_blocks_kv() -> None:
    mgr = make_manager(enable_partial_reuse=False)
    _store(mgr, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    _collide(mgr, (5, 6, 7, 8), (5, 6, 7, 9))
    # Found by key, refused by its tokens: only the first block is reused.
    assert mgr.lookup([1, 2, 3, 4, 5, 6, 7, 9]) == ["primary"]
    h = mgr.open_sequence([1, 2, 3, 4, 5, 6, 7, 9, 0])
    assert h.num_reused_tokens == 4
    mgr.release(h.seq_id, discard=True)


@pytest.mark.python_core
def test_a_collided_block_still_serves_the_tokens_it_shares() -> None:
    mgr = make_manager(copy_on_partial_reuse=True)
    _store(mgr, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    _collide(mgr, (5, 6, 7, 8), (5, 6, 7, 9))
    tokens = [1, 2, 3, 4, 5, 6, 7, 9, 0]
    h = mgr.open_sequence(tokens)
    assert h.num_reused_tokens == 7  # a partial match, measured on its real tokens
    assert read_kv(mgr, h, 7) == expected_kv(h, tokens[:7], 7)


@pytest.mark.python_core
def test_a_block_whose_key_collides_is_not_stored_over_the_other() -> None:
    mgr = make_manager(enable_partial_reuse=False)
    _store(mgr, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    node = _collide(mgr, (5, 6, 7, 8), (5, 6, 7, 9))
    nodes = mgr.num_nodes
    tokens = [1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 0]
    h = _store(mgr, tokens)
    assert h.num_reused_tokens == 4
    # The colliding block and those after it stayed private: nothing joined the other node.
    assert mgr.num_nodes == nodes
    assert node.tokens == (5, 6, 7, 8)
    assert all(b is None or b.node is node for b in node.blocks)
    assert sum(int(u["blocks_used"]) for u in mgr.usage() if u["tier"] == "primary") == nodes
    assert mgr.open_sequence(tokens).num_reused_tokens == 4


@pytest.mark.python_core
def test_a_collision_inside_the_path_truncates_the_match_there() -> None:
    mgr = make_manager(enable_partial_reuse=False)
    _store(mgr, [*range(1, 13), 0])
    middle = _collide(mgr, (5, 6, 7, 8), (5, 6, 7, 0))
    # make the block after it reachable by key too, so the whole path is found by keys
    last = _node(mgr, (9, 10, 11, 12))
    del middle.children[last.key]
    last.key = block_key(middle.key, (9, 10, 11, 12))
    middle.children[last.key] = last
    assert mgr.lookup([1, 2, 3, 4, 5, 6, 7, 0, 9, 10, 11, 12]) == ["primary"]
    assert mgr.open_sequence([1, 2, 3, 4, 5, 6, 7, 0, 9, 10, 11, 12, 0]).num_reused_tokens == 4


# ----------------------------------------------------------------- snapshots


def _tree(mgr: KVCacheManager) -> list[tuple[int, int, tuple[int, ...], int]]:
    return sorted((n.depth, n.key, n.tokens, n.priority) for n in mgr.iter_nodes())


def test_snapshot_round_trip_restores_the_same_tree() -> None:
    src = make_manager(32)
    for tokens in (
        [1, 2, 3, 4, 5, 6, 7, 8, 0],
        [1, 2, 3, 4, 50, 60, 70, 80, 90, 91, 92, 93, 0],
        [2**31, 2**32 - 1, 0, 1, 9],
        [BIG, 1, 2, 3, 4],
    ):
        _store(src, tokens)
    blob = export_snapshot(src, {0: (None, ())})
    dst = make_manager(32)
    import_snapshot(dst, blob)
    assert _tree(dst) == _tree(src)
    assert sorted(n.packed for n in dst.iter_nodes() if isinstance(n.packed, bytes)) == sorted(
        n.packed for n in src.iter_nodes() if isinstance(n.packed, bytes)
    )
    h = dst.open_sequence([1, 2, 3, 4, 50, 60, 70, 80, 90, 91, 92, 93, 0])
    assert h.num_reused_tokens == 12
    assert read_kv(dst, h, 12) == expected_kv(h, [1, 2, 3, 4, 50, 60, 70, 80, 90, 91, 92, 93], 12)

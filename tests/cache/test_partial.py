"""Partial reuse, with and without copy_on_partial_reuse (the reference's semantics)."""

from __future__ import annotations

from cache_helpers import expected_kv, make_manager, read_kv, write_kv


def _store(mgr, tokens):  # type: ignore[no-untyped-def]
    h = mgr.open_sequence(tokens)
    write_kv(mgr, h, tokens)
    mgr.release(h.seq_id)
    return h


def test_copy_on_partial_reuse_copies_into_a_new_block() -> None:
    mgr = make_manager(copy_on_partial_reuse=True)
    stored = _store(mgr, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    h = mgr.open_sequence([1, 2, 3, 4, 5, 6, 70, 80, 90])
    assert h.num_reused_tokens == 6  # one full block + 2 tokens of the next
    assert h.block_tables[0][0] == stored.block_tables[0][0]
    assert h.block_tables[0][1] != stored.block_tables[0][1]  # a copy, not the original
    assert read_kv(mgr, h, 6) == expected_kv(h, [1, 2, 3, 4, 5, 6], 6)
    # The original block stays in the tree for everyone else.
    other = mgr.open_sequence([1, 2, 3, 4, 5, 6, 7, 8, 1])
    assert other.num_reused_tokens == 8


def test_copy_lets_several_requests_partially_reuse_one_block() -> None:
    mgr = make_manager(copy_on_partial_reuse=True)
    _store(mgr, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    a = mgr.open_sequence([1, 2, 3, 4, 5, 6, 70, 80, 90])
    b = mgr.open_sequence([1, 2, 3, 4, 5, 60, 70, 80, 90])
    assert (a.num_reused_tokens, b.num_reused_tokens) == (6, 5)


def test_without_copy_an_unused_block_is_taken_over() -> None:
    mgr = make_manager(copy_on_partial_reuse=False)
    stored = _store(mgr, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    h = mgr.open_sequence([1, 2, 3, 4, 5, 6, 70, 80, 90])
    assert h.num_reused_tokens == 6
    assert h.block_tables[0][1] == stored.block_tables[0][1]  # the same block, now private
    assert read_kv(mgr, h, 6) == expected_kv(h, [1, 2, 3, 4, 5, 6], 6)
    # It left the tree: the old full block is no longer matchable.
    assert mgr.open_sequence([1, 2, 3, 4, 5, 6, 7, 8, 1]).num_reused_tokens == 4


def test_without_copy_a_block_in_use_is_not_partially_reused() -> None:
    mgr = make_manager(copy_on_partial_reuse=False)
    _store(mgr, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    holder = mgr.open_sequence([1, 2, 3, 4, 5, 6, 7, 8, 1])  # pins the second block
    assert holder.num_reused_tokens == 8
    h = mgr.open_sequence([1, 2, 3, 4, 5, 6, 70, 80, 90])
    assert h.num_reused_tokens == 4


def test_partial_reuse_can_be_disabled() -> None:
    mgr = make_manager(enable_partial_reuse=False)
    _store(mgr, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    assert mgr.open_sequence([1, 2, 3, 4, 5, 6, 70, 80, 90]).num_reused_tokens == 4

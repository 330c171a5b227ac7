"""Misuse raises typed errors and leaves the cache exactly as it was."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from cache_helpers import make_manager, state_snapshot, write_kv

from kvpool_agent.cache import (
    InvalidRetentionError,
    InvalidTokensError,
    KVCacheManager,
    OutOfBlocksError,
    RequestTooLargeError,
    UnknownSequenceError,
)


def _busy_manager() -> tuple[KVCacheManager, int]:
    mgr = make_manager(8, host_blocks=4)
    for i in range(3):
        h = mgr.open_sequence([i] * 9)
        write_kv(mgr, h, [i] * 9)
        mgr.release(h.seq_id)
    open_h = mgr.open_sequence([0] * 9)
    return mgr, open_h.seq_id


CASES: list[tuple[str, type[Exception], Callable[[KVCacheManager, int], Any]]] = [
    ("unknown sequence", UnknownSequenceError, lambda m, s: m.release(12345)),
    ("append to unknown", UnknownSequenceError, lambda m, s: m.append_tokens(999, [1])),
    ("bool seq id", UnknownSequenceError, lambda m, s: m.release(True)),
    ("too large", RequestTooLargeError, lambda m, s: m.open_sequence(list(range(100)))),
    ("floats", InvalidTokensError, lambda m, s: m.open_sequence([1.0, 2.0])),
    ("string", InvalidTokensError, lambda m, s: m.open_sequence("hello")),
    ("negative", InvalidTokensError, lambda m, s: m.open_sequence([1, -2])),
    ("bools", InvalidTokensError, lambda m, s: m.open_sequence([True, False])),
    ("empty", InvalidTokensError, lambda m, s: m.open_sequence([])),
    ("wide and bool", InvalidTokensError, lambda m, s: m.open_sequence([1 << 40, True])),
    ("wide and 2**63", InvalidTokensError, lambda m, s: m.open_sequence([1 << 40, 1 << 63])),
    ("wide and negative", InvalidTokensError, lambda m, s: m.open_sequence([1 << 40, -1])),
    ("append floats", InvalidTokensError, lambda m, s: m.append_tokens(s, [0.5])),
    (
        "priority 101",
        InvalidRetentionError,
        lambda m, s: m.open_sequence([1, 2], retention={"decode_retention_priority": 101}),
    ),
    (
        "negative priority",
        InvalidRetentionError,
        lambda m, s: m.open_sequence(
            [1, 2], retention={"token_range_retention_configs": [{"priority": -5}]}
        ),
    ),
    ("bad salt", InvalidTokensError, lambda m, s: m.open_sequence([1], cache_salt=5)),  # type: ignore[arg-type]
]


@pytest.mark.parametrize(("name", "error", "call"), CASES, ids=[c[0] for c in CASES])
def test_misuse_changes_nothing(
    name: str, error: type[Exception], call: Callable[[KVCacheManager, int], Any]
) -> None:
    mgr, seq = _busy_manager()
    before = state_snapshot(mgr)
    with pytest.raises(error):
        call(mgr, seq)
    after = state_snapshot(mgr)
    assert before[:5] == after[:5]
    assert torch.equal(before[5], after[5])


def test_released_sequence_is_unknown() -> None:
    mgr, seq = _busy_manager()
    mgr.release(seq)
    with pytest.raises(UnknownSequenceError, match="not open"):
        mgr.release(seq)


def test_out_of_blocks_when_everything_is_pinned_changes_nothing() -> None:
    mgr = make_manager(4)
    a = mgr.open_sequence(list(range(8)))  # pins 2
    b = mgr.open_sequence(list(range(100, 108)))  # pins 2
    before = state_snapshot(mgr)
    with pytest.raises(OutOfBlocksError, match="pinned"):
        mgr.open_sequence(list(range(200, 205)))
    with pytest.raises(OutOfBlocksError):
        mgr.append_tokens(a.seq_id, [1])
    after = state_snapshot(mgr)
    assert before[:5] == after[:5]
    mgr.release(b.seq_id)
    assert mgr.open_sequence(list(range(200, 205))).num_tokens == 5


def test_out_of_blocks_with_reusable_prefix_unpins_it_again() -> None:
    mgr = make_manager(5)
    mgr.release(mgr.open_sequence(list(range(9))).seq_id)  # stores 2 nodes
    hold = mgr.open_sequence(list(range(50, 58)))  # pins 2 of the 3 free
    before = state_snapshot(mgr)
    with pytest.raises(OutOfBlocksError):
        # Reuses the 2 nodes (pinned for a moment) but needs 2 new blocks: only 1 is left.
        mgr.open_sequence(list(range(8)) + list(range(60, 68)))
    assert state_snapshot(mgr)[:5] == before[:5]
    mgr.release(hold.seq_id)


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ([3, 2, -1, 0.5], "non-negative, got -1"),
        ([3, 0.5, -1], r"ints, got float \(0.5\)"),
        ([1, True], r"ints, got bool \(True\)"),
        ((7, -7), "non-negative, got -7"),
    ],
)
def test_bad_tokens_are_named_in_the_error(tokens: list[Any], message: str) -> None:
    """The first offending token, in prompt order, is the one the error names."""
    mgr = make_manager(8)
    with pytest.raises(InvalidTokensError, match=message):
        mgr.open_sequence(tokens)
    assert mgr.open_sequence(range(5)).num_tokens == 5

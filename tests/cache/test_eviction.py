"""Prioritized LRU and retention policies."""

from __future__ import annotations

import pytest
from cache_helpers import FakeClock, make_manager

from kvpool_agent.cache import KvCacheRetentionConfig, TokenRangeRetentionConfig
from kvpool_agent.cache.eviction.queue import EvictionQueue


class Rec:
    """A minimal evictable record for queue unit tests."""

    def __init__(
        self, block_id: int, priority: int, last_used: int, expires_at: float | None = None
    ):
        self.block_id = block_id
        self.priority = priority
        self.last_used = last_used
        self.expires_at = expires_at
        self.hits = 0
        self.queue_level = -1
        self.queue_stamp = 0


def test_lowest_priority_goes_first_then_lru() -> None:
    q = EvictionQueue()
    recs = [Rec(0, 50, 1), Rec(1, 10, 5), Rec(2, 10, 3), Rec(3, 90, 0), Rec(4, 50, 0)]
    for r in recs:
        q.push(r, now=0.0)  # type: ignore[arg-type]
    order = [q.pop(0.0).block_id for _ in recs]  # type: ignore[union-attr]
    assert order == [2, 1, 4, 0, 3]
    assert q.pop(0.0) is None


def test_discarded_blocks_are_never_returned() -> None:
    q = EvictionQueue()
    recs = [Rec(i, 35, i) for i in range(200)]
    for r in recs:
        q.push(r, 0.0)  # type: ignore[arg-type]
    for r in recs[::2]:
        q.discard(r)  # type: ignore[arg-type]
    assert len(q) == 100
    popped = []
    while (r := q.pop(0.0)) is not None:
        popped.append(r.block_id)
    assert popped == list(range(1, 200, 2))


def test_expired_priority_reverts_to_default_at_its_recency() -> None:
    q = EvictionQueue()
    high = Rec(0, 80, last_used=1, expires_at=10.0)
    normal = Rec(1, 35, last_used=5)
    q.push(high, 0.0)  # type: ignore[arg-type]
    q.push(normal, 0.0)  # type: ignore[arg-type]
    assert q.pop(5.0) is normal  # before expiry the high priority protects
    q.push(normal, 5.0)  # type: ignore[arg-type]
    assert q.pop(11.0) is high  # after expiry: priority 35 and older


def test_engine_evicts_lowest_priority_first(clock: FakeClock) -> None:
    mgr = make_manager(4, clock=clock)
    low = KvCacheRetentionConfig(
        token_range_retention_configs=[TokenRangeRetentionConfig(priority=10)]
    )
    high = KvCacheRetentionConfig(
        token_range_retention_configs=[TokenRangeRetentionConfig(priority=90)]
    )
    a = mgr.open_sequence([1, 2, 3, 4, 0], retention=high)
    mgr.release(a.seq_id)
    b = mgr.open_sequence([5, 6, 7, 8, 0], retention=low)
    mgr.release(b.seq_id)
    c = mgr.open_sequence([9, 9, 9, 9, 0])
    mgr.release(c.seq_id)
    # Need 2 blocks beyond the 1 free: the low-priority block goes although it is newer.
    h = mgr.open_sequence([7] * 8)
    mgr.release(h.seq_id)
    assert {n.tokens for n in mgr.iter_nodes()} >= {(1, 2, 3, 4)}
    assert (5, 6, 7, 8) not in {n.tokens for n in mgr.iter_nodes()}


def test_lru_within_a_priority(clock: FakeClock) -> None:
    mgr = make_manager(4, clock=clock)
    for first in (1, 2, 3):
        mgr.release(mgr.open_sequence([first] * 4 + [0]).seq_id)
    mgr.release(mgr.open_sequence([1] * 4 + [0]).seq_id)  # touch 1: now 2 is oldest
    mgr.release(mgr.open_sequence([8] * 4 + [0]).seq_id)
    survivors = {n.tokens[0] for n in mgr.iter_nodes()}
    assert survivors == {1, 3, 8}


def test_duration_expires_from_first_reusable_time(clock: FakeClock) -> None:
    mgr = make_manager(3, clock=clock)
    keep = KvCacheRetentionConfig(
        token_range_retention_configs=[TokenRangeRetentionConfig(priority=90, duration_ms=1000)]
    )
    mgr.release(mgr.open_sequence([1] * 4 + [0], retention=keep).seq_id)
    mgr.release(mgr.open_sequence([2] * 4 + [0]).seq_id)
    clock.now += 0.5
    mgr.release(mgr.open_sequence([3] * 4 + [0]).seq_id)  # evicts 2: 1 is still protected
    assert {n.tokens[0] for n in mgr.iter_nodes()} == {1, 3}
    mgr2 = make_manager(3, clock=clock)
    mgr2.release(mgr2.open_sequence([1] * 4 + [0], retention=keep).seq_id)
    mgr2.release(mgr2.open_sequence([2] * 4 + [0]).seq_id)
    clock.now += 1.5  # the 90 reverted to 35, and 1 is older than 2
    mgr2.release(mgr2.open_sequence([3] * 4 + [0]).seq_id)
    assert {n.tokens[0] for n in mgr2.iter_nodes()} == {2, 3}


def test_decode_blocks_take_the_decode_priority() -> None:
    policy = KvCacheRetentionConfig(
        token_range_retention_configs=[TokenRangeRetentionConfig(token_end=4, priority=70)],
        decode_retention_priority=5,
        decode_duration_ms=200,
    )
    assert policy.block_priority(0, 4, num_prompt_tokens=6) == (70, None)
    assert policy.block_priority(4, 8, num_prompt_tokens=6) == (5, 200)
    mgr = make_manager(8)
    h = mgr.open_sequence([1, 2, 3, 4, 5, 6], retention=policy)
    mgr.append_tokens(h.seq_id, [7, 8, 9])
    mgr.release(h.seq_id)
    priorities = sorted(n.priority for n in mgr.iter_nodes())
    assert priorities == [5, 70]


@pytest.mark.parametrize(
    "bad",
    [
        {"token_range_retention_configs": [{"priority": 101}]},
        {"token_range_retention_configs": [{"priority": -1}]},
        {"decode_retention_priority": 200},
        {"token_range_retention_configs": [{"priority": 50, "token_start": 5, "token_end": 2}]},
    ],
)
def test_bad_retention_is_rejected(bad: dict) -> None:  # type: ignore[type-arg]
    from kvpool_agent.cache import InvalidRetentionError

    mgr = make_manager()
    with pytest.raises(InvalidRetentionError):
        mgr.open_sequence([1, 2, 3], retention=bad)
    assert mgr.num_open_sequences == 0

"""The voting mixture (``vote.py``), the default ``mixture`` policy. The tests of its order
look at the Python policy (its compiled twin is held to the same victims in
``tests/native``); its bound against LRU is ``test_guarded.py``'s, on both cores."""

from __future__ import annotations

import pytest

from kvpool_agent.cache.eviction import POLICIES, mixture
from kvpool_agent.cache.eviction.vote import VotePolicy
from kvpool_agent.config import KvCacheConfig

LRU_BIT = 1


def popcount(mask: int) -> int:
    return bin(mask).count("1")


def test_the_default_is_the_vote_with_lru_first_and_no_leader() -> None:
    assert KvCacheConfig().eviction_policy == "mixture"
    assert POLICIES["mixture"] is VotePolicy
    policy = VotePolicy(8)
    assert policy.names[0] == "lru"
    assert not policy.takes_lead(100.0, 0.0)


@pytest.mark.python_core
def test_a_block_no_expert_holds_goes_first_and_one_all_hold_goes_last() -> None:
    policy = VotePolicy(8)
    policy.scores = [5.0, 9.0, 1.0, 3.0]
    order = policy.eviction_order()
    assert sorted(order) == list(range(16))
    assert order[0] == 0 and order[-1] == 0b1111


@pytest.mark.python_core
def test_equal_scores_rank_blocks_by_how_many_experts_hold_them() -> None:
    policy = VotePolicy(8)
    policy.scores = [10.0, 10.0, 10.0, 10.0]
    counts = [popcount(m) for m in policy.eviction_order()]
    assert counts == sorted(counts)


@pytest.mark.python_core
def test_an_expert_far_behind_has_almost_no_say() -> None:
    """With LRU far ahead, every block LRU lacks goes before any it holds."""
    policy = VotePolicy(8)
    policy.scores = [100.0, 0.0, 0.0, 0.0]
    order = policy.eviction_order()
    assert [m & LRU_BIT for m in order] == [0] * 8 + [1] * 8
    policy.scores = [0.0, 100.0, 0.0, 0.0]
    policy.observe([1])  # a request: the weights are computed anew
    assert [m >> 1 & 1 for m in policy.eviction_order()] == [0] * 8 + [1] * 8


@pytest.mark.python_core
def test_a_bucket_names_the_experts_whose_shadow_holds_the_key() -> None:
    policy = VotePolicy(2)
    policy.observe([1, 2])
    assert policy.bucket(2) == 0b1111  # every shadow cached the request
    assert policy.bucket(3) == 0
    assert policy.leader == 0 and policy.switches == 0  # nobody takes a lead


@pytest.mark.python_core
def test_the_changed_keys_stay_bounded_while_nothing_is_evicted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The shadows churn while the real cache never evicts (nothing is queued here): the set
    of changed keys is flushed at its bound instead of growing with every request."""
    monkeypatch.setattr(mixture, "DIRTY_FLOOR", 64)
    policy = VotePolicy(8)
    for key in range(1000):
        policy.observe([key])  # each key enters every shadow, an older one leaves
    assert 8 < len(policy._dirty) <= 64 + 8

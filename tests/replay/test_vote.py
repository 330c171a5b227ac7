"""The voting mixture (``vote.py``), the default ``mixture`` policy. The tests of its order
look at the Python policy (its compiled twin is held to the same victims in
``tests/native``); its bound against LRU is ``test_guarded.py``'s, on both cores."""

from __future__ import annotations

import pytest

from kvpool_agent.cache.block import Block, TreeNode
from kvpool_agent.cache.eviction import POLICIES
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
def test_only_queued_keys_are_kept_as_changed() -> None:
    """The shadows churn while nothing is queued in the real cache: no key is kept to
    re-bucket, so the set cannot grow with the requests; a queued key that changes is kept
    until its block leaves the queue."""
    policy = VotePolicy(8)
    for key in range(1000):
        policy.observe([key])  # each key enters every shadow, an older one leaves
    assert not policy._dirty
    queue = policy.new_level()
    node = TreeNode(5000, b"", None, 1)
    block = Block(0, 0, 1)
    block.node = node
    queue.push(block)
    policy.observe([5000])
    assert policy._dirty == {5000}
    queue.discard(block)
    assert not policy._dirty

"""The voting mixture (``vote.py``): a candidate default, run by ``bench/replay_sweep.py`` as
the ``vote`` series and not a config name. The tests of its order look at the Python policy
(its compiled twin is held to the same victims in ``tests/native``); the replay runs on both
cores."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool_agent import config as config_module
from kvpool_agent.cache.eviction import POLICIES
from kvpool_agent.cache.eviction.guarded import MARGIN
from kvpool_agent.cache.eviction.vote import VotePolicy

from .test_guarded import against_lru

LRU_BIT = 1


def popcount(mask: int) -> int:
    return bin(mask).count("1")


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


@pytest.mark.parametrize(("kind", "changes"), [("phases", {"phase": 40, "requests": 800})])
@pytest.mark.parametrize("fraction", [0.01, 0.05, 0.25])
def test_the_vote_stays_within_the_default_s_margin_of_lru(
    kind: str,
    changes: dict[str, object],
    fraction: float,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(POLICIES, "vote", VotePolicy)
    monkeypatch.setattr(
        config_module, "EVICTION_POLICIES", (*config_module.EVICTION_POLICIES, "vote")
    )
    lru, vote = against_lru(kind, changes, fraction, "vote", tmp_path)
    assert vote.hit_blocks >= lru.hit_blocks - MARGIN * lru.query_blocks
    assert vote.hit_blocks > 0

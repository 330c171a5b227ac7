"""The policy curve (``cache/miniature.py``): miniature simulations of the engine's own
eviction policy against exact replays and against the engine itself, the sampled estimate,
the engine's hook (a chain per query), and the bounded queue."""

from __future__ import annotations

import random

import pytest
from cache_helpers import TPB, make_manager
from test_mrc import _spread, lru_hits, zipf_trace

from kvpool_agent.cache.miniature import RATIOS, PolicyMiniature


def warm_lru_hits(trace: list[int], capacity: int, warm: int) -> int:
    """Hits of an exact LRU cache over ``trace``, counted after the first ``warm`` keys."""
    return lru_hits(trace, capacity) - lru_hits(trace[:warm], capacity)


def feed(mini: PolicyMiniature, trace: list[int]) -> None:
    for key in trace:
        mini.access(key)
    mini.drain()


def test_unsampled_lru_miniatures_equal_exact_lru_at_every_ratio() -> None:
    trace = zipf_trace(8_000, 1500)
    mini = PolicyMiniature("lru", 200, shift=0)
    feed(mini, trace)
    snap = mini.snapshot()
    warm = mini.sizes()[0]
    assert snap.rate == 1.0 and snap.accesses == len(trace) - warm
    for ratio, size in zip(RATIOS, mini.sizes(), strict=True):
        assert size == int(200 * ratio)
        assert snap.hits[RATIOS.index(ratio)] == warm_lru_hits(trace, size, warm), ratio


def scan_and_hot_set(rounds: int, hot: int, scan: int, seed: int = 3) -> list[int]:
    """A hot set touched twice per round between one-off scans: LRU loses the hot set to
    every scan longer than its spare room, a scan-resistant policy keeps it."""
    rng = random.Random(seed)
    out: list[int] = []
    fresh = 10_000
    for _ in range(rounds):
        for _ in range(2):
            keys = list(range(hot))
            rng.shuffle(keys)
            out += [_spread(k) for k in keys]
        out += [_spread(fresh + i) for i in range(scan)]
        fresh += scan
    return out


def test_the_miniature_runs_the_configured_policy_not_lru() -> None:
    trace = scan_and_hot_set(rounds=60, hot=60, scan=120)
    got = {}
    for policy in ("lru", "mixture"):
        mini = PolicyMiniature(policy, 100, ratios=(1.0,), shift=0)
        feed(mini, trace)
        ratio = mini.snapshot().hit_ratio(1.0)
        assert ratio is not None
        got[policy] = ratio
    # Exact LRU at 100 keys: the second touch of each round hits, the first never does.
    assert got["lru"] == pytest.approx(60 / 240, abs=0.01)
    assert got["mixture"] > got["lru"] + 0.1, got


@pytest.mark.parametrize("ratio", [0.5, 1.0, 2.0])
def test_sampled_estimate_is_within_three_points_of_the_exact_one(ratio: float) -> None:
    capacity = 4096
    trace = zipf_trace(120_000, 40_000)
    sampled = PolicyMiniature("lru", capacity)
    assert sampled.rate < 1 and min(sampled.sizes()) >= 64
    feed(sampled, trace)
    exact = warm_lru_hits(trace, int(capacity * ratio), 1024) / (len(trace) - 1024)
    estimate = sampled.snapshot().hit_ratio(ratio)
    assert estimate is not None
    assert abs(estimate - exact) <= 0.03, (estimate, exact)


def test_rate_falls_as_the_cache_grows_and_keeps_the_smallest_miniature() -> None:
    small, big = PolicyMiniature("lru", 256), PolicyMiniature("lru", 1 << 20)
    assert small.rate == 1.0
    assert big.rate == 1 / 4096 and min(big.sizes()) == 64
    with pytest.raises(ValueError, match="unknown eviction policy 'nope'"):
        PolicyMiniature("nope", 100)


def test_pending_keys_stay_bounded_and_drops_are_counted() -> None:
    mini = PolicyMiniature("lru", 100, shift=0, max_pending=1000)
    for i in range(5000):
        mini.access(_spread(i))
    assert len(mini.pending) <= 1000
    snap = mini.snapshot()
    assert snap.dropped == 5000 - len(mini.pending) and snap.accesses == 0
    assert mini.drain(limit=10) == 10 and len(mini.pending) == 5000 - snap.dropped - 10


def test_the_engine_feeds_each_query_as_one_chain() -> None:
    mgr = make_manager(blocks=16, eviction_policy="mixture")
    assert mgr.miniature is not None
    assert mgr.miniature.policy == "mixture" and mgr.miniature.capacity == 16
    mgr.miniature = PolicyMiniature("lru", 16, ratios=(0.25, 1.0), shift=0)
    tokens = list(range(4 * TPB + 1))
    for _ in range(3):
        handle = mgr.open_sequence(tokens)
        mgr.commit(handle.seq_id)
        mgr.release(handle.seq_id)
    # Each open queues the prompt's 4 full blocks (the partial fifth is no block yet).
    assert len(mgr.miniature.pending) == 12
    assert mgr.miniature.drain() == 12 and not mgr.miniature.pending
    snap = mgr.miniature.snapshot()
    # Counted after the smallest miniature's 4 blocks of warm-up: the last two queries,
    # all hits, at 4 blocks too (the chain fits).
    assert snap.accesses == 8
    assert snap.hits == (8, 8)


def test_a_chain_keeps_its_prefix_where_single_keys_lose_it() -> None:
    chains = [[1, 2], [5], [7], [1, 2]]
    hits = {}
    for how in ("chain", "key"):
        mini = PolicyMiniature("lru", 3, ratios=(1.0,), shift=0)
        for chain in chains:
            if how == "chain":
                mini.access_chain(chain)
            else:
                for key in chain:
                    mini.access(key)
        assert mini.drain() == 6
        hits[how] = mini.snapshot().hits[0]
    # At 7 the cache is full: a tree evicts the least recent leaf, 2, and keeps 1 for the
    # last query's prefix; keys fed alone evict the least recent key, 1.
    assert hits == {"chain": 1, "key": 0}


def test_drops_and_drains_take_whole_chains() -> None:
    mini = PolicyMiniature("lru", 100, shift=0, max_pending=1000)
    for start in range(0, 5000, 5):
        mini.access_chain(_spread(k) for k in range(start, start + 5))
    assert len(mini.pending) <= 1000 and len(mini.pending) % 5 == 0
    assert mini.dropped + len(mini.pending) == 5000
    assert mini.pending[-1] == _spread(4999)
    assert mini.drain(limit=12) == 15 and len(mini.pending) % 5 == 0
    assert mini.drain(limit=0) == 0
    mini.queue_chain([])  # a query with no sampled block queues nothing
    assert len(mini.pending) % 5 == 0


def served(tokens_per_request: list[list[int]], policy: str) -> tuple[int, int]:
    """(hits of an unsampled miniature at the capacity, the engine's own hits over the
    same queries), counted after the miniature's warm-up."""
    mgr = make_manager(blocks=24, eviction_policy=policy)
    mgr.miniature = PolicyMiniature(policy, 24, ratios=(1.0,), shift=0)
    seen = engine_hits = 0
    for tokens in tokens_per_request:
        before = mgr.stats.hits_blocks[0]
        handle = mgr.open_sequence(tokens, recompute_last_token=False)
        mgr.commit(handle.seq_id)
        mgr.release(handle.seq_id)
        seen += len(tokens) // TPB
        if seen > 24:
            engine_hits += mgr.stats.hits_blocks[0] - before
    mgr.miniature.drain()
    return mgr.miniature.snapshot().hits[0], engine_hits


def shared_prefix_requests(n: int, seed: int = 1) -> list[list[int]]:
    """Six system prompts of 2 blocks, Zipf-popular, each followed by 1 to 3 blocks from a
    few variants: prefixes shared at two depths, in a cache too small for all of them."""
    rng = random.Random(seed)
    heads = [list(range(h * 1000, h * 1000 + 2 * TPB)) for h in range(6)]
    out = []
    for _ in range(n):
        head = heads[int(6 * rng.random() ** 2)]
        tail = [rng.randrange(3) + 10**6 + j for j in range(rng.choice((1, 2, 3)) * TPB)]
        out.append(head + tail)
    return out


def test_an_lru_miniature_at_the_capacity_replays_the_engines_lru_hit_for_hit() -> None:
    requests = shared_prefix_requests(300)
    mini_hits, engine_hits = served(requests, "lru")
    assert engine_hits > 300 and mini_hits == engine_hits
    # The default policy's miniature too, to within a few hits of 1,200 blocks queried.
    mini_hits, engine_hits = served(requests, "mixture")
    assert abs(mini_hits - engine_hits) <= 12, (mini_hits, engine_hits)


def test_a_live_policy_switch_restarts_the_curve_with_the_new_policy() -> None:
    from kvpool_agent.config import KvCacheConfig

    mgr = make_manager(blocks=16, eviction_policy="lru")
    assert mgr.miniature is not None and mgr.miniature.policy == "lru"
    new = KvCacheConfig(**{**mgr.config.model_dump(), "eviction_policy": "mixture"})
    assert mgr.apply_live_config(new) == ["eviction_policy"]
    assert mgr.miniature is not None and mgr.miniature.policy == "mixture"
    mgr.policy_curve(False)
    handle = mgr.open_sequence(list(range(4 * TPB + 1)))
    mgr.commit(handle.seq_id)  # nothing to feed, nothing fails
    assert mgr.miniature is None

"""The policy curve (``cache/miniature.py``): miniature simulations of the engine's own
eviction policy against exact replays, the sampled estimate, the engine's hook, and the
bounded queue."""

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


def test_engine_feeds_hits_and_stores() -> None:
    mgr = make_manager(blocks=16, eviction_policy="mixture")
    assert mgr.miniature is not None
    assert mgr.miniature.policy == "mixture" and mgr.miniature.capacity == 16
    mgr.miniature = PolicyMiniature("lru", 16, ratios=(0.25, 1.0), shift=0)
    tokens = list(range(4 * TPB + 1))
    for _ in range(3):
        handle = mgr.open_sequence(tokens)
        mgr.commit(handle.seq_id)
        mgr.release(handle.seq_id)
    # The first round stores 4 blocks, the next two match them: 12 accesses queued.
    assert len(mgr.miniature.pending) == 12
    assert mgr.miniature.drain() == 12 and not mgr.miniature.pending
    snap = mgr.miniature.snapshot()
    # Counted after the smallest miniature's 4 blocks of warm-up: the last 8 accesses, all
    # hits at 16 blocks; at 4 blocks, LRU storing a 4-block chain in order holds it too.
    assert snap.accesses == 8
    assert snap.hits == (8, 8)


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

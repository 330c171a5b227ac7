"""The miss-ratio curve (``cache/mrc.py``): exact and sampled estimates against an exact LRU
replay of the same trace at several capacities, and the engine's hook."""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict

import pytest
from cache_helpers import TPB, make_manager

from kvpool_agent.cache.mrc import BOUNDS, MissRatioCurve, hit_ratio_at


def lru_hits(trace: list[int], capacity: int) -> int:
    """Hits of an exact LRU cache of ``capacity`` keys over ``trace``."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for key in trace:
        if key in cache:
            hits += 1
            cache.move_to_end(key)
        else:
            cache[key] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
    return hits


def zipf_trace(n: int, keys: int, seed: int = 7, skew: float = 0.9) -> list[int]:
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) ** skew for i in range(keys)]
    ids = rng.choices(range(keys), weights=weights, k=n)
    # Spread the keys over 64 bits, as the tree's chained hashes are (a fixed hash: str
    # hashing changes with PYTHONHASHSEED, and the sample with it).
    return [_spread(i) for i in ids]


def _spread(i: int) -> int:
    digest = hashlib.blake2b(i.to_bytes(8, "little"), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


class _Node:
    def __init__(self, key: int) -> None:
        self.key = key


def run(curve: MissRatioCurve, trace: list[int]) -> None:
    for key in trace:
        curve.access(key)


@pytest.mark.parametrize("ratio", [0.2, 0.5, 1.0, 1.5, 2.0, 3.0])
def test_unsampled_curve_equals_exact_lru_at_bucket_bounds(ratio: float) -> None:
    capacity = 200
    trace = zipf_trace(20_000, 3000)
    curve = MissRatioCurve(capacity, min_shift=0)
    assert curve.rate == 1.0
    run(curve, trace)
    snap = curve.snapshot()
    assert snap.accesses == len(trace)
    exact = lru_hits(trace, round(ratio * capacity)) / len(trace)
    assert snap.hit_ratio(ratio) == pytest.approx(exact, abs=1e-9)


@pytest.mark.parametrize("ratio", [0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0])
def test_sampled_curve_is_within_two_points_of_exact_lru(ratio: float) -> None:
    capacity = 2000
    trace = zipf_trace(120_000, 30_000)
    curve = MissRatioCurve(capacity, max_samples=1024)
    assert curve.rate == 1 / 8
    run(curve, trace)
    exact = lru_hits(trace, round(ratio * capacity)) / len(trace)
    estimate = curve.snapshot().hit_ratio(ratio)
    assert estimate is not None
    # Between bucket bounds the curve is interpolated: allow a little more there.
    tolerance = 0.02 if ratio in BOUNDS else 0.03
    assert abs(estimate - exact) < tolerance, (ratio, estimate, exact)


def test_tracked_keys_stay_bounded_and_old_keys_count_as_cold() -> None:
    curve = MissRatioCurve(100, min_shift=0)  # covers distances up to 400 keys
    trace = list(range(1, 2001)) * 2  # every reuse is 1999 keys back: beyond the range
    run(curve, trace)
    assert len(curve) <= 401
    snap = curve.snapshot()
    assert snap.cumulative[len(BOUNDS) - 1] == 0  # nothing within 4 x capacity
    assert snap.accesses == len(trace)


def test_loop_just_inside_capacity_hits_only_at_that_capacity() -> None:
    curve = MissRatioCurve(100, min_shift=0)
    run(curve, list(range(1, 91)) * 10)  # 90 keys cycled: LRU hits iff capacity >= 90
    snap = curve.snapshot()
    assert snap.hit_ratio(0.8) == 0.0
    assert snap.hit_ratio(0.9) == pytest.approx(0.9)
    assert snap.hit_ratio(1.0) == pytest.approx(0.9)


def test_interpolation_and_flat_tail() -> None:
    bounds = (0.5, 1.0)
    cumulative = (20.0, 60.0, 100.0)
    assert hit_ratio_at(bounds, cumulative, 0.25) == pytest.approx(0.1)
    assert hit_ratio_at(bounds, cumulative, 0.75) == pytest.approx(0.4)
    assert hit_ratio_at(bounds, cumulative, 3.0) == pytest.approx(0.6)
    assert hit_ratio_at(bounds, (0.0, 0.0, 0.0), 1.0) is None


def test_engine_records_hits_and_stores() -> None:
    mgr = make_manager(blocks=16)
    assert mgr.mrc.capacity == 16 and mgr.mrc.rate <= 1 / 8  # sampled by default
    mgr.mrc = MissRatioCurve(16, min_shift=0)
    tokens = list(range(4 * TPB + 1))
    for _ in range(3):
        handle = mgr.open_sequence(tokens)
        mgr.commit(handle.seq_id)
        mgr.release(handle.seq_id)
    snap = mgr.mrc.snapshot()
    # First round stores 4 blocks (cold); the next two hit all 4 at distance 4 = 0.25 x 16.
    assert snap.accesses == 12
    assert snap.cumulative[-1] - snap.cumulative[len(BOUNDS) - 1] == 4
    assert snap.hit_ratio(0.3) == pytest.approx(8 / 12)
    assert snap.hit_ratio(0.2) < 8 / 12


def test_the_exported_histogram_never_goes_down_while_the_adjusted_total_is_exact() -> None:
    """Prometheus buckets are counters: the unadjusted histogram only grows, scrape after
    scrape, even where SHARDS-adj's correction of the first bucket shrinks; the adjusted one
    counts every access."""
    curve = MissRatioCurve(4096)
    mask = (1 << curve.shift) - 1
    assert mask  # sampled: the correction is in play
    hot = 1  # a key outside the sample, then keys inside it: the correction grows, then shrinks
    phases = [[hot] * 5_000, [(j % 64) * (mask + 1) for j in range(5_000)]]
    before = curve.snapshot(adjusted=False).cumulative
    firsts, seen = [], 0
    for trace in phases:
        for start in range(0, len(trace), 500):
            run(curve, trace[start : start + 500])
            seen += len(trace[start : start + 500])
            now = curve.snapshot(adjusted=False).cumulative
            assert all(b <= a for a, b in zip(now, before, strict=True))
            before = now
            adjusted = curve.snapshot()
            assert adjusted.accesses == seen
            firsts.append(adjusted.cumulative[0])
    assert min(firsts[10:]) < max(firsts[:10])  # the adjusted first bucket did go down

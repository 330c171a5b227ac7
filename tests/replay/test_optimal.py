"""The offline optimum against an exhaustive search, and on the shipped traces' figures."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool_agent.replay.optimal import next_uses, optimal_hits
from kvpool_agent.replay.prefix import PrefixPaths, prefix_paths
from kvpool_agent.traces import Trace, TraceRequest, load_trace

TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"


def brute_force_hits(prefix: PrefixPaths, capacity: int) -> int:
    """Best total hits over every choice: cache each missed block or stop, evict any leaf."""
    paths, parent = prefix.paths, prefix.parent

    @functools.cache
    def best(r: int, i: int, cache: frozenset[int]) -> int:
        if r == len(paths):
            return 0
        path = paths[r]
        if i == 0:  # a new request: count its leading hits first
            h = 0
            while h < len(path) and path[h] in cache:
                h += 1
            return h + best_from(r, h, cache)
        return best_from(r, i, cache)

    def best_from(r: int, i: int, cache: frozenset[int]) -> int:
        path = paths[r]
        outcome = best(r + 1, 0, cache)  # stop caching this request's blocks here
        if i == len(path):
            return outcome
        node = path[i]
        if len(cache) < capacity:
            return max(outcome, best_cont(r, i + 1, cache | {node}))
        held = set(path[:i])
        parents = {parent[n] for n in cache}
        for victim in cache:
            if victim in held or victim in parents:
                continue
            outcome = max(outcome, best_cont(r, i + 1, (cache - {victim}) | {node}))
        return outcome

    def best_cont(r: int, i: int, cache: frozenset[int]) -> int:
        return best_from(r, i, cache) if i < len(paths[r]) else best(r + 1, 0, cache)

    return best(0, 0, frozenset())


@st.composite
def small_traces(draw: st.DrawFn) -> tuple[Trace, int]:
    """A random tree of up to 9 blocks and up to 7 requests, each a root-to-node path."""
    n_nodes = draw(st.integers(1, 9))
    parents = [-1] + [draw(st.integers(-1, i - 1)) for i in range(1, n_nodes)]
    picks = draw(st.lists(st.integers(0, n_nodes - 1), min_size=1, max_size=7))
    requests = []
    for pick in picks:
        path = []
        node = pick
        while node >= 0:
            path.append(node)
            node = parents[node]
        path.reverse()
        requests.append(TraceRequest(0.0, 16 * len(path), 1, tuple(path)))
    capacity = draw(st.integers(1, 5))
    return Trace("random", 16, tuple(requests)), capacity


@settings(max_examples=300, deadline=None)
@given(small_traces())
def test_optimum_matches_exhaustive_search(case: tuple[Trace, int]) -> None:
    trace, capacity = case
    prefix = prefix_paths(trace)
    assert optimal_hits(prefix, capacity).hit_blocks == brute_force_hits(prefix, capacity)


@settings(max_examples=100, deadline=None)
@given(small_traces())
def test_optimum_grows_with_capacity(case: tuple[Trace, int]) -> None:
    trace, capacity = case
    prefix = prefix_paths(trace)
    nexts = next_uses(prefix)
    small = optimal_hits(prefix, capacity, nexts).hit_blocks
    assert optimal_hits(prefix, capacity + 1, nexts).hit_blocks >= small


def test_optimum_on_a_handmade_trace() -> None:
    # A B, then C D twice, then A B: with two blocks MIN keeps C D for the next use.
    ids = [(1, 2), (3, 4), (3, 4), (1, 2)]
    trace = Trace("hand", 16, tuple(TraceRequest(0, 32, 1, i) for i in ids))
    result = optimal_hits(prefix_paths(trace), 2)
    assert result.per_request == [0, 0, 2, 0]
    # With four blocks everything stays.
    assert optimal_hits(prefix_paths(trace), 4).per_request == [0, 0, 2, 2]


@pytest.mark.skipif(not (TRACES / "synthetic_trace.jsonl").exists(), reason="needs shared traces")
def test_optimum_reproduces_the_published_row() -> None:
    trace = load_trace(TRACES / "synthetic_trace.jsonl")
    assert trace.block_size == 512
    prefix = prefix_paths(trace)
    nexts = next_uses(prefix)
    rates = [
        round(100 * optimal_hits(prefix, trace.capacity_blocks(f), nexts).block_hit_rate, 1)
        for f in (0.01, 0.05, 0.10, 0.25)
    ]
    assert rates == [18.5, 39.6, 50.6, 62.6]

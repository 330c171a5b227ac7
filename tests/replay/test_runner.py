"""Replays through the real engine: bounded by the optimum, exact with unbounded room."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool_agent.replay.optimal import optimal_hits
from kvpool_agent.replay.prefix import prefix_paths
from kvpool_agent.replay.runner import replay
from kvpool_agent.traces import Trace, TraceRequest, load_trace

TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"


def infinite_cache_hits(trace: Trace) -> int:
    seen: set[tuple[int, ...]] = set()
    hits = 0
    for r in trace.requests:
        prefixes = [r.hash_ids[: i + 1] for i in range(len(r.hash_ids))]
        h = 0
        while h < len(prefixes) and prefixes[h] in seen:
            h += 1
        hits += h
        seen.update(prefixes)
    return hits


@st.composite
def traces(draw: st.DrawFn) -> Trace:
    n_nodes = draw(st.integers(1, 12))
    parents = [-1] + [draw(st.integers(-1, i - 1)) for i in range(1, n_nodes)]
    picks = draw(st.lists(st.integers(0, n_nodes - 1), min_size=1, max_size=12))
    requests = []
    for pick in picks:
        path = []
        node = pick
        while node >= 0:
            path.append(node)
            node = parents[node]
        path.reverse()
        length = 4 * len(path) - draw(st.integers(0, 3))
        requests.append(TraceRequest(0.0, length, 1, tuple(path)))
    return Trace("random", 4, tuple(requests))


@pytest.mark.parametrize("policy", ["lru", "reuse-gap", "mixture"])
@settings(max_examples=25, deadline=None)
@given(trace=traces(), extra=st.integers(0, 4))
def test_engine_replay_never_beats_the_optimum(policy: str, trace: Trace, extra: int) -> None:
    longest = max(len(r.hash_ids) for r in trace.requests)
    capacity = longest + extra
    result = replay(trace, capacity, policy)
    best = optimal_hits(prefix_paths(trace), capacity)
    assert 0 <= result.hit_blocks <= best.hit_blocks
    assert result.query_blocks == trace.total_blocks
    assert result.hit_tokens <= result.query_tokens


@pytest.mark.parametrize("policy", ["lru", "reuse-gap", "mixture"])
@settings(max_examples=15, deadline=None)
@given(trace=traces())
def test_unbounded_capacity_hits_every_repeat(policy: str, trace: Trace) -> None:
    result = replay(trace, trace.unique_blocks() + 1, policy)
    assert result.hit_blocks == infinite_cache_hits(trace)
    assert result.evictions == 0


def test_progress_counts_every_request() -> None:
    trace = Trace("t", 4, tuple(TraceRequest(0, 8, 1, (i, 100 + i)) for i in range(130)))
    seen: list[int] = []
    replay(trace, 10, "lru", progress=seen.append)
    assert sum(seen) == 130


@pytest.mark.slow
@pytest.mark.skipif(not (TRACES / "synthetic_trace.jsonl").exists(), reason="needs shared traces")
def test_engine_lru_reproduces_the_published_figure() -> None:
    """The README's plain LRU at 1% of the synthetic trace's unique blocks: 3.8%."""
    trace = load_trace(TRACES / "synthetic_trace.jsonl")
    result = replay(trace, trace.capacity_blocks(0.01), "lru")
    assert round(100 * result.block_hit_rate, 1) == 3.8


def _request(ids: list[int], block: int) -> TraceRequest:
    return TraceRequest(0.0, block * len(ids), 1, tuple(ids))


def test_reuse_gap_keeps_a_stable_part_of_a_loop_that_lru_thrashes() -> None:
    """Conversations taken in turn, each longer by a block per round, in a cache holding
    about half of them: LRU evicts each one just before it comes back and hits only the
    shared prompt; reuse-gap keeps a fixed subset and reuses it every round."""
    block, prompt, users, rounds = 4, 2, 8, 12
    history = {u: [1000 + 100 * u + j for j in range(6)] for u in range(users)}
    requests = []
    for _ in range(rounds):
        for u in range(users):
            history[u].append(history[u][-1] + 1)
            requests.append(_request(list(range(prompt)) + history[u], block))
    trace = Trace("loop", block, tuple(requests))
    capacity = prompt + users * 6 // 2
    lru = replay(trace, capacity, "lru").block_hit_rate
    gap = replay(trace, capacity, "reuse-gap").block_hit_rate
    shared_only = prompt * (len(requests) - 1) / trace.total_blocks
    assert lru == pytest.approx(shared_only)
    assert gap > 1.5 * lru


def test_reuse_gap_keeps_hot_prompts_over_one_off_suffixes() -> None:
    """A hot prompt in every fourth request, cold prompts and one-off suffixes in between:
    under LRU the three requests between two uses push the hot prompt out every time;
    reuse-gap evicts the cold, rarely reused chains and the fresh suffixes instead."""
    block, length = 4, 6
    requests = []
    suffix = 10_000
    for i in range(400):
        group = 0 if i % 4 == 0 else 1 + (i * 7) % 40  # group 0 in every fourth request
        ids = [100 * group + j for j in range(length)] + [suffix, suffix + 1]
        suffix += 2
        requests.append(_request(ids, block))
    trace = Trace("skewed", block, tuple(requests))
    capacity = 2 * length + 4
    lru = replay(trace, capacity, "lru").block_hit_rate
    gap = replay(trace, capacity, "reuse-gap").block_hit_rate
    hot_prompt_hits = length * 99 / trace.total_blocks  # every use of group 0 but the first
    assert lru == 0.0
    assert gap >= 0.9 * hot_prompt_hits

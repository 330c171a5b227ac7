"""Shadow caches and mixtures, compiled and in Python, on generated request streams: small
caches, deep single-child chains and bushy prefixes, and histories short enough to be
forgotten (reuse-gap's chain history, LRFU's key history) and ghost lists that overflow."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from .twins import EXPERTS, bits, mixture, shadow

kvpool_native = pytest.importorskip("kvpool_native")


@st.composite
def streams(draw: st.DrawFn) -> list[list[int]]:
    """Requests as root-first paths through a random tree of path keys."""
    n_nodes = draw(st.integers(1, 40))
    chainy = draw(st.booleans())
    parents = [-1]
    for i in range(1, n_nodes):
        parent = i - 1 if chainy and draw(st.booleans()) else draw(st.integers(-1, i - 1))
        parents.append(parent)
    salt = draw(st.integers(0, 2**62))
    picks = draw(st.lists(st.integers(0, n_nodes - 1), min_size=1, max_size=120))
    paths = []
    for pick in picks:
        path = []
        node = pick
        while node >= 0:
            path.append(hash((salt, node)))
            node = parents[node]
        paths.append(path[::-1])
    return paths


def replay_expert(name: str, capacity: int, paths: list[list[int]], floor: int | None) -> None:
    py = shadow(name, capacity, floor)
    changed: list[int] = []
    py.on_change = changed.append
    twin = kvpool_native.ShadowTwin(name, capacity, floor)
    for i, keys in enumerate(paths):
        changed.clear()
        assert twin.step(keys) == py.step(keys), i
        assert twin.changed == changed, i
    assert twin.keys() == sorted(py.cache)
    if name == "arc":
        q = py._queue  # type: ignore[attr-defined]
        state = twin.state()
        assert bits([state["p"]]) == bits([q._p])
        assert state["ghosts"] == (len(q._ghosts[0]), len(q._ghosts[1]))


@settings(max_examples=150, deadline=None)
@given(
    paths=streams(),
    capacity=st.integers(1, 16),
    name=st.sampled_from(EXPERTS),
    floor=st.sampled_from([None, 2, 5]),
)
def test_generated_streams_through_each_expert(
    paths: list[list[int]], capacity: int, name: str, floor: int | None
) -> None:
    replay_expert(name, capacity, paths, floor)


@settings(max_examples=80, deadline=None)
@given(
    paths=streams(),
    capacity=st.integers(1, 16),
    variant=st.sampled_from(["mixture", "mixture-v1", "guarded"]),
    floor=st.sampled_from([None, 3]),
)
def test_generated_streams_through_a_mixture(
    paths: list[list[int]], capacity: int, variant: str, floor: int | None
) -> None:
    py = mixture(variant, capacity, history_floor=floor)
    twin = kvpool_native.MixtureTwin(capacity, variant, None, floor)
    for i, keys in enumerate(paths):
        scored = i % 5 != 4
        py.observe(keys, scored=scored)
        twin.observe(keys, scored)
        assert bits(twin.scores) == bits(py.scores), i
        assert (twin.leader, twin.switches) == (py.leader, py.switches), i
    for index, s in enumerate(py.shadows):
        assert twin.shadow_keys(index) == sorted(s.cache)


@pytest.mark.parametrize("name", EXPERTS)
def test_long_streams_forget_history_the_same_way(name: str) -> None:
    """Thousands of requests over a few hundred keys with a history floor of 8: reuse-gap
    forgets half its chains again and again (their heads held past eviction), LRFU drops
    its oldest keys, ARC's ghost lists stay at four capacities."""
    rng = random.Random(name)
    parents = [-1] + [rng.randrange(-1, i) if rng.random() < 0.3 else i - 1 for i in range(1, 300)]
    paths = []
    for _ in range(4000):
        node, path = rng.randrange(300), []
        while node >= 0:
            path.append(node * 7919 + 1)
            node = parents[node]
        paths.append(path[::-1][:40])
    replay_expert(name, 48, paths, 8)


def test_a_shadow_needs_a_block_and_caches_only_what_fits() -> None:
    with pytest.raises(ValueError, match="at least one block"):
        kvpool_native.ShadowTwin("lru", 0)
    twin = kvpool_native.ShadowTwin("lru", 2)
    assert twin.step([1, 2, 3]) == 0
    assert twin.keys() == [1, 2] and twin.changed == [1, 2]
    with pytest.raises(ValueError, match="unknown expert"):
        kvpool_native.ShadowTwin("fifo", 2)


@pytest.mark.parametrize("tick_span", [None, 16])
def test_lrfu_history_is_the_same_to_the_bit(tick_span: int | None) -> None:
    """LRFU's key history on a long stream that overflows it (a bound of 48 keys, hot keys
    among 400): every remembered key's tick and ``C`` to the bit, in the same order. The
    compiled history keeps a tick as an offset and a ``C`` of 1.0 as nothing; with a tick
    span of 16 its tick base moves every few accesses and the ticks of keys kept longer are
    kept whole, which must change nothing."""
    rng = random.Random(tick_span or 0)
    paths = []
    for _ in range(3000):
        hot = [rng.randrange(8) * 7 + 1 for _ in range(rng.randrange(3))]
        cold = [1000 + rng.randrange(400) * 13 for _ in range(rng.randrange(1, 8))]
        paths.append(hot + cold)  # path keys: a key's parent differs, as in real streams
    paths = [[hash((tuple(p[:i]), k)) for i, k in enumerate(p)] for p in paths]
    py = shadow("lrfu", 6, 48)  # the bound: the floor of 48 keys (twice the capacity is 12)
    twin = kvpool_native.ShadowTwin("lrfu", 6, 48, tick_span)
    history = py._queue._history  # type: ignore[attr-defined]
    far = 0
    for i, keys in enumerate(paths):
        assert twin.step(keys) == py.step(keys), i
        far = max(far, twin.lrfu_far())
        if i % 100 == 0 or i == len(paths) - 1:
            assert twin.lrfu_order() == list(history), i
            for key, (tick, crf) in history.items():
                got = twin.lrfu_history(key)
                assert got is not None and got[0] == tick and bits([got[1]]) == bits([crf]), i
    assert len(history) == 48
    assert any(crf != 1.0 for _, crf in history.values())
    assert far > 0 if tick_span else far == 0

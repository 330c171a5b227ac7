"""The compiled orders replay every committed trace exactly as the Python ones do: the same
hits on every request, the same keys leaving and entering each shadow in the same order, the
same mixture scores to the last bit, the same leader."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvpool_agent.traces import Trace

from .twins import (
    EXPERTS,
    TRACE_FILES,
    Mini,
    bits,
    chained_paths,
    mixture,
    shadow,
    trace_paths,
)

kvpool_native = pytest.importorskip("kvpool_native")

FRACTIONS = (0.02, 0.1, 0.4)
"""Capacities as shares of a trace's distinct blocks (at least its longest request)."""
PathsOf = Callable[[Trace], list[list[int]]]


@pytest.fixture(scope="module", params=TRACE_FILES, ids=lambda p: p.stem)
def trace(request: pytest.FixtureRequest) -> Trace:
    from kvpool_agent.traces import load_trace

    return load_trace(request.param)


def capacities(trace: Trace, paths: list[list[int]]) -> list[int]:
    longest = max(len(p) for p in paths)
    return sorted({max(longest, trace.capacity_blocks(f)) for f in FRACTIONS})


def expert_state(name: str, cache: object) -> dict[str, object]:
    """The Python expert's internal figures, as ``ShadowTwin.state`` reports them."""
    q = cache._queue  # type: ignore[attr-defined]
    if name == "reuse-gap":
        return {
            "fresh_gap": bits([q._fresh_gap]),
            "new_heads": q._new_heads,
            "reused_heads": q._reused_heads,
            "chains": len(q._chains),
            "estimates": len(q._estimates),
            "head_of": len(q._head_of),
            "now": q._now,
            "live": len(q),
        }
    if name == "lrfu":
        return {"history": len(q._history), "live": len(q)}
    if name == "arc":
        return {
            "p": bits([q._p]),
            "sizes": (q._sizes[1], q._sizes[2]),
            "ghosts": (len(q._ghosts[0]), len(q._ghosts[1])),
            "live": len(q),
        }
    return {"live": len(q)}


def twin_state(name: str, twin: object) -> dict[str, object]:
    state = dict(twin.state())  # type: ignore[attr-defined]
    for field in ("fresh_gap", "p"):
        if field in state:
            state[field] = bits([state[field]])
    return state


@pytest.mark.parametrize("paths_of", [chained_paths, trace_paths], ids=["keys", "ids"])
@pytest.mark.parametrize("name", EXPERTS)
def test_a_shadow_of_each_expert_replays_the_trace_exactly(
    trace: Trace, name: str, paths_of: PathsOf
) -> None:
    paths = paths_of(trace)
    for capacity in capacities(trace, paths):
        py = shadow(name, capacity)
        changed: list[int] = []
        py.on_change = changed.append
        twin = kvpool_native.ShadowTwin(name, capacity)
        for i, keys in enumerate(paths):
            changed.clear()
            hits = py.step(keys)
            assert twin.step(keys) == hits, (capacity, i)
            assert twin.changed == changed, (capacity, i)
        assert twin.keys() == sorted(py.cache)
        assert twin_state(name, twin) == expert_state(name, py)
        if name == "lrfu":
            for key, (tick, crf) in py._queue._history.items():  # type: ignore[attr-defined]
                got = twin.lrfu_history(key)
                assert got is not None and got[0] == tick and bits([got[1]]) == bits([crf])


@pytest.mark.parametrize("variant", ["mixture", "mixture-v1", "guarded"])
def test_a_mixture_scores_and_leads_exactly_as_in_python(trace: Trace, variant: str) -> None:
    paths = chained_paths(trace)
    for capacity in capacities(trace, paths):
        py = mixture(variant, capacity)
        twin = kvpool_native.MixtureTwin(capacity, variant)
        assert twin.names == py.names
        for i, keys in enumerate(paths):
            scored = i % 7 != 3  # some requests only grow a sequence
            py.observe(keys, scored=scored)
            twin.observe(keys, scored)
            assert bits(twin.scores) == bits(py.scores), (capacity, i)
            assert (twin.leader, twin.switches) == (py.leader, py.switches), (capacity, i)
            if i % 97 == 0:
                for index, s in enumerate(py.shadows):
                    assert twin.shadow_keys(index) == sorted(s.cache)
        assert all(twin.leader_holds(k) == py.leader_holds(k) for k in paths[-1])


@pytest.mark.parametrize("policy", ["lru", "reuse-gap", "mixture", "mixture-v1", "guarded"])
def test_a_whole_queue_in_a_shadow_replays_as_the_miniature_does(trace: Trace, policy: str) -> None:
    """A registry policy in a shadow cache, as ``miniature._Mini`` runs it: on whole requests
    and on their sampled keys (the miniature's chains, one key in 4)."""
    paths = chained_paths(trace)
    sampled = [chain for keys in paths if (chain := [k for k in keys if not k & 3])]
    longest = max(len(p) for p in paths)
    for stream, capacity in ((paths, max(longest, trace.capacity_blocks(0.1))), (sampled, 64)):
        py = Mini(policy, capacity)
        twin = kvpool_native.MiniTwin(policy, capacity)
        for i, keys in enumerate(stream):
            assert twin.step(keys) == py.step(keys), (capacity, i)
            assert twin.changed == py.changed, (capacity, i)
        if py.shared is not None:
            assert twin.leader == py.shared.leader  # type: ignore[attr-defined]
            assert bits(twin.scores) == bits(py.shared.scores)  # type: ignore[attr-defined]


def test_every_committed_trace_is_replayed() -> None:
    assert len(TRACE_FILES) == 7

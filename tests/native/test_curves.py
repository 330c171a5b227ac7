"""The compiled curves (``kvpool_native.MissRatioCurve`` and ``.PolicyMiniature``, through
``cache/native_curves.py``) against the Python ones (``cache/mrc.py``, ``cache/miniature.py``)
fed identical key streams, random and from every committed trace: the snapshots are equal
to the last bit of every float (adjusted and not), the keys tracked the same, and the
miniatures' pending keys, hits, accesses and drops the same after every feed and every drain.
Then the engine's own feeding: both cores replaying a trace hold equal curves throughout, and
curves assigned to the compiled core are adopted or fed as the Python core feeds them."""

from __future__ import annotations

import hashlib
import os
import random
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool_agent.cache.eviction.registry import POLICIES
from kvpool_agent.cache.miniature import PolicyMiniature
from kvpool_agent.cache.mrc import MissRatioCurve
from kvpool_agent.cache.native_curves import (
    NativeMissRatioCurve,
    NativePolicyMiniature,
    PendingKeys,
)
from kvpool_agent.replay.runner import block_tokens
from kvpool_agent.traces import Trace

from .twins import TRACE_FILES, bits, chained_paths

kvpool_native = pytest.importorskip("kvpool_native")

PY_POLICIES = sorted(POLICIES)


class Node:
    """What the curves read of a tree node: its key."""

    __slots__ = ("key",)

    def __init__(self, key: int) -> None:
        self.key = key


def spread(i: int) -> int:
    """A well-mixed signed 64-bit key, as the tree's chained hashes are."""
    digest = hashlib.blake2b(i.to_bytes(8, "little", signed=True), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def key_stream(rng: random.Random, n: int, universe: int) -> list[int]:
    """Reuse at every distance: a hot set, a long Zipf tail, one-off keys, and keys whose
    low bits are zero (sampled at any rate), signed and unsigned alike."""
    out = []
    for _ in range(n):
        roll = rng.random()
        if roll < 0.3:
            out.append(spread(rng.randrange(16)))
        elif roll < 0.75:
            out.append(spread(int(universe * rng.random() ** 2)))
        elif roll < 0.85:
            out.append(spread(10**9 + rng.randrange(10**9)))
        else:
            out.append(rng.randrange(-64, 64) << rng.choice((8, 16, 40)))
    return out


# ---------------------------------------------------------------------- miss-ratio curve


def mrc_view(curve: MissRatioCurve | NativeMissRatioCurve) -> dict[str, Any]:
    """Everything a curve lets a reader see, floats as their bits."""
    out: dict[str, Any] = {
        "capacity": curve.capacity,
        "shift": curve.shift,
        "mask": curve.mask,
        "rate": bits([curve.rate]),
        "tracked": len(curve),
    }
    for adjusted in (True, False):
        snap = curve.snapshot(adjusted=adjusted)
        out[f"snapshot_{adjusted}"] = (
            snap.capacity,
            bits([snap.rate]),
            bits(snap.cumulative),
            bits([snap.distance_sum]),
            type(snap.capacity),
        )
    return out


def feed_mrc(
    curves: Sequence[MissRatioCurve | NativeMissRatioCurve], batch: list[int], how: str
) -> None:
    """Feed every curve ``batch`` the same way (the engine's three ways)."""
    for curve in curves:
        if how == "nodes":
            curve.access_nodes([Node(k) for k in batch])
        elif how == "sampled":
            curve.access_sampled(len(batch), [k for k in batch if not k & curve.mask])
        else:
            for key in batch:
                curve.access(key)


MRC_CASES = [
    (1, {"min_shift": 0}),
    (7, {"min_shift": 0, "max_samples": 4}),  # forgets and renumbers all the time
    (100, {}),
    (100, {"min_shift": 0}),
    (4096, {}),
    (50_000, {}),
    (300, {"min_shift": 0, "max_ratio": 10.0}),  # tracks distances beyond the last bound
    (300, {"min_shift": 1, "max_ratio": 0.5}),
    (64, {"min_shift": 2, "max_samples": 9}),
    (2000, {"max_samples": 1024, "min_shift": 5}),
]


@pytest.mark.parametrize(("capacity", "params"), MRC_CASES, ids=str)
def test_the_miss_ratio_curve_matches_python_on_random_streams(
    capacity: int, params: dict[str, Any]
) -> None:
    rng = random.Random(capacity * 31 + len(params))
    py = MissRatioCurve(capacity, **params)
    native = NativeMissRatioCurve(capacity, **params)
    assert mrc_view(native) == mrc_view(py)
    keys = key_stream(rng, 20_000, universe=max(8 * capacity, 64))
    at = 0
    while at < len(keys):
        batch = keys[at : at + rng.choice((1, 3, 17, 64, 400))]
        at += len(batch)
        feed_mrc([py, native], batch, rng.choice(("nodes", "sampled", "one")))
        assert mrc_view(native) == mrc_view(py), at


@settings(max_examples=150, deadline=None)
@given(
    capacity=st.integers(0, 300),
    min_shift=st.integers(0, 6),
    max_samples=st.integers(1, 300) | st.floats(0.5, 300.0),
    max_ratio=st.sampled_from([0.3, 1.0, 2.5, 4.0, 6.0]),
    keys=st.lists(st.integers(-40, 40).map(lambda k: k << 3) | st.integers(-(2**63), 2**63 - 1)),
)
def test_the_miss_ratio_curve_matches_python_on_any_parameters(
    capacity: int, min_shift: int, max_samples: float, max_ratio: float, keys: list[int]
) -> None:
    params = {"min_shift": min_shift, "max_samples": max_samples, "max_ratio": max_ratio}
    py = MissRatioCurve(capacity, **params)  # type: ignore[arg-type]
    native = NativeMissRatioCurve(capacity, **params)  # type: ignore[arg-type]
    for start in range(0, len(keys), 7):
        feed_mrc([py, native], keys[start : start + 7], "nodes")
        assert mrc_view(native) == mrc_view(py)
    assert mrc_view(native) == mrc_view(py)


def test_compiled_curves_refuse_what_they_cannot_reproduce() -> None:
    with pytest.raises(ValueError, match="negative shift count"):
        NativeMissRatioCurve(10, min_shift=-1)
    with pytest.raises(ValueError, match="beyond 63"):
        NativeMissRatioCurve(10, max_samples=0)  # Python's shift grows past 1000
    with pytest.raises(ValueError, match="no exact float"):
        NativeMissRatioCurve(10, max_samples=2**60 + 1)
    with pytest.raises(OverflowError):
        NativeMissRatioCurve(10).access(2**64)
    with pytest.raises(ValueError, match="unknown eviction policy 'nope'"):
        NativePolicyMiniature("nope", 100)
    with pytest.raises(ValueError, match=r"ratios must be positive, got \(0.0, 1.0\)"):
        NativePolicyMiniature("lru", 100, ratios=(1.0, 0.0))
    # A fed curve, a subclass, or a shift past 63 has no compiled equal.
    fed = MissRatioCurve(10)
    fed.access(8)
    assert NativeMissRatioCurve.like(fed) is None
    assert NativeMissRatioCurve.like(type("Sub", (MissRatioCurve,), {})(10)) is None
    assert NativeMissRatioCurve.like(MissRatioCurve(10, min_shift=64)) is None
    assert NativeMissRatioCurve.like(MissRatioCurve(10)) is not None
    mini = PolicyMiniature("lru", 100)
    mini.access(0)
    assert NativePolicyMiniature.like(mini) is None
    assert NativePolicyMiniature.like(PolicyMiniature("lru", 100, shift=70)) is None
    same = NativePolicyMiniature.like(PolicyMiniature("lru", 100, ratios=(1, 2), shift=1))
    assert same is not None and same.ratios == (1, 2) and same.sizes() == [50, 100]


# ---------------------------------------------------------------------- policy curve


def mini_view(mini: PolicyMiniature | NativePolicyMiniature) -> dict[str, Any]:
    snap = mini.snapshot()
    return {
        "policy": mini.policy,
        "capacity": mini.capacity,
        "ratios": mini.ratios,
        "shift": mini.shift,
        "mask": mini.mask,
        "rate": bits([mini.rate]),
        "sizes": mini.sizes(),
        "max_pending": mini.max_pending,
        "pending": list(mini.pending),
        "hits": list(mini.hits),
        "accesses": mini.accesses,
        "dropped": mini.dropped,
        "snapshot": (
            snap.policy,
            snap.capacity,
            bits([snap.rate]),
            snap.ratios,
            snap.hits,
            snap.accesses,
            snap.dropped,
        ),
    }


def chain_stream(rng: random.Random, n: int, universe: int) -> list[list[int]]:
    """Requests as the tree sees them: each the keys of a path from the root of a trie
    (a key names its whole prefix), heads from a hot set, a Zipf tail and one-offs, and
    continuations from a small alphabet, so that paths share prefixes at every depth."""
    out = []
    for _ in range(n):
        roll = rng.random()
        if roll < 0.3:
            path: tuple[int, ...] = (rng.randrange(16),)
        elif roll < 0.8:
            path = (int(universe * rng.random() ** 2),)
        else:
            path = (10**9 + rng.randrange(10**9),)
        keys = [spread(hash(path))]
        for _ in range(rng.choice((0, 0, 1, 2, 4, 7))):
            path += (rng.randrange(3),)
            keys.append(spread(hash(path)))
        out.append(keys)
    return out


def feed_mini(
    minis: Sequence[PolicyMiniature | NativePolicyMiniature], chains: list[list[int]], how: str
) -> None:
    """Each chain as a request: whole (``chain``), sampled by the caller (``sampled``), or,
    for ``one``, only its head (a request of one block)."""
    for mini in minis:
        for keys in chains:
            if how == "chain":
                mini.access_chain(keys)
            elif how == "sampled":
                mini.queue_chain([k for k in keys if not k & mini.mask])
            else:
                mini.access(keys[0])


MINI_CASES = [
    (100, {"shift": 0, "max_pending": 1000}),
    (5000, {}),  # one key in 8
    (64, {"ratios": (3.0, 0.1, 1.0), "shift": 2, "max_pending": 50}),
    (300, {"ratios": (0.5, 1.0), "min_blocks": 16, "max_pending": 7}),
    (40, {"ratios": (1.0,), "shift": -3, "max_pending": 0}),
    (1, {}),
]


@pytest.mark.parametrize(("capacity", "params"), MINI_CASES, ids=str)
@pytest.mark.parametrize("policy", PY_POLICIES)
def test_the_policy_miniature_matches_python_on_random_streams(
    policy: str, capacity: int, params: dict[str, Any]
) -> None:
    rng = random.Random(capacity * 7 + len(policy))
    py = PolicyMiniature(policy, capacity, **params)
    native = NativePolicyMiniature(policy, capacity, **params)
    assert mini_view(native) == mini_view(py)
    chains = chain_stream(rng, 2000, universe=max(4 * capacity, 64))
    at = 0
    while at < len(chains):
        if rng.random() < 0.3:
            limit = rng.choice((None, 0, 1, 5, 40, 300, -2))
            assert native.drain(limit) == py.drain(limit)
        else:
            batch = chains[at : at + rng.choice((1, 2, 10, 40))]
            at += len(batch)
            feed_mini([py, native], batch, rng.choice(("chain", "chain", "sampled", "one")))
        assert mini_view(native) == mini_view(py), at
    assert native.drain() == py.drain()
    assert mini_view(native) == mini_view(py)


def test_max_pending_is_settable_and_pending_reads_like_a_list() -> None:
    py = PolicyMiniature("lru", 100, shift=0, max_pending=10)
    native = NativePolicyMiniature("lru", 100, shift=0, max_pending=10)
    py.max_pending = native.max_pending = 1 << 30
    feed_mini([py, native], [[k] for k in range(1, 40)], "one")
    assert mini_view(native) == mini_view(py)
    pending = native.pending
    assert isinstance(pending, PendingKeys) and pending == py.pending and pending
    assert pending[0] == 1 and pending[-1] == 39 and pending[2:4] == [3, 4] and 5 in pending
    native.drain()
    assert not native.pending and len(native.pending) == 0


# ---------------------------------------------------------------------- the traces


@pytest.fixture(scope="module", params=TRACE_FILES, ids=lambda p: p.stem)
def trace(request: pytest.FixtureRequest) -> Trace:
    from kvpool_agent.traces import load_trace

    return load_trace(request.param)


@pytest.mark.parametrize("fraction", [0.05, 0.5])
def test_the_miss_ratio_curve_matches_python_on_the_traces(trace: Trace, fraction: float) -> None:
    capacity = trace.capacity_blocks(fraction)
    paths = chained_paths(trace)
    for params in ({}, {"min_shift": 0}):
        py = MissRatioCurve(capacity, **params)
        native = NativeMissRatioCurve(capacity, **params)
        for i, keys in enumerate(paths):
            feed_mrc([py, native], keys, "nodes")
            if i % 50 == 0:
                assert mrc_view(native) == mrc_view(py), i
        assert mrc_view(native) == mrc_view(py)


def replay_miniatures(
    trace: Trace, policy: str, make: Callable[[type], Any], seed: int = 11
) -> None:
    """Feed both miniatures each request's keys, draining both by random slices."""
    rng = random.Random(seed)
    py, native = make(PolicyMiniature), make(NativePolicyMiniature)
    for keys in chained_paths(trace):
        feed_mini([py, native], [keys], "chain")
        if rng.random() < 0.2:
            limit = rng.choice((None, 16, 64, 256))
            assert native.drain(limit) == py.drain(limit)
            assert mini_view(native) == mini_view(py)
    assert native.drain() == py.drain()
    assert mini_view(native) == mini_view(py)
    assert native.accesses > 0


@pytest.mark.parametrize("policy", PY_POLICIES)
def test_the_policy_miniature_matches_python_on_the_traces(trace: Trace, policy: str) -> None:
    capacity = trace.capacity_blocks(0.25)
    # A few hundred blocks in the smallest miniature at most: one key in 8 to 32 replayed.
    replay_miniatures(
        trace,
        policy,
        lambda cls: cls(policy, capacity, min_blocks=16, max_pending=2000),
    )


@pytest.mark.slow
@pytest.mark.parametrize("policy", PY_POLICIES)
def test_the_unsampled_policy_miniature_matches_python_on_the_traces(
    trace: Trace, policy: str
) -> None:
    capacity = trace.capacity_blocks(0.1)
    replay_miniatures(trace, policy, lambda cls: cls(policy, capacity, shift=0))


# ---------------------------------------------------------------------- in the engine


def replay_on(core: str, trace: Trace, capacity: int, policy: str) -> Any:
    from kvpool_agent.cache.manager import KVCacheManager
    from kvpool_agent.config import KvCacheConfig
    from kvpool_agent.replay.runner import REPLAY_MODEL

    old = os.environ.get("KVPOOL_CORE")
    os.environ["KVPOOL_CORE"] = core
    try:
        config = KvCacheConfig(
            tokens_per_block=trace.block_size, event_buffer_max_size=0, eviction_policy=policy
        )
        return KVCacheManager.with_capacity(REPLAY_MODEL, config, num_blocks=capacity)
    finally:
        if old is None:
            del os.environ["KVPOOL_CORE"]
        else:
            os.environ["KVPOOL_CORE"] = old


@pytest.mark.parametrize("policy", ["lru", "mixture"])
def test_both_cores_feed_equal_curves_replaying_a_trace(trace: Trace, policy: str) -> None:
    """The compiled engine feeds its own curves on every request: hits (when it opens a
    sequence) and stores (when it commits), in the Python core's order and batches."""
    trace = trace.head(300)
    capacity = max(trace.capacity_blocks(0.2), max(len(r.hash_ids) for r in trace.requests) + 2)
    engines = [replay_on(core, trace, capacity, policy) for core in ("python", "native")]
    assert [e.core_name for e in engines] == ["python", "native"]
    assert isinstance(engines[1].mrc, NativeMissRatioCurve)
    assert isinstance(engines[1].miniature, NativePolicyMiniature)
    for mgr in engines:  # one key in 2, queued for a small queue that overflows
        mgr.miniature = PolicyMiniature(policy, capacity, max_pending=64, shift=1)
    assert isinstance(engines[1].miniature, NativePolicyMiniature)
    rng = random.Random(5)
    size = trace.block_size
    for i, request in enumerate(trace.requests):
        tokens = [t for h in request.hash_ids for t in block_tokens(h, size)]
        if not tokens:
            continue
        for mgr in engines:
            handle = mgr.open_sequence(tokens, recompute_last_token=False)
            mgr.commit(handle.seq_id)
            mgr.release(handle.seq_id)
        py, native = (e.miniature for e in engines)
        if rng.random() < 0.1:
            limit = rng.choice((None, 8, 32, 32, 32))
            assert native.drain(limit) == py.drain(limit)
        if i % 10 == 0:
            assert mrc_view(engines[1].mrc) == mrc_view(engines[0].mrc), i
            assert mini_view(native) == mini_view(py), i
    assert mrc_view(engines[1].mrc) == mrc_view(engines[0].mrc)
    assert engines[1].mrc.snapshot().accesses > 0 and engines[1].miniature.dropped > 0


def test_curves_assigned_to_the_compiled_core_are_adopted_or_fed_from_python() -> None:
    from kvpool_agent.cache.manager import KVCacheManager
    from kvpool_agent.config import KvCacheConfig
    from kvpool_agent.replay.runner import REPLAY_MODEL

    def manager(core: str) -> KVCacheManager:
        config = KvCacheConfig(tokens_per_block=4, event_buffer_max_size=0)
        return KVCacheManager.with_capacity(REPLAY_MODEL, config, num_blocks=64, core=core)

    py_mgr, mgr = manager("python"), manager("native")
    default_mrc, default_mini = mgr.mrc, mgr.miniature
    assert isinstance(default_mrc, NativeMissRatioCurve) and default_mrc.attached
    assert isinstance(default_mini, NativePolicyMiniature) and default_mini.attached
    fed = MissRatioCurve(64, min_shift=0)
    fed.access(12345)  # already fed: no compiled equal, so fed from Python as before
    fed_too = MissRatioCurve(64, min_shift=0)
    fed_too.access(12345)
    mgr.mrc, py_mgr.mrc = fed, fed_too
    assert mgr.mrc is fed and not default_mrc.attached
    fresh = PolicyMiniature("lru", 64, ratios=(0.5, 1.0), shift=0)
    mgr.miniature = fresh  # never fed: adopted as its compiled equal
    py_mgr.miniature = PolicyMiniature("lru", 64, ratios=(0.5, 1.0), shift=0)
    assert isinstance(mgr.miniature, NativePolicyMiniature) and mgr.miniature.attached
    assert not default_mini.attached
    frozen = mrc_view(default_mrc), mini_view(default_mini)
    for n in range(30):
        tokens = list(range(n % 7 * 100, n % 7 * 100 + 4 * (1 + n % 5) + 1))
        for m in (py_mgr, mgr):
            handle = m.open_sequence(tokens)
            m.commit(handle.seq_id)
            m.release(handle.seq_id)
    assert mrc_view(mgr.mrc) == mrc_view(py_mgr.mrc) and fed.snapshot().accesses > 1
    assert py_mgr.miniature is not None and mgr.miniature is not None
    assert mgr.miniature.drain(10) == py_mgr.miniature.drain(10)
    assert mini_view(mgr.miniature) == mini_view(py_mgr.miniature)
    # Detached curves keep what they had; a curve lives in one engine at a time.
    assert (mrc_view(default_mrc), mini_view(default_mini)) == frozen
    mgr.mrc = default_mrc
    assert mgr.mrc is default_mrc and default_mrc.attached
    mgr.mrc = mgr.mrc  # re-assigning the curve in place changes nothing
    assert default_mrc.attached and mrc_view(default_mrc)["snapshot_True"] != frozen[0]
    other = manager("native")
    with pytest.raises(RuntimeError, match="attached to an engine already"):
        other.mrc = default_mrc
    assert isinstance(other.mrc, NativeMissRatioCurve) and other.mrc.attached
    mgr.policy_curve(False)
    assert mgr.miniature is None
    mgr.miniature = default_mini
    assert mgr.miniature is default_mini and default_mini.attached


def test_a_fed_miniature_is_fed_from_python_beside_the_engines_own_curve() -> None:
    """The other way round: the engine feeds its compiled miss-ratio curve while a Python
    miniature is fed the keys it samples; and the Python core feeds compiled curves."""
    from kvpool_agent.cache.manager import KVCacheManager
    from kvpool_agent.config import KvCacheConfig
    from kvpool_agent.replay.runner import REPLAY_MODEL

    def manager(core: str) -> KVCacheManager:
        config = KvCacheConfig(tokens_per_block=4, event_buffer_max_size=0, eviction_policy="lru")
        return KVCacheManager.with_capacity(REPLAY_MODEL, config, num_blocks=48, core=core)

    py_mgr, mgr, py_fed_native = manager("python"), manager("native"), manager("python")
    minis = []
    for m in (py_mgr, mgr):
        mini = PolicyMiniature("lru", 48, shift=1, max_pending=8)
        mini.access(0)
        m.miniature = mini
        minis.append(mini)
    assert mgr.miniature is minis[1] and isinstance(mgr.mrc, NativeMissRatioCurve)
    py_fed_native.mrc = NativeMissRatioCurve(48)
    py_fed_native.miniature = NativePolicyMiniature("lru", 48, shift=1, max_pending=8)
    py_fed_native.miniature.access(0)
    for n in range(40):
        tokens = list(range(n % 9 * 100, n % 9 * 100 + 4 * (1 + n % 6) + 1))
        for m in (py_mgr, mgr, py_fed_native):
            handle = m.open_sequence(tokens)
            m.commit(handle.seq_id)
            m.release(handle.seq_id)
            assert m.miniature is not None
            if n % 5 == 4:
                m.miniature.drain(7)
        assert mrc_view(mgr.mrc) == mrc_view(py_mgr.mrc) == mrc_view(py_fed_native.mrc)
        views = [mini_view(m.miniature) for m in (py_mgr, mgr, py_fed_native)]  # type: ignore[arg-type]
        assert views[0] == views[1] == views[2], n
    assert minis[1].dropped > 0 and minis[1].accesses > 0

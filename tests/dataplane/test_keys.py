"""Engine keys -> synthetic tokens, and ``KVCacheManager.lookup`` (no side effects)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool_agent.cache import KVCacheManager
from kvpool_agent.cache.packed import PackedTokens, pack_all, unpack
from kvpool_agent.cache.stats import QUERY_COUNTERS
from kvpool_agent.config import KvCacheConfig, ModelGeometry
from kvpool_agent.dataplane.keys import (
    KeyFormatError,
    KeyNamespace,
    block_tokens,
    chain_tokens,
    check_keys,
    engine_key,
    packed_chain_tokens,
)
from kvpool_agent.server.service import tenant_salt

from .conftest import keys_for

MODEL = ModelGeometry(num_layers=2, num_kv_heads=1, head_dim=2, dtype="float32")
TPB = 4


@pytest.mark.parametrize("tpb", [2, 4, 8, 16, 64])
def test_a_key_maps_to_one_block_of_32_bit_tokens(tpb: int) -> None:
    tokens = block_tokens(b"\x01" * 32, tpb)
    assert len(tokens) == tpb
    words = min(tpb, 16)
    assert all(0 <= t < 1 << 32 for t in tokens)  # what the engine packs, 4 bytes each
    assert pack_all(tokens) is not None
    assert all(t != 0 for t in tokens[:words])  # digest words (zero with odds 2**-32)
    assert tokens[words:] == [0] * (tpb - words)
    assert block_tokens(b"\x01" * 32, tpb) == tokens  # deterministic
    assert chain_tokens([b"a", b"b"], tpb) == block_tokens(b"a", tpb) + block_tokens(b"b", tpb)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=64), min_size=2, max_size=50, unique=True))
def test_distinct_keys_get_distinct_blocks(keys: list[bytes]) -> None:
    blocks = {tuple(block_tokens(k, 2)) for k in keys}
    assert len(blocks) == len(keys)


@pytest.fixture(params=["compiled", "python"])
def chain_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """``chain_tokens`` (and ``packed_chain_tokens``) through the compiled core's digests, or
    through Python's alone."""
    from kvpool_agent.dataplane import keys as keys_module

    if request.param == "python":
        monkeypatch.setattr(keys_module, "_fast_chain", None)
        monkeypatch.setattr(keys_module, "_fast_packed_chain", None)
    elif keys_module._fast_chain is None:
        pytest.skip("the compiled core (kvpool_native) is not installed")
    return str(request.param)


# The fixture's path holds for every example; nothing else of it needs resetting.
@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(st.binary(min_size=1, max_size=64), min_size=1, max_size=40),
    st.sampled_from([1, 2, 3, 4, 8, 16, 17, 64]),
)
def test_chain_tokens_are_the_keys_blocks_in_order(
    chain_path: str, keys: list[bytes], tpb: int
) -> None:
    # block_tokens is hashlib's BLAKE2b, one key at a time: the specification of both paths.
    want = [t for key in keys for t in block_tokens(key, tpb)]
    assert chain_tokens(keys, tpb) == want  # computed
    assert chain_tokens(keys, tpb) == want  # remembered (Python) or computed again
    assert chain_tokens(keys[::-1], tpb) == [t for k in keys[::-1] for t in block_tokens(k, tpb)]
    assert chain_tokens(tuple(keys), tpb) == want  # a tuple takes the Python path
    packed = packed_chain_tokens(keys, tpb)
    assert packed.data == pack_all(want) and packed.tolist() == want
    assert len(packed) == len(want)
    assert packed_chain_tokens(tuple(keys), tpb).data == packed.data


def test_compiled_chain_tokens_refuses_what_it_cannot_digest() -> None:
    native = pytest.importorskip("kvpool_native")
    with pytest.raises(TypeError):
        native.chain_tokens([b"a", "b"], 4, b"p")
    with pytest.raises(ValueError, match="tokens_per_block"):
        native.chain_tokens([b"a"], 0, b"p")
    with pytest.raises(ValueError, match="person"):
        native.chain_tokens([b"a"], 4, b"p" * 17)
    assert native.chain_tokens([], 4, b"p") == []
    with pytest.raises(TypeError):
        native.chain_tokens_packed([b"a", "b"], 4, b"p")
    with pytest.raises(ValueError, match="tokens_per_block"):
        native.chain_tokens_packed([b"a"], 0, b"p")
    assert native.chain_tokens_packed([], 4, b"p") == b""


def test_packed_tokens_slice_by_token_and_refuse_what_is_not() -> None:
    tokens = PackedTokens(pack_all([5, 6, 7, 8, 9]) or b"")
    assert len(tokens) == 5 and tokens.tolist() == [5, 6, 7, 8, 9]
    assert tokens[1:3].tolist() == [6, 7] and tokens[:2].data == pack_all([5, 6])
    assert tokens[3:].tolist() == [8, 9] and tokens[4:2].tolist() == []
    assert tokens[-2:].tolist() == [8, 9] and tokens[:99].tolist() == tokens.tolist()
    with pytest.raises(ValueError, match="step 1"):
        tokens[::2]
    with pytest.raises(ValueError, match="5 bytes"):
        PackedTokens(b"12345")


def test_chain_tokens_cache_stays_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpool_agent.dataplane import keys as keys_module

    monkeypatch.setattr(keys_module, "_fast_chain", None)  # the cache is the Python path's
    monkeypatch.setattr(keys_module, "CACHE_KEYS", 16)
    monkeypatch.setattr(keys_module, "_blocks", {})
    for tag in range(20):
        chain = keys_for(tag, 5)
        want = [t for key in chain for t in block_tokens(key, 8)]
        assert chain_tokens(chain, 8) == want
        assert chain_tokens(chain, 8) == want
        assert len(keys_module._blocks[8]) <= 16
    long = keys_for(99, 40)  # longer than the cache: computed, partly remembered
    assert chain_tokens(long, 8) == [t for key in long for t in block_tokens(key, 8)]
    assert len(keys_module._blocks[8]) <= 16


def test_namespace_and_key_rules() -> None:
    ns = KeyNamespace("llama", rank=3, layer_group=1).check()
    assert ns.salt() == "\x1fkeys\x1fllama\x1f3\x1f1"
    # The tenant decides the namespace: the same keys in two tenants are two trees.
    assert tenant_salt("a", ns.salt()) != tenant_salt("b", ns.salt())
    for bad in (
        KeyNamespace(""),
        KeyNamespace("x" * 257),
        KeyNamespace("a\x1fb"),
        KeyNamespace("m", rank=-1),
        KeyNamespace("m", layer_group=1 << 32),
        KeyNamespace("m", rank=True),
    ):
        with pytest.raises(KeyFormatError):
            bad.check()
    assert check_keys([b"k"], 1) == [b"k"]
    for keys, limit in (([], 4), ([b"k"] * 5, 4), ([b""], 4), ([b"x" * 65], 4), (["str"], 4)):
        with pytest.raises(KeyFormatError):
            check_keys(keys, limit)  # type: ignore[arg-type]


def test_engine_key_of_vllm_and_sglang_hashes() -> None:
    digest = bytes(range(32))
    assert engine_key(digest) == digest  # vLLM BlockHash (sha256_cbor bytes)
    assert engine_key(memoryview(digest)) == digest
    assert engine_key(-5) == (-5).to_bytes(8, "big", signed=True)  # builtin-hash ints
    assert engine_key(1 << 200) == (1 << 200).to_bytes(32, "big")  # old sha256 ints
    assert engine_key(digest.hex()) == digest  # SGLang page hashes (hex)
    for bad in (True, 1 << 300, "zz", 1.5):
        with pytest.raises(KeyFormatError):
            engine_key(bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- engine lookup


def manager(core: str | None = None, **cfg: Any) -> KVCacheManager:
    from kvpool_agent.cache.sizing import build_pools

    cfg.setdefault("tokens_per_block", TPB)
    probe = KvCacheConfig(**cfg)
    _, groups, _ = build_pools(MODEL, probe)
    host = 6 * sum(g.block_bytes for g in groups)
    config = probe.model_copy(update={"host_cache_size": host})
    return KVCacheManager.with_capacity(MODEL, config, 8, core=core)


def store(mgr: KVCacheManager, tokens: list[int], salt: str | None = None) -> None:
    handle = mgr.open_sequence(tokens, cache_salt=salt, recompute_last_token=False)
    mgr.release(handle.seq_id)


def workload(mgr: KVCacheManager, tpb: int = TPB) -> list[Any]:
    """Stores that fill the 8-block primary tier past capacity (evicting, offloading), then
    the events they produced and the resulting tree, usage and stats."""
    for tag in range(6):
        store(mgr, chain_tokens(keys_for(100 + tag, 3), tpb), salt="s")
        store(mgr, chain_tokens(keys_for(1, 2 + tag % 2), tpb), salt="s")
    events = mgr.events.drain()
    tree = sorted((n.key, tuple(b.tier if b else -1 for b in n.blocks)) for n in mgr.iter_nodes())
    return [events, tree, mgr.usage(), dataclasses.asdict(mgr.stats)]


@pytest.mark.parametrize("core", ["native", "python"])
def test_packed_tokens_do_what_their_list_does(core: str) -> None:
    """The data plane hands the engine ``PackedTokens``: opens, lookups and curve queries of
    them leave both cores exactly as the same tokens as a list do."""
    if core == "native":
        pytest.importorskip("kvpool_native")

    def drive(mgr: KVCacheManager, wrap: Any) -> list[Any]:
        seen = []
        for tag in range(6):
            tokens = chain_tokens(keys_for(200 + tag % 4, 2 + tag % 3), TPB)
            seen.append(mgr.lookup(wrap(tokens), cache_salt="s"))
            mgr.query_policy_curve(wrap(tokens), cache_salt="s")
            handle = mgr.open_sequence(wrap(tokens), cache_salt="s", recompute_last_token=False)
            seen.append((handle.num_reused_tokens, handle.block_tables))
            mgr.release(handle.seq_id)
        return [seen, *workload(mgr)]

    def packed(tokens: list[int]) -> PackedTokens:
        return PackedTokens(pack_all(tokens) or b"")

    want = drive(manager(core, eviction_policy="mixture"), list)
    assert drive(manager(core, eviction_policy="mixture"), packed) == want
    assert any(reused for reused, _ in want[0][1::2])  # some opens reused blocks


@pytest.mark.parametrize("core", ["native", "python"])
def test_uncounted_stores_keep_the_query_counters_and_count_the_rest(core: str) -> None:
    """What the agent stores for itself (``uncounted``: a PUT, a snapshot import) leaves the
    client query counters where they were on both cores; its evictions and offloads count."""
    if core == "native":
        pytest.importorskip("kvpool_native")
    mgr = manager(core)
    store(mgr, chain_tokens(keys_for(1, 3), TPB))  # client traffic
    before = dataclasses.asdict(mgr.stats)
    with mgr.uncounted():
        for tag in range(4):
            store(mgr, chain_tokens(keys_for(10 + tag, 3), TPB))
            store(mgr, chain_tokens(keys_for(1, 3), TPB))  # a hit, not counted either
    after = dataclasses.asdict(mgr.stats)
    assert {n: after[n] for n in QUERY_COUNTERS} == {n: before[n] for n in QUERY_COUNTERS}
    assert after["evictions"][0] > before["evictions"][0] and after["offloads"] > 0
    store(mgr, chain_tokens(keys_for(1, 3), TPB))  # counted again
    assert mgr.stats.queries_blocks == before["queries_blocks"] + 3
    assert mgr.stats.sequences_opened == before["sequences_opened"] + 1


@pytest.mark.parametrize("policy", ["lru", "mixture"])
def test_lookup_has_no_side_effects(policy: str) -> None:
    """Two identical engines; one answers many lookups in between. Usage, counters, events
    and what the later workload evicts (its order: the events) stay identical."""
    engines = [manager(eviction_policy=policy) for _ in range(2)]
    chains = [chain_tokens(keys_for(tag, 3), TPB) for tag in range(4)]
    for mgr in engines:
        for tokens in chains:
            store(mgr, tokens, salt="s")
        mgr.events.drain()
    probe, twin = engines
    before = (probe.usage(), dataclasses.asdict(probe.stats), len(probe.events))
    seen = []
    for tokens in chains + [chains[0][: TPB * 2], chains[1] + [1] * TPB]:
        seen.append(probe.lookup(tokens, cache_salt="s"))
        probe.lookup(tokens)  # another namespace
        probe.lookup(tokens[:-1], cache_salt="s")  # not whole blocks: no partial match
    # 12 blocks through an 8-block primary tier: the oldest chain went to the host tier.
    assert [len(t) for t in seen] == [3, 3, 3, 3, 2, 3]
    assert seen[0] == ["secondary"] * 3 and seen[3] == ["primary"] * 3
    assert seen[4] == seen[0][:2] and seen[5] == seen[1]
    assert (probe.usage(), dataclasses.asdict(probe.stats), len(probe.events)) == before
    assert workload(probe) == workload(twin)


@pytest.mark.parametrize("policy", ["lru", "mixture"])
def test_keyed_blocks_past_a_head_row_are_the_same_on_both_cores(policy: str) -> None:
    """At 64 tokens per block a keyed block is 16 digest words, then 0s: the compiled core
    keeps no row for those 0s (``store.rs``). Both cores hold, evict, offload, look up and
    report the same, and a chain that shares only its first key is not found past it."""
    pytest.importorskip("kvpool_native")
    tpb = 64
    seen = []
    for core in ("native", "python"):
        mgr = manager(core=core, tokens_per_block=tpb, eviction_policy=policy)
        out: list[Any] = workload(mgr, tpb)
        chain = chain_tokens(keys_for(1, 3), tpb)
        other = chain_tokens(keys_for(1, 1) + keys_for(7, 2)[1:], tpb)
        out += [mgr.lookup(t, cache_salt="s") for t in (chain, chain[: 2 * tpb], other)]
        out.append(sorted((n.key, tuple(unpack(n.packed))) for n in mgr.iter_nodes()))
        seen.append(out)
    assert seen[0] == seen[1]
    found = seen[0][4:7]
    assert len(found[0]) == 3 and len(found[1]) == 2 and len(found[2]) == 1


def test_lookup_reports_host_tier_blocks_and_matches_open() -> None:
    mgr = manager(eviction_policy="lru", secondary_offload_min_priority=0)
    chains = [chain_tokens(keys_for(tag, 4), TPB) for tag in range(3)]
    for tokens in chains:  # 12 blocks through an 8-block primary tier: the first offloads
        store(mgr, tokens)
    tiers = mgr.lookup(chains[0])
    assert len(tiers) == 4 and "secondary" in tiers
    handle = mgr.open_sequence(chains[0], recompute_last_token=False)
    assert handle.num_reused_tokens == len(tiers) * TPB
    mgr.release(handle.seq_id)
    assert mgr.lookup(chains[0]) == ["primary"] * 4  # the open brought them back


def test_lookup_follows_reuse_settings_and_windows() -> None:
    mgr = manager(enable_block_reuse=False)
    tokens = chain_tokens(keys_for(7, 2), TPB)
    store(mgr, tokens)
    assert mgr.lookup(tokens) == []
    win = KVCacheManager.with_capacity(
        ModelGeometry(num_layers=2, num_kv_heads=1, head_dim=2, dtype="float32"),
        KvCacheConfig(tokens_per_block=TPB, max_attention_window=[8, 64]),
        16,
    )
    tokens = chain_tokens(keys_for(8, 5), TPB)
    store(win, tokens)
    assert win.lookup(tokens) == ["primary"] * 5

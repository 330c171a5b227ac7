"""The compiled twin of ``CacheCore``: the same seam over ``kvpool_native.Engine``.

``agent/native`` (Rust, built from source by ``hack/lib.sh``) reproduces the request-level
core of ``core.py`` exactly: the same keys (CPython's tuple hash), sequence ids, block ids,
victims and their order, counters, events and copies. ``NativeCore`` adapts it to the seam
``core.py`` specifies, so ``KVCacheManager`` runs on either (``new_core``). The Python core
stays the readable specification, and the fallback where the compiled module is missing;
``tests/cache/differential.py`` holds the two to each other.

The miss-ratio curve and the policy curve are compiled too (``native_curves.py``): the
engine holds them and feeds them on every request, and ``mrc`` and ``miniature`` are views
of them (reads, and the policy curve's ``drain``, go through the engine). A Python curve
assigned to either is replaced by its compiled equal where it has one (a curve never fed, of
a shape the compiled curves take), else fed from Python as before: the engine samples the
keys with its mask and hands them over after each call (``_after``).

What stays in Python here: the counters as a ``CacheStats`` (refreshed after each call),
and ``iter_nodes`` records (built on demand as ``TreeNode`` and ``Block`` objects:
snapshots and tools read them, the request path never does). Events stay in the engine
until drained (``NativeEvents``).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from typing import Any

from kvpool_agent.cache.block import Block, TreeNode
from kvpool_agent.cache.core import CacheCore, CopyOp, CoreLayout, CoreSettings, SequenceView
from kvpool_agent.cache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    BlockUpdated,
    KVEvent,
)
from kvpool_agent.cache.miniature import PolicyMiniature
from kvpool_agent.cache.mrc import MissRatioCurve
from kvpool_agent.cache.native_curves import (
    AnyMissRatioCurve,
    AnyPolicyMiniature,
    CompiledSampler,
    NativeMissRatioCurve,
    NativePolicyMiniature,
)
from kvpool_agent.cache.packed import PackedTokens, pack
from kvpool_agent.cache.retention import DEFAULT_RETENTION, KvCacheRetentionConfig
from kvpool_agent.cache.stats import QUERY_COUNTERS, CacheStats

try:
    import kvpool_native
except ImportError:  # the compiled core is optional: the Python core runs without it
    kvpool_native = None

CORES = ("auto", "native", "python")
"""Which core a ``KVCacheManager`` runs (``new_core``)."""
CORE_ENV = "KVPOOL_CORE"
"""Environment variable giving the core when none is asked for (default ``auto``)."""
TIER_NAMES = ("primary", "secondary")


def native_available() -> bool:
    """Whether the compiled core (``kvpool_native``) is installed."""
    return kvpool_native is not None


def native_policies() -> frozenset[str]:
    """The eviction policies the compiled core runs (empty when it is not installed)."""
    return frozenset(kvpool_native.POLICIES) if kvpool_native is not None else frozenset()


def new_core(layout: CoreLayout, settings: CoreSettings, core: str | None = None) -> Any:
    """The core ``core`` names (None: ``$KVPOOL_CORE``, else ``auto``): ``native``, ``python``,
    or ``auto``: the compiled one where it is installed and runs the configured eviction
    policy (a policy registered at run time exists only in Python), else the Python one."""
    name = core if core is not None else os.environ.get(CORE_ENV, "auto")
    if name not in CORES:
        raise ValueError(f"core: {name!r} is not one of {', '.join(CORES)} ({CORE_ENV})")
    runs = settings.eviction_policy in native_policies()
    if name == "native":
        if not native_available():
            raise RuntimeError(
                "core 'native' asked for, but kvpool_native is not installed "
                "(pip install ./agent/native, which needs a Rust toolchain)"
            )
        if not runs:
            raise ValueError(
                f"core 'native' runs the eviction policies {sorted(native_policies())}, "
                f"not {settings.eviction_policy!r}"
            )
        return NativeCore(layout, settings)
    if name == "auto" and runs:
        return NativeCore(layout, settings)
    return CacheCore(layout, settings)


class NativeEvents:
    """The engine's event buffer, as an ``EventQueue``: events become objects when drained."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    @property
    def enabled(self) -> bool:
        return bool(self._engine.events_enabled)

    @property
    def dropped(self) -> int:
        return int(self._engine.events_dropped)

    def __len__(self) -> int:
        return int(self._engine.events_len)

    def push(self, event: KVEvent) -> None:
        raise TypeError("the compiled core records its own events")

    def drain(self, limit: int | None = None) -> list[KVEvent]:
        """Remove and return up to ``limit`` events, oldest first."""
        return [_event(raw) for raw in self._engine.drain_events(limit)]

    def drain_wire(self, encoder: Any, ts: float, rank: int) -> tuple[bytes, int] | None:
        """Drain everything into one published batch by ``encoder`` (a compiled
        ``kvpool_native.WireEncoder``): the bytes and how many wire events, or None."""
        return self._engine.drain_wire(encoder, ts, rank)

    def resize(self, max_size: int) -> None:
        self._engine.resize_events(max_size)


def _event(raw: tuple[Any, ...]) -> KVEvent:
    kind = raw[0]
    if kind == "stored":
        _, key, parent, tokens, tier, priority = raw
        return BlockStored(key, parent, tokens, TIER_NAMES[tier], priority)
    if kind == "updated":
        _, key, tier, priority, tokens = raw
        return BlockUpdated(key, TIER_NAMES[tier], priority, tokens)
    if kind == "removed":
        return BlockRemoved(raw[1], TIER_NAMES[raw[2]], raw[3])
    return AllBlocksCleared()


class NativeGhost:
    """The engine's ghost list, read-only (``GhostList``'s read side)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def __len__(self) -> int:
        return int(self._engine.ghost_len)

    def __contains__(self, key: int) -> bool:
        return bool(self._engine.ghost_contains(key))

    def keys(self) -> list[int]:
        """The remembered keys, oldest first."""
        return list(self._engine.ghost_keys())


_COUNTERS = CacheStats.__dataclass_fields__.keys()
assert list(_COUNTERS) == [
    "queries_tokens",
    "queries_blocks",
    "hits_tokens",
    "hits_blocks",
    "partial_hit_tokens",
    "capacity_miss_tokens",
    "capacity_miss_blocks",
    "evictions",
    "offloads",
    "onboards",
    "chunk_moves",
    "sequences_opened",
], "NativeCore._after reads the engine's counters in this order"
_WIDTHS = [len(v) if isinstance(v, list) else 1 for v in vars(CacheStats()).values()]
_QUERY_SLOTS = tuple(
    slot
    for name, width, start in zip(
        _COUNTERS, _WIDTHS, itertools.accumulate(_WIDTHS, initial=0), strict=False
    )
    if name in QUERY_COUNTERS
    for slot in range(start, start + width)
)
"""Where ``QUERY_COUNTERS`` are in the engine's ``counters()`` (a list counter, one per tier,
takes a slot per tier)."""


class NativeCore:
    """``CacheCore``'s seam (``core.py``) over the compiled engine."""

    def __init__(self, layout: CoreLayout, settings: CoreSettings) -> None:
        assert kvpool_native is not None
        self.layout = layout
        self.settings = settings
        self.tpb = layout.tokens_per_block
        full = [g for g, flag in enumerate(layout.full_attention) if flag]
        tiers = [
            {
                "chunk_bytes": t.chunk_bytes,
                "num_chunks": t.num_chunks,
                "group_chunks": list(t.group_chunks),
                "block_bytes": list(layout.block_bytes),
            }
            for t in layout.tiers
        ]
        self._engine = kvpool_native.Engine(
            {
                "tokens_per_block": layout.tokens_per_block,
                "windows": list(layout.windows),
                "full": full[0] if full else None,
                "tiers": tiers,
                "group_blocks": tuple(list(t.group_blocks) for t in layout.tiers),
                "eviction_policy": settings.eviction_policy,
                "enable_block_reuse": settings.enable_block_reuse,
                "enable_partial_reuse": settings.enable_partial_reuse,
                "copy_on_partial_reuse": settings.copy_on_partial_reuse,
                "secondary_offload_min_priority": settings.secondary_offload_min_priority,
                "event_buffer_max_size": settings.event_buffer_max_size,
            }
        )
        self.num_groups = len(layout.windows)
        self.stats = CacheStats()
        self.events = NativeEvents(self._engine)
        self.ghost = NativeGhost(self._engine)
        self._retentions: dict[int, tuple[KvCacheRetentionConfig, Any]] = {}
        self._mrc: AnyMissRatioCurve = NativeMissRatioCurve(self._curve_capacity())
        self._mrc.attach(self._engine)
        self._miniature: AnyPolicyMiniature | None = None
        self._python_fed = False
        """Whether a curve is fed from Python (``_after``), not by the engine."""
        self.policy_curve(True)

    def _curve_capacity(self) -> int:
        """Blocks of the reference group (full attention, else the first) over both tiers."""
        full = [g for g, flag in enumerate(self.layout.full_attention) if flag]
        g = full[0] if full else 0
        return sum(t.group_blocks[g] for t in self.layout.tiers)

    # ----------------------------------------------------------------- curves

    @property
    def mrc(self) -> AnyMissRatioCurve:
        return self._mrc

    @mrc.setter
    def mrc(self, curve: AnyMissRatioCurve) -> None:
        if isinstance(curve, MissRatioCurve):
            curve = NativeMissRatioCurve.like(curve) or curve
        self._swap(self._mrc, curve)
        self._mrc = curve
        self._sampling()

    @property
    def miniature(self) -> AnyPolicyMiniature | None:
        return self._miniature

    @miniature.setter
    def miniature(self, miniature: AnyPolicyMiniature | None) -> None:
        if isinstance(miniature, PolicyMiniature):
            miniature = NativePolicyMiniature.like(miniature) or miniature
        self._swap(self._miniature, miniature)
        self._miniature = miniature
        self._sampling()

    def _swap(self, old: object, new: object) -> None:
        """Hand the engine ``new`` in place of ``old`` where either is compiled (the engine
        feeds those itself); when ``new`` cannot be attached, ``old`` is attached again."""
        if isinstance(old, CompiledSampler):
            old.detach()
        if isinstance(new, CompiledSampler):
            try:
                new.attach(self._engine)
            except Exception:
                if isinstance(old, CompiledSampler):
                    old.attach(self._engine)
                raise

    def _sampling(self) -> None:
        """Have the engine sample keys for the curves it does not feed itself."""
        mrc, mini = self._mrc, self._miniature
        mrc_mask = None if isinstance(mrc, NativeMissRatioCurve) else mrc.mask
        mini_mask = None if mini is None or isinstance(mini, NativePolicyMiniature) else mini.mask
        self._engine.set_sampling(mrc_mask, mini_mask)
        self._python_fed = mrc_mask is not None or mini_mask is not None

    def policy_curve(self, on: bool) -> None:
        """Run the policy curve's miniatures (a new one, of the current policy) or none."""
        policy = self.settings.eviction_policy
        capacity = self._curve_capacity()
        mini: AnyPolicyMiniature | None = None
        if on:
            native = policy in native_policies()
            mini = (NativePolicyMiniature if native else PolicyMiniature)(policy, capacity)
        self.miniature = mini

    def _after(self) -> None:
        """After every call: sampled accesses to the curves fed from Python (if any), the
        counters to ``stats``."""
        engine = self._engine
        if self._python_fed:
            count, mrc_keys, mini_chains = engine.take_accesses()
            if count and not isinstance(self._mrc, NativeMissRatioCurve):
                self._mrc.access_sampled(count, mrc_keys)
            mini = self._miniature
            if mini_chains and mini is not None and not isinstance(mini, NativePolicyMiniature):
                for chain in mini_chains:
                    mini.queue_chain(chain)
        c = engine.counters()
        s = self.stats
        s.queries_tokens = c[0]
        s.queries_blocks = c[1]
        s.hits_tokens = [c[2], c[3]]
        s.hits_blocks = [c[4], c[5]]
        s.partial_hit_tokens = c[6]
        s.capacity_miss_tokens = c[7]
        s.capacity_miss_blocks = c[8]
        s.evictions = [c[9], c[10]]
        s.offloads = c[11]
        s.onboards = c[12]
        s.chunk_moves = c[13]
        s.sequences_opened = c[14]

    # ----------------------------------------------------------------- requests

    def _retention(self, retention: KvCacheRetentionConfig) -> Any:
        """The policy as the engine takes it: None for the default policy object."""
        if retention is DEFAULT_RETENTION:
            return None
        found = self._retentions.get(id(retention))
        if found is not None and found[0] is retention:
            return found[1]
        spec = (
            [
                (r.token_start, r.token_end, r.priority, r.duration_ms)
                for r in retention.token_range_retention_configs
            ],
            retention.decode_retention_priority,
            retention.decode_duration_ms,
        )
        if len(self._retentions) > 64:
            self._retentions.clear()
        self._retentions[id(retention)] = (retention, spec)
        return spec

    def open(
        self,
        tokens: list[int] | PackedTokens,
        packed: bytes | None,
        namespace: int,
        retention: KvCacheRetentionConfig,
        recompute_last_token: bool,
        now: float,
    ) -> SequenceView:
        engine = self._engine
        try:
            seq_id = engine.open(
                namespace,
                packed,
                None if packed is not None else tokens,
                recompute_last_token,
                self._retention(retention),
                now,
            )
        finally:
            self._after()
        return self.sequence(seq_id)

    def append(self, seq_id: int, tokens: list[int], now: float) -> SequenceView:
        try:
            self._engine.append(seq_id, *_token_args(tokens), now)
        finally:
            self._after()
        return self.sequence(seq_id)

    def commit(self, seq_id: int, now: float) -> None:
        try:
            self._engine.commit(seq_id, now)
        finally:
            self._after()

    def release(self, seq_id: int, discard: bool, now: float) -> None:
        try:
            self._engine.release(seq_id, discard, now)
        finally:
            self._after()

    def clear(self, now: float) -> int:
        try:
            return int(self._engine.clear(now))
        finally:
            self._after()

    def save_counters(self) -> list[int]:
        """The engine's counters as they are (``KVCacheManager.uncounted``): one list, no
        ``CacheStats`` copy (a store through the data plane saves them each time)."""
        return self._engine.counters()

    def restore_counters(self, saved: list[int]) -> None:
        """Put the query counters back to ``saved`` (``save_counters``), the rest as now."""
        values = self._engine.counters()
        for slot in _QUERY_SLOTS:
            values[slot] = saved[slot]
        self._engine.set_counters(values)
        self._after()

    def count_missed(self, blocks: int) -> None:
        """Blocks a client asked for that no open matched (a lease past what the pool
        holds): counted as queried and missed."""
        self._engine.count_missed(blocks)
        self._after()

    def configure(self, settings: CoreSettings, now: float) -> None:
        old = self.settings
        self._engine.configure(
            settings.eviction_policy,
            settings.enable_block_reuse,
            settings.enable_partial_reuse,
            settings.copy_on_partial_reuse,
            settings.secondary_offload_min_priority,
            settings.event_buffer_max_size,
            now,
        )
        self.settings = settings
        if settings.eviction_policy != old.eviction_policy and self._miniature is not None:
            self.policy_curve(True)  # the curve of the new policy, from scratch
        self._after()

    def take_copies(self) -> list[CopyOp]:
        return [
            CopyOp(group, src_tier, dst_tier, tuple(src), tuple(dst))
            for group, src_tier, dst_tier, src, dst in self._engine.take_copies()
        ]

    # ----------------------------------------------------------------- read side

    def is_open(self, seq_id: int) -> bool:
        return 0 <= seq_id < 1 << 64 and bool(self._engine.has_sequence(seq_id))

    def sequence(self, seq_id: int) -> SequenceView:
        num_tokens, reused, tables, firsts = self._engine.handle(seq_id)
        return SequenceView(seq_id, num_tokens, reused, tuple(tables), tuple(firsts))

    def mute_curve(self, muted: bool) -> None:
        self._engine.set_curve_queries(not muted)

    def query_curve(self, tokens: list[int] | PackedTokens, namespace: int) -> None:
        try:
            self._engine.query_curves(namespace, *_token_args(tokens))
        finally:
            self._after()

    def lookup(self, tokens: list[int] | PackedTokens, namespace: int) -> list[int]:
        return list(self._engine.lookup(namespace, *_token_args(tokens)))

    @property
    def num_nodes(self) -> int:
        return int(self._engine.num_nodes)

    @property
    def num_open_sequences(self) -> int:
        return int(self._engine.num_open_sequences)

    @property
    def group_capacity(self) -> list[int]:
        return list(self._engine.group_capacity)

    def usage(self, tier: int, group: int) -> tuple[int, int, int, int]:
        total, free, pinned, evictable = self._engine.usage()[group][tier]
        return total, free, pinned, evictable

    def iter_nodes(self) -> Iterator[TreeNode]:
        """Every node of the tree, parents before children, as ``TreeNode`` records (built
        for the caller: changing them changes nothing in the engine)."""
        made: dict[int, TreeNode] = {}
        for node_id, key in self._engine.roots():
            made[node_id] = TreeNode(key, (), None, self.num_groups)
        for row in self._engine.nodes():
            (node_id, key, parent, _, priority, expires, stored, used, hits, tokens, blocks) = row
            above = made[parent]
            node = TreeNode(key, pack(tokens), above, self.num_groups)
            above.children[key] = node
            node.priority = priority
            node.expires_at = expires
            node.stored_at = stored
            node.last_used = used
            node.hits = hits
            for g, held in enumerate(blocks):
                if held is not None:
                    tier, block_id, refs = held
                    block = Block(g, tier, block_id)
                    block.ref_count = refs
                    block.node = node
                    node.blocks[g] = block
            made[node_id] = node
            yield node

    def memory_bytes(self) -> int:
        """Heap bytes the engine keeps (records, tokens, queues, ghosts, events)."""
        return int(self._engine.memory_bytes())


def _token_args(tokens: list[int] | PackedTokens) -> tuple[bytes | None, list[int] | None]:
    """The engine's ``(packed, tokens_list)`` arguments: the packed bytes when the tokens
    pack (every one fits 32 bits), else the list."""
    if isinstance(tokens, PackedTokens):
        return tokens.data, None
    packed = pack(tokens)
    return (packed, None) if isinstance(packed, bytes) else (None, tokens)

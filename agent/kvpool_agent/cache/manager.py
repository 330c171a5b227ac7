"""The paged KV cache manager: the engine's public API, a façade over the request-level core.

A client opens a sequence with its prompt tokens. The engine walks the radix tree block by
block (full-block matches, then an optional partial match of the next block), pins what it
reuses, onboards reused blocks that sit in the host tier, and allocates blank blocks for the
rest, in every pool group. The client writes KV into the returned block tables; blocks
enter the tree as soon as they are full and their KV is written (``commit``, or implicitly
on the next ``append_tokens`` and on ``release``). Release unpins; blocks stay reusable
until evicted by prioritized LRU (or the configured policy), and a block at or above
``secondary_offload_min_priority`` is copied to the host tier instead of dropped.

This class does what needs the model, the config, torch or the clock: it validates every
input (tokens, retention, ``cache_salt``/``extra_keys`` -> namespace, sequence ids), sizes
the pools (``sizing.py``) and owns their memory (``TierStorage``), reads the clock once per
call, and builds handles. The bookkeeping is ``core.CacheCore``'s (its module docstring is
the seam's contract); the core returns the storage copies it decided (``CopyOp``) and this
class runs them, in order, after each call, also when the call raised.

Every public method validates its input and checks capacity before changing anything: a
rejected call leaves the cache exactly as it was.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from kvpool_agent.cache.block import PRIMARY, SECONDARY, TIER_NAMES, TreeNode
from kvpool_agent.cache.core import (
    CacheCore,
    CoreLayout,
    CoreSettings,
    SequenceView,
    TierLayout,
)
from kvpool_agent.cache.errors import InvalidTokensError, RequestTooLargeError
from kvpool_agent.cache.events import EventQueue
from kvpool_agent.cache.native import NativeCore, NativeEvents, NativeGhost, new_core
from kvpool_agent.cache.native_curves import AnyMissRatioCurve, AnyPolicyMiniature
from kvpool_agent.cache.packed import PackedTokens
from kvpool_agent.cache.retention import KvCacheRetentionConfig
from kvpool_agent.cache.sequences import (
    check_and_pack,
    check_retention,
    check_seq_id,
    check_tokens,
    namespace_of,
    not_open,
)
from kvpool_agent.cache.sizing import (
    PoolPlan,
    build_pools,
    free_device_bytes,
    place,
    plan_pools,
    primary_budget,
)
from kvpool_agent.cache.stats import CacheStats, GhostList
from kvpool_agent.cache.storage import TierStorage, copy_group_blocks
from kvpool_agent.config import (
    LIVE_FIELDS,
    AgentConfig,
    ConfigError,
    KvCacheConfig,
    ModelGeometry,
)


@dataclass(frozen=True)
class SequenceHandle:
    """What a client needs to write KV and run attention for a sequence."""

    seq_id: int
    num_tokens: int
    num_reused_tokens: int
    """Leading tokens whose KV was found in the cache (the client computes the rest)."""
    block_tables: tuple[tuple[int, ...], ...]
    """Primary-tier block ids of each pool, covering tokens from ``first_token[pool]`` on."""
    first_token: tuple[int, ...]
    """Position of the first token of each pool's table (non-zero once a window slid)."""
    tokens_per_block: int

    @property
    def last_page_len(self) -> int:
        """Tokens in the last block (1..tokens_per_block), flashinfer's ``kv_last_page_len``."""
        return (self.num_tokens - 1) % self.tokens_per_block + 1


class KVCacheManager:
    """Paged KV cache over one or more pool groups, a primary and an optional host tier."""

    def __init__(
        self,
        model: ModelGeometry,
        config: KvCacheConfig,
        *,
        primary_bytes: int | None = None,
        device: str | torch.device = "cpu",
        reserved_bytes: int = 0,
        max_seq_len: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        core: str | None = None,
    ) -> None:
        self.model = model
        self.config = config.model_copy()
        self.device = torch.device(device)
        self.clock = clock
        if primary_bytes is None:
            if self.device.type != "cuda":
                raise ConfigError(
                    "a CPU primary tier needs an explicit byte budget (cpu_budget_bytes)"
                )
            primary_bytes = primary_budget(
                config, free_device_bytes(str(self.device)), reserved_bytes
            )
        self.plan: PoolPlan = plan_pools(
            model, config, primary_bytes=primary_bytes, max_seq_len=max_seq_len
        )
        self.tpb = config.tokens_per_block
        on_cuda = self.device.type == "cuda"
        self.storage = (
            TierStorage(self.plan, self.plan.primary, self.device, pin=False),
            TierStorage(self.plan, self.plan.secondary, torch.device("cpu"), pin=on_cuda),
        )
        self._core: CacheCore | NativeCore = new_core(_layout(self.plan), _settings(config), core)
        """The bookkeeping: tree, tiers, block pool, sequences, counters. ``core.py``'s
        ``CacheCore``, or its compiled twin (``native.py``), as ``core`` says (None:
        ``$KVPOOL_CORE``, else the compiled one where it is installed)."""
        self._max_blocks = self._core.group_capacity
        self._curve_muted = False

    # ----------------------------------------------------------------- construction

    @classmethod
    def with_capacity(
        cls, model: ModelGeometry, config: KvCacheConfig, num_blocks: int, **kwargs: Any
    ) -> KVCacheManager:
        """A manager whose primary tier holds ``num_blocks`` blocks of every group."""
        _, groups, _ = build_pools(model, config, kwargs.get("max_seq_len"))
        total = sum(g.block_bytes for g in groups)
        if len(groups) == 1:
            return cls(model, config, primary_bytes=num_blocks * total, **kwargs)
        # Several groups lose a little to chunk edges: size up until each has its share.
        budget = num_blocks * total
        while True:
            mgr = cls(model, config, primary_bytes=budget, **kwargs)
            if min(mgr.plan.primary.group_blocks) >= num_blocks:
                return mgr
            budget = budget * 9 // 8

    @classmethod
    def from_agent_config(cls, cfg: AgentConfig, **kwargs: Any) -> KVCacheManager:
        """Size from the agent config: CUDA memory when present, else the CPU budget
        (``sizing.place``)."""
        placement = place(cfg)
        return cls(
            cfg.model,
            cfg.kv_cache_config,
            primary_bytes=placement.primary_bytes,
            device=placement.device,
            reserved_bytes=cfg.reserved_device_bytes,
            max_seq_len=cfg.max_seq_len,
            **kwargs,
        )

    # ----------------------------------------------------------------- public API

    def open_sequence(
        self,
        tokens: Sequence[int] | PackedTokens,
        *,
        cache_salt: str | None = None,
        extra_keys: Sequence[int | str] = (),
        retention: KvCacheRetentionConfig | dict[str, Any] | None = None,
        recompute_last_token: bool = True,
    ) -> SequenceHandle:
        """Open a sequence for ``tokens``: reuse what the cache holds, allocate the rest.

        ``cache_salt`` and ``extra_keys`` (an adapter id, say) put the sequence in its own
        namespace: it only reuses blocks stored under the same salt and keys.
        ``recompute_last_token`` keeps the last prompt token out of the match, so the client
        always has a token to run and get logits from.
        """
        toks, packed = self._checked(tokens)
        if not toks:
            raise InvalidTokensError("tokens: a sequence needs at least one token")
        policy = check_retention(retention)
        n = len(toks)
        nblocks = -(-n // self.tpb)
        for most in self._max_blocks:
            if nblocks > most:
                raise RequestTooLargeError(
                    f"tokens: {n} tokens need {nblocks} blocks but the pool holds "
                    f"{most} ({most * self.tpb} tokens)"
                )
        namespace = namespace_of(cache_salt, extra_keys)
        now = self.clock()
        try:
            view = self._core.open(toks, packed, namespace, policy, recompute_last_token, now)
        finally:
            self._run_copies()
        return self._handle(view)

    def append_tokens(self, seq_id: int, tokens: Sequence[int]) -> SequenceHandle:
        """Add tokens (decode steps or a further chunk) to an open sequence.

        The KV of every token already in the sequence counts as written: its full blocks
        enter the tree now, and window groups release the blocks that the new tokens can no
        longer see.
        """
        seq_id = self._open_id(seq_id)
        toks = check_tokens(tokens)
        if not toks:
            return self._handle(self._core.sequence(seq_id))
        now = self.clock()
        try:
            view = self._core.append(seq_id, toks, now)
        finally:
            self._run_copies()
        return self._handle(view)

    def commit(self, seq_id: int) -> None:
        """Declare the KV of every token of the sequence written: full blocks become reusable."""
        seq_id = self._open_id(seq_id)
        try:
            self._core.commit(seq_id, self.clock())
        finally:
            self._run_copies()

    def release(self, seq_id: int, *, discard: bool = False) -> None:
        """Close a sequence. Its written blocks stay reusable; ``discard`` drops the
        blocks not yet committed (an aborted request whose KV was never written)."""
        seq_id = self._open_id(seq_id)
        try:
            self._core.release(seq_id, discard, self.clock())
        finally:
            self._run_copies()

    def sequence(self, seq_id: int) -> SequenceHandle:
        """The current handle of an open sequence."""
        return self._handle(self._core.sequence(self._open_id(seq_id)))

    def apply_live_config(self, new: KvCacheConfig) -> list[str]:
        """Apply the fields of ``new`` that can change at run time; returns those that changed.

        Raises ConfigError, changing nothing, if a restart-only field differs.
        """
        changed = [
            name
            for name in KvCacheConfig.model_fields
            if getattr(new, name) != getattr(self.config, name)
        ]
        restart = [f for f in changed if f"kv_cache_config.{f}" not in LIVE_FIELDS]
        if restart:
            raise ConfigError(
                "these fields need a restart: " + ", ".join(f"kv_cache_config.{f}" for f in restart)
            )
        try:
            self._core.configure(_settings(new), self.clock())
        finally:
            self._run_copies()
        self.config = new.model_copy()
        return changed

    @contextmanager
    def uncounted(self) -> Iterator[None]:
        """Requests made inside are not client traffic (a store through the transfer port, a
        snapshot import): the query and hit counters are put back afterwards, so hit rates
        stay the clients'; evictions, offloads and the rest still count."""
        saved = self._core.save_counters()
        try:
            with self.curve_muted():
                yield
        finally:
            self._core.restore_counters(saved)

    @contextmanager
    def curve_muted(self) -> Iterator[None]:
        """Sequences opened inside are no queries of the policy curve (``miniature``): a
        data-plane lease opens only the leased prefix of the chain it was asked for, and
        asks the curve with the whole chain instead (``query_policy_curve``); a store
        (``uncounted``) is no query at all."""
        if self._curve_muted:
            yield
            return
        self._curve_muted = True
        self._core.mute_curve(True)
        try:
            yield
        finally:
            self._curve_muted = False
            self._core.mute_curve(False)

    def query_policy_curve(
        self,
        tokens: Sequence[int] | PackedTokens,
        *,
        cache_salt: str | None = None,
        extra_keys: Sequence[int | str] = (),
    ) -> None:
        """A query of the policy curve with every full block of ``tokens``, as an
        ``open_sequence`` of them would make, opening nothing (muted or not)."""
        toks = self._checked(tokens)[0]
        self._core.query_curve(toks, namespace_of(cache_salt, extra_keys))

    def count_missed(self, blocks: int) -> None:
        """Count ``blocks`` a client asked for that no open matched (a lease past what the
        pool holds) as queried and missed."""
        self._core.count_missed(blocks)

    def native_memory_bytes(self) -> int | None:
        """Heap bytes the compiled core keeps (its records, tokens, queues, ghosts, events;
        tracemalloc does not see them), or None on the Python core."""
        return self._core.memory_bytes() if isinstance(self._core, NativeCore) else None

    @property
    def core_name(self) -> str:
        """Which core keeps the books: ``native`` (compiled) or ``python``."""
        return "native" if isinstance(self._core, NativeCore) else "python"

    def policy_curve(self, on: bool) -> None:
        """Run the policy curve's miniatures (a new one, of the current policy) or none."""
        self._core.policy_curve(on)

    def clear(self) -> int:
        """Drop every reusable block not used by an open sequence; returns how many nodes went."""
        try:
            return self._core.clear(self.clock())
        finally:
            self._run_copies()

    # ----------------------------------------------------------------- read side

    @property
    def stats(self) -> CacheStats:
        return self._core.stats

    @property
    def events(self) -> EventQueue | NativeEvents:
        return self._core.events

    @property
    def ghost(self) -> GhostList | NativeGhost:
        return self._core.ghost

    @property
    def mrc(self) -> AnyMissRatioCurve:
        """Reuse distances of the accessed blocks (``cache/mrc.py``): hits and stores. On the
        compiled core, a view of its compiled curve (``cache/native_curves.py``)."""
        return self._core.mrc

    @mrc.setter
    def mrc(self, curve: AnyMissRatioCurve) -> None:
        self._core.mrc = curve

    @property
    def miniature(self) -> AnyPolicyMiniature | None:
        """The policy's own curve (``cache/miniature.py``), fed each query's chain of
        block keys; the agent drains it between requests. None: off (``policy_curve``). On
        the compiled core, a view of its compiled miniature (``cache/native_curves.py``)."""
        return self._core.miniature

    @miniature.setter
    def miniature(self, miniature: AnyPolicyMiniature | None) -> None:
        self._core.miniature = miniature

    @property
    def num_nodes(self) -> int:
        return self._core.num_nodes

    @property
    def num_open_sequences(self) -> int:
        return self._core.num_open_sequences

    @property
    def group_capacity(self) -> list[int]:
        """Most primary blocks each pool group can hold (every chunk of the tier)."""
        return list(self._max_blocks)

    def usage(self) -> list[dict[str, int | str]]:
        """Blocks total, free, used, pinned (by open sequences) and evictable (queued for
        eviction now) of every pool in every tier."""
        out: list[dict[str, int | str]] = []
        for pool in self.plan.pools:
            for tier in (PRIMARY, SECONDARY):
                total, free, pinned, evictable = self._core.usage(tier, pool.group)
                out.append(
                    {
                        "pool": pool.index,
                        "tier": TIER_NAMES[tier],
                        "blocks_total": total,
                        "blocks_free": free,
                        "blocks_used": total - free,
                        "blocks_pinned": pinned,
                        "blocks_evictable": evictable,
                    }
                )
        return out

    def iter_nodes(self) -> Iterator[TreeNode]:
        """Every node of the tree, parents before children."""
        return self._core.iter_nodes()

    def read_block(self, pool: int, block_id: int, tier: int = PRIMARY) -> torch.Tensor:
        """A copy of one block's KV in a pool: ``[layers, 2, tpb, heads, dim]``."""
        return self.storage[tier].views[pool][:, block_id].clone()

    def pool_view(self, pool: int, tier: int = PRIMARY) -> torch.Tensor:
        """The paged KV tensor of a pool (``[layers, blocks, 2, tpb, heads, dim]``)."""
        return self.storage[tier].views[pool]

    def lookup(
        self,
        tokens: Sequence[int] | PackedTokens,
        *,
        cache_salt: str | None = None,
        extra_keys: Sequence[int | str] = (),
    ) -> list[str]:
        """The tier (``"primary"`` or ``"secondary"``) of each leading full block of
        ``tokens`` that an ``open_sequence`` would reuse now, without opening anything.

        Full blocks only (no partial match), and only the usable prefix (every block a query
        after it needs is present). A block counts as ``secondary`` when one of the group
        blocks the prefix needs sits in the host tier (an open would copy it back first). No
        side effects: nothing is pinned, no recency is touched, no counter moves and no
        event is queued.
        """
        toks = self._checked(tokens)[0]
        namespace = namespace_of(cache_salt, extra_keys)
        return [TIER_NAMES[tier] for tier in self._core.lookup(toks, namespace)]

    # ----------------------------------------------------------------- internals

    def _checked(
        self, tokens: Sequence[int] | PackedTokens
    ) -> tuple[list[int] | PackedTokens, bytes | None]:
        """``tokens`` checked (``check_and_pack``), with their packed bytes where they pack.
        ``PackedTokens`` need no check: the compiled core takes them as they are, the Python
        core (which reads ints) unpacked."""
        if isinstance(tokens, PackedTokens):
            if isinstance(self._core, NativeCore):
                return tokens, tokens.data
            return tokens.tolist(), tokens.data
        return check_and_pack(tokens)

    def _open_id(self, seq_id: int) -> int:
        """``seq_id``, checked to be the id of an open sequence."""
        if not self._core.is_open(check_seq_id(seq_id)):
            raise not_open(seq_id)
        return seq_id

    def _run_copies(self) -> None:
        """Execute the storage copies the core decided, in its order."""
        for op in self._core.take_copies():
            copy_group_blocks(
                self.plan,
                op.group,
                self.storage[op.src_tier],
                self.storage[op.dst_tier],
                list(op.src_ids),
                list(op.dst_ids),
            )

    def _handle(self, view: SequenceView) -> SequenceHandle:
        tpb = self.tpb
        pools = self.plan.pools
        return SequenceHandle(
            seq_id=view.seq_id,
            num_tokens=view.num_tokens,
            num_reused_tokens=view.num_reused_tokens,
            block_tables=tuple(view.tables[pool.group] for pool in pools),
            first_token=tuple(view.first_block[pool.group] * tpb for pool in pools),
            tokens_per_block=tpb,
        )


def _layout(plan: PoolPlan) -> CoreLayout:
    """The plan as the plain numbers the core keeps books by."""
    return CoreLayout(
        tokens_per_block=plan.tokens_per_block,
        windows=tuple(g.window for g in plan.groups),
        full_attention=tuple(g.full_attention for g in plan.groups),
        block_bytes=tuple(g.block_bytes for g in plan.groups),
        tiers=(_tier_layout(plan, PRIMARY), _tier_layout(plan, SECONDARY)),
    )


def _tier_layout(plan: PoolPlan, tier: int) -> TierLayout:
    t = plan.tiers()[tier]
    return TierLayout(t.chunk_bytes, t.num_chunks, t.group_chunks, t.group_blocks)


def _settings(config: KvCacheConfig) -> CoreSettings:
    return CoreSettings(
        enable_block_reuse=config.enable_block_reuse,
        enable_partial_reuse=config.enable_partial_reuse,
        copy_on_partial_reuse=config.copy_on_partial_reuse,
        secondary_offload_min_priority=config.secondary_offload_min_priority,
        eviction_policy=config.eviction_policy,
        event_buffer_max_size=config.event_buffer_max_size,
    )

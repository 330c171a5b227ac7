"""Hypothesis stateful test of the engine against a plain reference model.

The reference keeps, for each open sequence, its tokens and what the client wrote. After
every step the invariants are checked: no block leaked or handed out twice, reference
counts and pinned counts exact, nothing in use is queued for eviction, and every block
(of open sequences and of the tree, in either tier) holds exactly what was written for its
prefix, including after offload, onboard and copy-on-partial-reuse.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import hypothesis.strategies as st
import pytest
from cache_helpers import fill_value, write_kv
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, rule

from kvpool_agent.cache import (
    KVCacheManager,
    OutOfBlocksError,
    RequestTooLargeError,
)
from kvpool_agent.cache.block import PRIMARY, SECONDARY
from kvpool_agent.config import KvCacheConfig, ModelGeometry

TPB = 2
MODEL = ModelGeometry(num_layers=2, num_kv_heads=1, head_dim=1, dtype="float32")

tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=9)


class CacheMachine(RuleBasedStateMachine):
    seqs = Bundle("seqs")

    def __init__(self) -> None:
        super().__init__()
        self.mgr: KVCacheManager
        self.written: dict[int, list[int]] = {}  # seq id -> tokens whose KV is written

    @initialize(
        windows=st.sampled_from([None, [1 << 20, 3]]),
        blocks=st.integers(4, 10),
        host=st.integers(0, 6),
        copy=st.booleans(),
        threshold=st.sampled_from([0, 35, 60]),
        policy=st.sampled_from(["lru", "reuse-gap", "mixture"]),
    )
    def setup(
        self, windows: Any, blocks: int, host: int, copy: bool, threshold: int, policy: str
    ) -> None:
        from kvpool_agent.cache.sizing import build_pools

        cfg = KvCacheConfig(
            tokens_per_block=TPB,
            max_attention_window=windows,
            copy_on_partial_reuse=copy,
            secondary_offload_min_priority=threshold,
            eviction_policy=policy,
        )
        _, groups, _ = build_pools(MODEL, cfg)
        cfg = cfg.model_copy(update={"host_cache_size": host * sum(g.block_bytes for g in groups)})
        self.mgr = KVCacheManager.with_capacity(
            MODEL, cfg, blocks, max_seq_len=1 << 20, core="python"
        )

    @rule(target=seqs, tokens=tokens_st, priority=st.sampled_from([None, 10, 35, 80]))
    def open(self, tokens: list[int], priority: int | None) -> Any:
        retention = None
        if priority is not None:
            retention = {"token_range_retention_configs": [{"priority": priority}]}
        try:
            h = self.mgr.open_sequence(tokens, retention=retention)
        except (OutOfBlocksError, RequestTooLargeError):
            return None  # nothing opened; rules skip a None sequence
        write_kv(self.mgr, h, tokens, start=h.num_reused_tokens)
        self.written[h.seq_id] = list(tokens)
        return h.seq_id

    @rule(seq=seqs, tokens=st.lists(st.integers(0, 2), min_size=1, max_size=3))
    def append(self, seq: int | None, tokens: list[int]) -> None:
        if seq not in self.written:
            return
        try:
            h = self.mgr.append_tokens(seq, tokens)
        except (OutOfBlocksError, RequestTooLargeError):
            return
        old = self.written[seq]
        full = old + tokens
        write_kv(self.mgr, h, full, start=len(old))
        self.written[seq] = full

    @rule(seq=consumes(seqs))
    def release(self, seq: int | None) -> None:
        if seq not in self.written:
            return
        self.mgr.release(seq)
        del self.written[seq]

    # ------------------------------------------------------------------ invariants

    @invariant()
    def blocks_are_accounted_exactly(self) -> None:
        if not hasattr(self, "mgr"):
            return
        mgr = self.mgr
        holders: Counter[int] = Counter()
        seen: dict[tuple[int, int, int], Any] = {}
        for seq in mgr._core.sequences.values():
            for g, held in enumerate(seq.held):
                for block in held:
                    if block is None:
                        continue
                    holders[id(block)] += 1
                    key = (block.tier, g, block.block_id)
                    assert seen.setdefault(key, block) is block, f"block {key} handed out twice"
        for node in mgr.iter_nodes():
            for g, block in enumerate(node.blocks):
                if block is None:
                    continue
                assert block.node is node
                key = (block.tier, g, block.block_id)
                assert seen.setdefault(key, block) is block, f"block {key} handed out twice"
        pinned = [[0] * mgr._core.num_groups, [0] * mgr._core.num_groups]
        for block in seen.values():
            assert block.ref_count == holders[id(block)], "reference count is off"
            if block.ref_count:
                pinned[block.tier][block.group] += 1
                assert block.queue_level < 0, "a block in use is queued for eviction"
        assert pinned == mgr._core.pool.pinned
        for tier in (PRIMARY, SECONDARY):
            alloc = mgr._core.pool.tiers[tier]
            for g in range(mgr._core.num_groups):
                used = {k[2] for k in seen if k[0] == tier and k[1] == g}
                free = set(alloc._free[g])
                assert not used & free, "a block in use is also free"
                assert len(free) == len(alloc._free[g]), "a block was freed twice"
                assert len(used) + len(free) == alloc.capacity[g], "a block leaked"

    @invariant()
    def reads_equal_writes(self) -> None:
        if not hasattr(self, "mgr"):
            return
        mgr = self.mgr
        for seq_id, tokens in self.written.items():
            seq = mgr._core.sequences[seq_id]
            for g, held in enumerate(seq.held):
                for j, block in enumerate(held):
                    if block is None:
                        continue
                    for pos in range(j * TPB, min(len(tokens), (j + 1) * TPB)):
                        self._check(block, g, tokens, pos)
        for node in mgr.iter_nodes():
            prefix: list[int] = []
            n: Any = node
            while n.parent is not None:
                prefix[:0] = n.tokens
                n = n.parent
            for g, block in enumerate(node.blocks):
                if block is not None:
                    for pos in range(len(prefix) - TPB, len(prefix)):
                        self._check(block, g, prefix, pos)

    def _check(self, block: Any, g: int, tokens: list[int], pos: int) -> None:
        mgr = self.mgr
        for pool in mgr.plan.groups[g].pools:
            view = mgr.storage[block.tier].views[pool]
            got = float(view[0, block.block_id, 0, pos % TPB, 0, 0])
            assert got == fill_value(tokens, pos), (
                f"block {block} position {pos}: read {got}, wrote {fill_value(tokens, pos)}"
            )


CacheMachine.TestCase.settings = settings(
    max_examples=60,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCacheMachine = CacheMachine.TestCase
# Its invariants read the Python core's pool and sequence records; the differential harness
# (test_differential.py) holds the compiled core to the Python one.
TestCacheMachine.pytestmark = [pytest.mark.python_core]

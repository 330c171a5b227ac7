"""The agent service: the one owner of the engine, between the web layer and the cache.

The engine is single-threaded, so every engine call goes through ``EngineGate``: one asyncio
lock, held for the call (run inline when short, in a worker thread when heavy, such as
attention), after which the KV events it produced are published as one numbered batch.
Validation happens before the engine is touched, and the engine itself rejects a bad call
before changing anything, so a rejected request leaves the cache as it was.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from kvpool_agent.cache import KVCacheManager, KvCacheRetentionConfig, SequenceHandle
from kvpool_agent.cache.manager import _namespace
from kvpool_agent.config import (
    DEFAULT_PRIORITY,
    AgentConfig,
    ConfigError,
    changed_fields,
    restart_fields,
)
from kvpool_agent.server.attention import AttentionBatch, run_attention
from kvpool_agent.server.events import EventPublisher, WireEncoder
from kvpool_agent.server.snapshot import ImportResult, Namespace, export_snapshot, import_snapshot
from kvpool_kernels import PagedAttention

log = logging.getLogger("kvpool.agent")

T = TypeVar("T")


class RequestError(Exception):
    """A request the agent refuses, with the HTTP status and the reason."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass
class ReloadCounters:
    applied: int = 0
    restart_required: int = 0
    invalid: int = 0
    unchanged: int = 0
    pending_restart: list[str] = field(default_factory=list)


class AgentService:
    """Engine, config, event publisher and lifecycle state of one agent."""

    def __init__(self, config: AgentConfig, engine: KVCacheManager | None = None) -> None:
        self.config = config
        self.engine = engine if engine is not None else KVCacheManager.from_agent_config(config)
        self.lock = asyncio.Lock()
        primary_medium = "GPU" if self.engine.device.type == "cuda" else "CPU"
        ev = config.events
        self.publisher = EventPublisher(
            WireEncoder(self.engine.tpb, primary_medium),
            endpoint=ev.endpoint,
            replay_endpoint=ev.replay_endpoint,
            topic=ev.topic,
            replay_buffer=ev.replay_buffer,
        )
        self.handles: dict[int, SequenceHandle] = {}
        self.namespaces: dict[int, Namespace] = {}
        self.reloads = ReloadCounters()
        self.draining = False
        self.serving = False
        self.started_at = time.monotonic()
        self.handoff_result: str | None = None
        self.attention_kernel = PagedAttention()

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Bind the event sockets and publish the start-up events (AllBlocksCleared first)."""
        self.publisher.bind()
        self.flush_events()
        self.serving = True

    async def stop(self) -> None:
        self.serving = False
        await self.publisher.close()

    @property
    def ready(self) -> bool:
        return self.serving and self.publisher.bound and not self.draining

    # ------------------------------------------------------------------ engine calls

    async def call(self, fn: Callable[[], T], *, heavy: bool = False) -> T:
        """Run ``fn`` against the engine alone, then publish the events it produced."""
        async with self.lock:
            try:
                return await asyncio.to_thread(fn) if heavy else fn()
            finally:
                self.flush_events()

    def flush_events(self) -> None:
        events = self.engine.events.drain()
        if events:
            self.publisher.publish(events)

    def default_retention(self) -> KvCacheRetentionConfig | None:
        """The config's default policy as a request policy (None when it is the engine's)."""
        r = self.config.retention
        if r.priority == DEFAULT_PRIORITY and r.duration_ms is None:
            return None
        return KvCacheRetentionConfig.model_validate(
            {
                "token_range_retention_configs": [
                    {"token_start": 0, "priority": r.priority, "duration_ms": r.duration_ms}
                ],
                "decode_retention_priority": r.priority,
                "decode_duration_ms": r.duration_ms,
            }
        )

    async def open(
        self,
        tokens: list[int],
        cache_salt: str | None,
        extra_keys: list[int | str],
        retention: KvCacheRetentionConfig | None,
        recompute_last_token: bool,
    ) -> SequenceHandle:
        if self.draining:
            raise RequestError(503, "draining: this agent admits no new sequences")
        policy = retention if retention is not None else self.default_retention()

        def run() -> SequenceHandle:
            handle = self.engine.open_sequence(
                tokens,
                cache_salt=cache_salt,
                extra_keys=tuple(extra_keys),
                retention=policy,
                recompute_last_token=recompute_last_token,
            )
            self.handles[handle.seq_id] = handle
            if cache_salt is not None or extra_keys:
                self.namespaces[_namespace(cache_salt, extra_keys)] = (
                    cache_salt,
                    tuple(extra_keys),
                )
            return handle

        return await self.call(run)

    def handle(self, seq_id: int) -> SequenceHandle:
        handle = self.handles.get(seq_id)
        if handle is None:
            raise RequestError(404, f"sequence {seq_id} is not open (unknown or released)")
        return handle

    async def append(self, seq_id: int, tokens: list[int]) -> SequenceHandle:
        self.handle(seq_id)

        def run() -> SequenceHandle:
            handle = self.engine.append_tokens(seq_id, tokens)
            self.handles[seq_id] = handle
            return handle

        return await self.call(run)

    async def commit(self, seq_id: int) -> SequenceHandle:
        handle = self.handle(seq_id)
        await self.call(lambda: self.engine.commit(seq_id))
        return handle

    async def release(self, seq_id: int, discard: bool) -> None:
        self.handle(seq_id)

        def run() -> None:
            self.engine.release(seq_id, discard=discard)
            del self.handles[seq_id]

        await self.call(run)

    def block_ids(
        self, seq_id: int, pool: int, start: int, count: int, *, write: bool
    ) -> list[int]:
        """Primary block ids ``[start, start + count)`` of a sequence's table in ``pool``.

        Writes may not touch blocks the sequence reused whole: other sequences share them.
        """
        handle = self.handle(seq_id)
        if not 0 <= pool < len(handle.block_tables):
            raise RequestError(
                404, f"pool: {pool} does not exist (0..{len(handle.block_tables) - 1})"
            )
        table = handle.block_tables[pool]
        if count < 1 or start < 0 or start + count > len(table):
            raise RequestError(
                422,
                f"blocks [{start}, {start + count}) are outside the table of {len(table)} blocks",
            )
        if write:
            tpb = handle.tokens_per_block
            first = handle.first_token[pool] // tpb + start
            if first * tpb < handle.num_reused_tokens - handle.num_reused_tokens % tpb:
                raise RequestError(
                    409,
                    f"block {start} of pool {pool} holds reused tokens: shared blocks are "
                    f"read-only (the first {handle.num_reused_tokens} tokens were reused)",
                )
        return list(table[start : start + count])

    async def write_kv(self, seq_id: int, pool: int, start: int, kv: torch.Tensor) -> None:
        view = self.engine.pool_view(pool) if 0 <= pool < len(self.engine.plan.pools) else None
        if view is None:
            raise RequestError(404, f"pool: {pool} does not exist")
        count = kv.shape[1] if kv.dim() == view.dim() else 0
        ids = self.block_ids(seq_id, pool, start, max(count, 1), write=True)
        want = (view.shape[0], len(ids), *view.shape[2:])
        if tuple(kv.shape) != want or kv.dtype != view.dtype:
            raise RequestError(
                422,
                f"payload: expected a {view.dtype} tensor of shape {list(want)} "
                f"([layers, blocks, 2, tokens_per_block, kv_heads, head_dim]), "
                f"got {kv.dtype} {list(kv.shape)}",
            )

        def run() -> None:
            index = torch.tensor(ids, dtype=torch.long, device=view.device)
            view.index_copy_(1, index, kv.to(view.device))

        await self.call(run)

    async def read_kv(self, seq_id: int, pool: int, start: int, count: int) -> torch.Tensor:
        ids = self.block_ids(seq_id, pool, start, count, write=False)

        def run() -> torch.Tensor:
            view = self.engine.pool_view(pool)
            return view[:, torch.tensor(ids, dtype=torch.long, device=view.device)].cpu()

        return await self.call(run)

    async def attention(
        self,
        seq_ids: list[int],
        q_lens: list[int],
        layer: int,
        num_qo_heads: int,
        causal: bool,
        q: torch.Tensor,
    ) -> tuple[torch.Tensor, str]:
        if len(seq_ids) != len(q_lens):
            raise RequestError(422, f"q_lens: {len(q_lens)} entries for {len(seq_ids)} sequences")
        if len(set(seq_ids)) != len(seq_ids):
            raise RequestError(422, "seq_ids: a sequence appears twice in the batch")
        batch = AttentionBatch(
            tuple(self.handle(s) for s in seq_ids), tuple(q_lens), layer, num_qo_heads, causal
        )
        try:
            return await self.call(
                lambda: run_attention(self.engine, self.attention_kernel, batch, q), heavy=True
            )
        except ValueError as err:  # AttentionRequestError and the kernels' shape checks
            raise RequestError(422, str(err)) from None

    # ------------------------------------------------------------------ config

    async def apply_config(self, new: AgentConfig) -> list[str]:
        """Apply a reloaded config: every live change at once, or nothing if a restart-only
        field changed too (that change waits for the restart the operator rolls)."""
        async with self.lock:
            restart = restart_fields(self.config, new)
            if restart:
                self.reloads.restart_required += 1
                self.reloads.pending_restart = restart
                log.warning("config change needs a restart, not applied: %s", ", ".join(restart))
                raise ConfigError("these fields need a restart: " + ", ".join(restart))
            self.reloads.pending_restart = []
            changed = [
                f"kv_cache_config.{n}" for n in self.engine.apply_live_config(new.kv_cache_config)
            ]
            changed += [f for f in changed_fields(self.config, new) if f not in changed]
            self.config = new
            self.flush_events()
            if changed:
                self.reloads.applied += 1
                log.info("config reloaded, applied live: %s", ", ".join(changed))
            else:
                self.reloads.unchanged += 1
            return changed

    # ------------------------------------------------------------------ handoff

    async def export_hottest(self) -> bytes:
        max_blocks = self.config.lifecycle.handoff_max_blocks
        return await self.call(
            lambda: export_snapshot(self.engine, self.namespaces, max_blocks), heavy=True
        )

    async def import_blocks(self, blob: bytes) -> ImportResult:
        result = await self.call(lambda: import_snapshot(self.engine, blob), heavy=True)
        for salt, extra in result.namespaces:
            self.namespaces[_namespace(salt, extra)] = (salt, extra)
        return result

    async def release_all(self) -> int:
        """Release every open sequence, dropping uncommitted KV (end of a drain)."""

        def run() -> int:
            ids = list(self.handles)
            for seq_id in ids:
                self.engine.release(seq_id, discard=True)
                del self.handles[seq_id]
            return len(ids)

        return await self.call(run)

    def stats_document(self) -> dict[str, Any]:
        s = self.engine.stats
        return {
            "queries_tokens": s.queries_tokens,
            "hits_tokens": {"primary": s.hits_tokens[0], "secondary": s.hits_tokens[1]},
            "capacity_miss_tokens": s.capacity_miss_tokens,
            "evictions": {"primary": s.evictions[0], "secondary": s.evictions[1]},
            "offloads": s.offloads,
            "onboards": s.onboards,
            "sequences_opened": s.sequences_opened,
            "open_sequences": self.engine.num_open_sequences,
            "tree_blocks": self.engine.num_nodes,
            "pools": self.engine.usage(),
            "events_next_seq": self.publisher.next_seq,
            "draining": self.draining,
            "pending_restart": self.reloads.pending_restart,
        }

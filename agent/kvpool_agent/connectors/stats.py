"""Counters a connector keeps: what the pool gave the engine, and every way it failed to.

A pool failure costs the engine speed, never correctness; these counters are how an
operator sees the cost (each failure mode has its own counter, in blocks where it is about
blocks).
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field


@dataclass
class ConnectorStats:
    lookups: int = 0
    """Scheduler lookups sent to the pool."""
    lookups_local: int = 0
    """Of ``lookups``, misses the same-node agent's first-block table answered without a
    round trip (the prompt's first block is not in the pool)."""
    lookup_errors: int = 0
    """Lookups that failed or timed out (answered as 0 hits)."""
    lookups_skipped: int = 0
    """Lookups answered 0 without asking, during the back-off after a failure."""
    hit_blocks: int = 0
    """Blocks the pool held beyond the engine's own prefix cache (what the engine was told)."""
    leases: int = 0
    lease_errors: int = 0
    lease_short_blocks: int = 0
    """Blocks gone between lookup and lease (evicted meanwhile); they fail to load."""
    loaded_blocks: int = 0
    load_error_blocks: int = 0
    """Blocks reported to the engine as failed to load (it recomputes them)."""
    load_chunks: int = 0
    """Layer-range reads (GETs of one request's blocks, some layers) that landed."""
    load_chunk_errors: int = 0
    """Layer-range reads that failed (their request's load fails)."""
    layer_loads: int = 0
    """Layers whose loaded blocks went into the engine's pages when its attention asked."""
    layer_saves: int = 0
    """Layers whose blocks to save were copied out as the forward pass produced them."""
    layerwise_fallbacks: int = 0
    """Steps with loads in which the engine never asked for a layer: its loads failed, and
    later loads complete before the forward pass."""
    saved_blocks: int = 0
    """Blocks the pool stored from this engine (written; blocks it held already not counted)."""
    save_requests: int = 0
    save_errors: int = 0
    saves_dropped: int = 0
    """Saves not sent because the sender queue was full."""
    requests_without_load: int = 0
    """Requests whose ``kv_transfer_params`` turned loading off for them (no lookup)."""
    requests_without_save: int = 0
    """Requests whose ``kv_transfer_params`` turned saving off for them."""
    request_params_invalid: int = 0
    """Requests whose ``kv_transfer_params["kvpool"]`` was malformed: they neither loaded nor
    saved (a mistyped opt-out fails closed)."""
    node_leases: int = 0
    """Leases taken through a same-node agent's socket (alone, or the pool's agent on this
    node): their blocks move through its arena, not over the transfer port."""
    node_saved_blocks: int = 0
    """Of ``saved_blocks``, those stored through a same-node agent's socket."""
    lookup_s: float = 0.0
    """Seconds the scheduler spent in lookups and leases (it waits for them)."""
    load_s: float = 0.0
    """Seconds the engine waited for loads: starting them, waiting for a layer and copying
    it into its pages, settling them at the end of the step."""
    load_transfer_s: float = 0.0
    """Seconds the load threads spent reading (in the background of the forward pass)."""
    copy_out_s: float = 0.0
    """Seconds workers spent copying blocks to save out of vLLM's pages (the engine waits)."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: float) -> None:
        with self._lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {
                f.name: getattr(self, f.name)
                for f in dataclasses.fields(self)
                if not f.name.startswith("_")
            }

"""Differential harness of the cache engine: random scripts, everything observable recorded.

Two engines that should behave alike (the engine before and after a refactor, or the Python
engine and a compiled twin of its bookkeeping) are run on the same script and compared
record by record. A script is plain data (``Script``: an engine configuration and a few
hundred operations, JSON-able), made by ``random_script(seed)``; ``run_script`` plays it on
a fresh engine under a fake clock and records, after every operation, what a client, the
agent or an operator could observe:

- the operation's result: handle fields, lookup tiers, changed config fields, or the error's
  type and message (an error that is not the engine's API, an assertion say, is an engine
  bug: it is recorded and ends the script, since what follows it is undefined);
- the current handle of every sequence the client holds open;
- ``stats`` (every counter), ``usage()``, ``num_nodes``, ``num_open_sequences``,
  ``group_capacity``, the live config;
- the KV events (drained, every field) with the queue's length and drop count;
- every tree node in ``iter_nodes()`` order (key, parent, depth, tokens, priority, expiry,
  recency, hits, and per group: tier, block id, ref count);
- the ghost list, ``mrc.snapshot()``, the miniature's pending keys and snapshot;
- a digest of every storage arena: the runner writes KV that depends on each token's
  prefix (and the pool) into the block tables a handle returns, as a client would, so
  onboard, offload and partial copies are checked too.

``compare(make_a, make_b, script)`` gives the first difference (op index, field path, both
values); ``tests/cache/test_differential.py`` checks seeded scripts against a golden file
recorded from the engine as it was before ``cache/manager.py`` was split.

Re-recording the golden file (``python tests/cache/differential.py --record``) is
legitimate only for an intended behaviour change of the engine (or a change to what this
harness generates or records), made in the same commit, whose message says which change and
why the new records are right. A refactor must never re-record: the file is its proof.

    python tests/cache/differential.py --record          # rewrite tests/cache/golden/...
    python tests/cache/differential.py --check           # what the test does, with timings
    python tests/cache/differential.py --show SEED [--op N]   # a script, or one op's record
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import random
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpool_agent.cache import CacheError, KVCacheManager, KvCacheRetentionConfig, SequenceHandle
from kvpool_agent.cache.sizing import build_pools
from kvpool_agent.config import EVICTION_POLICIES, ConfigError, KvCacheConfig, ModelGeometry
from kvpool_agent.dataplane.keys import DIGEST_WORDS

GOLDEN = Path(__file__).with_name("golden") / "differential.json"
NUM_SCRIPTS = 96
"""Seeds ``0 .. NUM_SCRIPTS - 1`` are in the golden file (the test runs them all)."""
OP_DIGEST_CHARS = 6
"""Hex characters kept of each op's digest in the golden file (enough to find the op)."""

Clock = Callable[[], float]
MakeManager = Callable[["EngineSpec", Clock], Any]
"""Builds the engine under test for a spec and a clock (``build_manager`` by default)."""

MODELS: tuple[dict[str, Any], ...] = (
    {"num_layers": 2, "num_kv_heads": 1, "head_dim": 2, "dtype": "float32"},
    # two pools per group (different head counts): copies run once per pool
    {"num_layers": 4, "num_kv_heads": [1, 2, 1, 2], "head_dim": 2, "dtype": "float32"},
)
NAMESPACES: tuple[tuple[str | None, tuple[int | str, ...]], ...] = (
    (None, ()),
    ("tenant-a", ()),
    (None, (7,)),
    ("tenant-b", ("lora", 2)),
)
UNKNOWN_SEQ = 999_999


# --------------------------------------------------------------------------- scripts


@dataclass(frozen=True)
class EngineSpec:
    """How to build the engine: the model, the config (``host_cache_size`` comes from
    ``host_blocks``), the primary blocks of every group, ``max_seq_len``."""

    model: dict[str, Any]
    config: dict[str, Any]
    blocks: int
    host_blocks: int
    max_seq_len: int | None


@dataclass(frozen=True)
class Script:
    seed: int
    engine: EngineSpec
    ops: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def random_script(seed: int, num_ops: int | None = None, tpb: int | None = None) -> Script:
    """A random engine configuration and ``num_ops`` (a few hundred) operations; ``tpb``
    fixes the tokens per block (else 2, 4 or 16, as the golden file's scripts have)."""
    return _Generator(random.Random(seed), tpb).script(seed, num_ops)


HEAD_TOKENS = DIGEST_WORDS
"""Tokens in the compiled core's head row of a block (``agent/native/src/engine/store.rs``,
an engine key's digest words): past it, a block whose other tokens are all 0 (as the data
plane's are) keeps no tail row."""


class _Generator:
    def __init__(self, rng: random.Random, tpb: int | None = None) -> None:
        self.rng = rng
        self.fixed_tpb = tpb
        self.history: list[tuple[list[int], int]] = []
        """Recent prompts and their namespaces, that later prompts share prefixes with."""

    def script(self, seed: int, num_ops: int | None) -> Script:
        rng = self.rng
        self.tpb = tpb = self.fixed_tpb or rng.choice([2, 4, 16])
        window = rng.choice([3, tpb + 1, 2 * tpb + 3])
        windows, max_seq_len = rng.choice(
            [
                (None, None),
                (None, None),
                ([1 << 20, window], 1 << 20),  # a full-attention and a window group
                ([1 << 20, window], 1 << 20),
                ([1 << 20, window], None),  # two window groups, one very wide
                ([window], None),  # window layers only: no full-attention group
            ]
        )
        config: dict[str, Any] = {
            "tokens_per_block": tpb,
            "max_attention_window": windows,
            "eviction_policy": rng.choice(EVICTION_POLICIES),
            "enable_block_reuse": rng.random() < 0.85,
            "enable_partial_reuse": rng.random() < 0.7,
            "copy_on_partial_reuse": rng.random() < 0.5,
            "secondary_offload_min_priority": rng.choice([0, 20, 35, 50, 100]),
            "event_buffer_max_size": rng.choice([0, 2, 5, 10_000, 10_000]),
        }
        self.blocks = rng.randint(2, 28)
        self.max_len = max(2, min(6 * tpb, self.blocks * tpb * 2 // 3))
        """Longest prompt (but a few): most fit, a few sequences at once fill the pool."""
        host = 0 if rng.random() < 0.35 else rng.randint(1, 24)
        engine = EngineSpec(
            model=rng.choice(MODELS),
            config=config,
            blocks=self.blocks,
            host_blocks=host,
            max_seq_len=max_seq_len,
        )
        n = num_ops if num_ops is not None else rng.randint(200, 320)
        kinds = list(self.WEIGHTS)
        weights = list(self.WEIGHTS.values())
        ops = []
        self.open = 0  # sequences open if every open and release so far succeeded
        for _ in range(n):
            for name in self.ON_A_SEQUENCE:  # mostly on an open sequence, rarely on none
                scale = 0.15 if not self.open else 1 + self.open / 2 if name == "release" else 1
                weights[kinds.index(name)] = self.WEIGHTS[name] * scale
            kind = rng.choices(kinds, weights)[0]
            self.open = max(0, self.open + {"open": 1, "release": -1}.get(kind, 0))
            op = getattr(self, f"_{kind}")()
            op["drain"] = rng.random() < 0.85
            ops.append(op)
        return Script(seed=seed, engine=engine, ops=ops)

    WEIGHTS = {
        "open": 30.0,
        "append": 15.0,
        "commit": 5.0,
        "release": 10.0,
        "lookup": 6.0,
        "sequence": 2.0,
        "advance": 6.0,
        "clear": 1.0,
        "live_config": 2.5,
        "policy_curve": 1.0,
        "drain_miniature": 2.0,
        "invalid": 4.0,
    }

    ON_A_SEQUENCE = ("append", "commit", "release", "sequence")

    # ------------------------------------------------------------------ pieces

    def _tail(self, n: int) -> list[int]:
        rng = self.rng
        hi = 3 if rng.random() < 0.8 else 1000
        return [rng.randint(0, hi) for _ in range(n)]

    def _tokens(self) -> tuple[list[int], int]:
        """A prompt and its namespace (an index in ``NAMESPACES``)."""
        rng, tpb = self.rng, self.tpb
        ns = rng.choice([0, 0, 0, 1, 2, 3])
        if self.history and rng.random() < 0.75:
            # older prompts more often: their blocks are the ones evicted or offloaded
            base, base_ns = self.history[int(len(self.history) * rng.random() ** 2)]
            if rng.random() < 0.9:
                ns = base_ns
            cut = len(base) if rng.random() < 0.4 else rng.randint(0, len(base))
            toks = base[:cut] + self._tail(rng.randint(0, tpb + 1))
            del toks[self.max_len :]
        else:
            toks = self._tail(rng.randint(1, self.max_len))
        if rng.random() < 0.04:
            toks += self._tail((self.blocks + 2) * tpb)  # more than the pool holds
        if not toks:
            toks = self._tail(1)
        if rng.random() < 0.05:
            big = rng.choice([1 << 32, (1 << 32) + 1, (1 << 63) - 1])
            toks[rng.randrange(len(toks))] = big  # no longer packs into 32 bits
        if tpb > HEAD_TOKENS:
            # Blocks that start with an even token end in 0s past the head row: decided by
            # the block's own tokens, so a prompt that shares a prefix shares its blocks.
            for start in range(0, len(toks), tpb):
                if toks[start] % 2 == 0:
                    end = min(start + tpb, len(toks))
                    toks[start + HEAD_TOKENS : end] = [0] * max(0, end - start - HEAD_TOKENS)
        self.history.append((toks, ns))
        if len(self.history) > 24:
            del self.history[0]
        return toks, ns

    def _retention(self) -> dict[str, Any] | None:
        rng, tpb = self.rng, self.tpb
        if rng.random() < 0.6:
            return None
        ranges = []
        for _ in range(rng.randint(0, 3)):
            start = rng.randint(0, 3 * tpb)
            ranges.append(
                {
                    "token_start": start,
                    "token_end": None if rng.random() < 0.3 else start + rng.randint(1, 3 * tpb),
                    "priority": rng.choice([0, 10, 35, 60, 90, 100]),
                    "duration_ms": rng.choice([None, None, 0, 500, 2000, 10_000]),
                }
            )
        out: dict[str, Any] = {"token_range_retention_configs": ranges}
        if rng.random() < 0.5:
            out["decode_retention_priority"] = rng.choice([0, 20, 35, 70, 100])
        if rng.random() < 0.4:
            out["decode_duration_ms"] = rng.choice([None, 0, 1000, 5000])
        return out

    def _pick(self) -> int:
        return self.rng.randrange(1 << 16)

    # ------------------------------------------------------------------ operations

    def _open(self) -> dict[str, Any]:
        rng = self.rng
        tokens, ns = self._tokens()
        return {
            "op": "open",
            "tokens": tokens,
            "ns": ns,
            "retention": self._retention(),
            "retention_as": rng.choice(["dict", "model"]),
            "recompute": rng.random() < 0.7,
        }

    def _append(self) -> dict[str, Any]:
        rng, tpb = self.rng, self.tpb
        n = rng.randint(0, tpb + 2)
        if rng.random() < 0.04:
            n = (self.blocks + 3) * tpb
        return {"op": "append", "pick": self._pick(), "tokens": self._tail(n)}

    def _commit(self) -> dict[str, Any]:
        return {"op": "commit", "pick": self._pick()}

    def _release(self) -> dict[str, Any]:
        return {"op": "release", "pick": self._pick(), "discard": self.rng.random() < 0.2}

    def _lookup(self) -> dict[str, Any]:
        tokens, ns = self._tokens()
        return {"op": "lookup", "tokens": tokens, "ns": ns}

    def _sequence(self) -> dict[str, Any]:
        return {"op": "sequence", "pick": self._pick()}

    def _advance(self) -> dict[str, Any]:
        return {"op": "advance", "seconds": self.rng.choice([0.0, 0.001, 0.4, 1.0, 2.5, 12.0])}

    def _clear(self) -> dict[str, Any]:
        return {"op": "clear"}

    def _live_config(self) -> dict[str, Any]:
        rng = self.rng
        options: dict[str, Callable[[], Any]] = {
            "eviction_policy": lambda: rng.choice(EVICTION_POLICIES),
            "event_buffer_max_size": lambda: rng.choice([0, 1, 3, 10_000]),
            "enable_block_reuse": lambda: rng.random() < 0.8,
            "enable_partial_reuse": lambda: rng.random() < 0.6,
            "copy_on_partial_reuse": lambda: rng.random() < 0.5,
            "secondary_offload_min_priority": lambda: rng.choice([0, 35, 60, 100]),
            "onboard_blocks": lambda: rng.random() < 0.5,
        }
        names = rng.sample(sorted(options), rng.randint(1, 3))
        return {"op": "live_config", "changes": {name: options[name]() for name in names}}

    def _policy_curve(self) -> dict[str, Any]:
        return {"op": "policy_curve", "on": self.rng.random() < 0.7}

    def _drain_miniature(self) -> dict[str, Any]:
        return {"op": "drain_miniature", "limit": self.rng.choice([None, 1, 5])}

    def _invalid(self) -> dict[str, Any]:
        rng = self.rng
        kind = rng.choice(
            [
                "open_tokens",
                "open_empty",
                "open_retention",
                "open_salt",
                "append_unknown",
                "append_tokens",
                "release_unknown",
                "commit_unknown",
                "sequence_unknown",
                "lookup_tokens",
                "restart_field",
            ]
        )
        op: dict[str, Any] = {"op": "invalid", "kind": kind, "pick": self._pick()}
        op["tokens"] = rng.choice(
            ["abc", [1, -1], [1, 2.5], [True, 1], [3, None], {"a": 1}, [-5], [1, 1 << 63]]
        )
        op["retention"] = rng.choice(
            [
                {"token_range_retention_configs": [{"priority": 101}]},
                {"decode_retention_priority": -1},
                {"bogus": 1},
                {"token_range_retention_configs": [{"token_start": 5, "token_end": 2}]},
                {"decode_duration_ms": -3},
            ]
        )
        op["seq"] = rng.choice(["released", "unknown", "string", "bool", "float"])
        return op


# --------------------------------------------------------------------------- running


class FakeClock:
    """The engine's clock, moved only by ``advance`` operations."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def build_manager(spec: EngineSpec, clock: Clock, core: str | None = None) -> KVCacheManager:
    """The engine for ``spec`` (the default ``make_manager``), on ``core`` (None:
    ``$KVPOOL_CORE``, else the compiled one where it is installed)."""
    model = ModelGeometry(**spec.model)
    probe = KvCacheConfig(**spec.config)
    _, groups, _ = build_pools(model, probe, spec.max_seq_len)
    host = spec.host_blocks * sum(g.block_bytes for g in groups)
    config = probe.model_copy(update={"host_cache_size": host})
    return KVCacheManager.with_capacity(
        model, config, spec.blocks, max_seq_len=spec.max_seq_len, clock=clock, core=core
    )


class _Client:
    """What the runner knows of the engine: its open sequences and their tokens."""

    def __init__(self, mgr: Any, clock: FakeClock) -> None:
        self.mgr = mgr
        self.clock = clock
        self.open: list[int] = []
        self.tokens: dict[int, list[int]] = {}
        self.released: list[int] = []

    def pick(self, op: dict[str, Any]) -> int:
        return self.open[op["pick"] % len(self.open)] if self.open else UNKNOWN_SEQ

    def write(self, handle: SequenceHandle, start: int) -> None:
        """Write KV for tokens ``start ..`` of the handle's sequence, as a client would: a
        value that depends on the token's whole prefix and on the pool."""
        tokens = self.tokens[handle.seq_id]
        tpb = handle.tokens_per_block
        values = _prefix_values(tokens)
        for pool, table in enumerate(handle.block_tables):
            view = self.mgr.pool_view(pool)
            first = handle.first_token[pool]
            for pos in range(max(start, first), len(tokens)):
                view[:, table[(pos - first) // tpb], :, pos % tpb] = values[pos] + 0.25 * pool

    def opened(self, handle: SequenceHandle, tokens: list[int]) -> None:
        self.open.append(handle.seq_id)
        self.tokens[handle.seq_id] = list(tokens)
        self.write(handle, handle.num_reused_tokens)

    def apply(self, op: dict[str, Any]) -> Any:
        """Run one operation; returns its observable result (errors are raised)."""
        mgr = self.mgr
        kind = op["op"]
        if kind == "open":
            salt, extra = NAMESPACES[op["ns"]]
            retention: Any = op["retention"]
            if retention is not None and op["retention_as"] == "model":
                retention = KvCacheRetentionConfig.model_validate(retention)
            handle = mgr.open_sequence(
                op["tokens"],
                cache_salt=salt,
                extra_keys=extra,
                retention=retention,
                recompute_last_token=op["recompute"],
            )
            self.opened(handle, op["tokens"])
            return _handle(handle)
        if kind == "append":
            seq = self.pick(op)
            handle = mgr.append_tokens(seq, op["tokens"])
            old = len(self.tokens[seq])
            self.tokens[seq].extend(op["tokens"])
            self.write(handle, old)
            return _handle(handle)
        if kind == "commit":
            mgr.commit(self.pick(op))
            return None
        if kind == "release":
            seq = self.pick(op)
            mgr.release(seq, discard=op["discard"])
            self.open.remove(seq)
            del self.tokens[seq]
            self.released.append(seq)
            return None
        if kind == "lookup":
            salt, extra = NAMESPACES[op["ns"]]
            return mgr.lookup(op["tokens"], cache_salt=salt, extra_keys=extra)
        if kind == "sequence":
            return _handle(mgr.sequence(self.pick(op)))
        if kind == "advance":
            self.clock.now += op["seconds"]
            return self.clock.now
        if kind == "clear":
            return mgr.clear()
        if kind == "live_config":
            return mgr.apply_live_config(mgr.config.model_copy(update=op["changes"]))
        if kind == "policy_curve":
            mgr.policy_curve(op["on"])
            return None
        if kind == "drain_miniature":
            return None if mgr.miniature is None else mgr.miniature.drain(op["limit"])
        if kind == "invalid":
            return self.invalid(op)
        raise ValueError(f"unknown operation {kind!r}")

    def invalid(self, op: dict[str, Any]) -> Any:
        mgr = self.mgr
        kind = op["kind"]
        seq: Any = {
            "released": self.released[-1] if self.released else UNKNOWN_SEQ,
            "unknown": UNKNOWN_SEQ,
            "string": "1",
            "bool": True,
            "float": 1.0,
        }[op["seq"]]
        if kind == "open_tokens":
            return _handle(mgr.open_sequence(op["tokens"]))
        if kind == "open_empty":
            return _handle(mgr.open_sequence([]))
        if kind == "open_retention":
            return _handle(mgr.open_sequence([1, 2, 3], retention=op["retention"]))
        if kind == "open_salt":
            return _handle(mgr.open_sequence([1, 2, 3], cache_salt=5))
        if kind == "append_unknown":
            return _handle(mgr.append_tokens(seq, [1]))
        if kind == "append_tokens":
            return _handle(mgr.append_tokens(self.pick(op), op["tokens"]))
        if kind == "release_unknown":
            return mgr.release(seq)
        if kind == "commit_unknown":
            return mgr.commit(seq)
        if kind == "sequence_unknown":
            return _handle(mgr.sequence(seq))
        if kind == "lookup_tokens":
            return mgr.lookup(op["tokens"])
        if kind == "restart_field":
            new = mgr.config.model_copy(update={"tokens_per_block": mgr.tpb * 2})
            return mgr.apply_live_config(new)
        raise ValueError(f"unknown invalid operation {kind!r}")


def _prefix_values(tokens: list[int]) -> list[float]:
    out = []
    h = 0
    for t in tokens:
        h = (h * 1_000_003 + t + 1) % (1 << 61)
        out.append(float(h % 100_003))
    return out


def _handle(h: SequenceHandle) -> dict[str, Any]:
    return {
        "seq_id": h.seq_id,
        "num_tokens": h.num_tokens,
        "num_reused_tokens": h.num_reused_tokens,
        "block_tables": h.block_tables,
        "first_token": h.first_token,
        "tokens_per_block": h.tokens_per_block,
        "last_page_len": h.last_page_len,
    }


def observe(mgr: Any, result: Any, drain: bool, open_ids: list[int]) -> dict[str, Any]:
    """Everything observable about the engine now, as plain JSON-able data (``open_ids``:
    the sequences the client holds, whose current handles are recorded too)."""
    stats = dataclasses.asdict(mgr.stats)
    stats["miss_tokens"] = mgr.stats.miss_tokens
    events = mgr.events
    record: dict[str, Any] = {
        "result": result,
        "sequences": [_handle(mgr.sequence(seq_id)) for seq_id in open_ids],
        "stats": stats,
        "usage": mgr.usage(),
        "num_nodes": mgr.num_nodes,
        "num_open_sequences": mgr.num_open_sequences,
        "group_capacity": mgr.group_capacity,
        "config": mgr.config.model_dump(),
        "events_pending": len(events),
        "events_dropped": events.dropped,
        "events": [_event(e) for e in events.drain()] if drain else None,
        "nodes": [_node(n) for n in mgr.iter_nodes()],
        "ghost": list(mgr.ghost.keys()),
        "mrc": dataclasses.asdict(mgr.mrc.snapshot()),
        "mrc_keys": len(mgr.mrc),
        "miniature": None,
        "arenas": [hashlib.sha256(s.arena.numpy().tobytes()).hexdigest() for s in mgr.storage],
    }
    mini = mgr.miniature
    if mini is not None:
        record["miniature"] = {
            "pending": list(mini.pending),
            "snapshot": dataclasses.asdict(mini.snapshot()),
        }
    return record


def _event(event: Any) -> dict[str, Any]:
    return {"type": type(event).__name__, **dataclasses.asdict(event)}


def _node(node: Any) -> list[Any]:
    return [
        node.key,
        None if node.parent is None else node.parent.key,
        node.depth,
        list(node.tokens),
        node.priority,
        node.expires_at,
        node.stored_at,
        node.last_used,
        node.hits,
        [None if b is None else [b.tier, b.block_id, b.ref_count] for b in node.blocks],
    ]


def run_script(make_manager: MakeManager, script: Script) -> list[dict[str, Any]]:
    """Play ``script`` on a fresh engine; one record after construction, then one per op."""
    return list(iter_records(make_manager, script))


def iter_records(make_manager: MakeManager, script: Script) -> Iterator[dict[str, Any]]:
    clock = FakeClock()
    mgr = make_manager(script.engine, clock)
    client = _Client(mgr, clock)
    yield observe(mgr, None, True, client.open)
    for op in script.ops:
        try:
            result = client.apply(op)
        except (CacheError, ConfigError) as err:  # the error is what is observed
            result = {"error": type(err).__name__, "message": str(err)}
        except Exception as err:
            # An engine bug: the state after it is undefined, so the script ends here.
            result = {"bug": type(err).__name__, "message": str(err)}
            yield observe(mgr, result, op["drain"], [])
            return
        yield observe(mgr, result, op["drain"], client.open)


# --------------------------------------------------------------------------- comparing


def canonical(record: Any) -> str:
    """The canonical JSON of a record (sorted keys, no spaces): what digests are of."""
    return json.dumps(record, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class Digests:
    script: str
    """sha256 of the canonical JSON of the list of records."""
    ops: str
    """``OP_DIGEST_CHARS`` hex characters of each record's sha256, concatenated (record 0
    is the engine before the first op)."""


def digests(records: list[dict[str, Any]]) -> Digests:
    texts = [canonical(r) for r in records]
    whole = hashlib.sha256(("[" + ",".join(texts) + "]").encode()).hexdigest()
    ops = "".join(hashlib.sha256(t.encode()).hexdigest()[:OP_DIGEST_CHARS] for t in texts)
    return Digests(whole, ops)


@dataclass(frozen=True)
class Difference:
    index: int
    """Record index: 0 is the fresh engine, ``i`` the state after ``script.ops[i - 1]``."""
    op: dict[str, Any] | None
    path: str
    a: Any
    b: Any

    def __str__(self) -> str:
        return (
            f"record {self.index} (after op {self.op}): {self.path}\n  a: {self.a!r}\n"
            f"  b: {self.b!r}"
        )


def first_difference(a: Any, b: Any, path: str = "") -> tuple[str, Any, Any] | None:
    """The first path where two JSON-like values differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            if key not in a or key not in b:
                return f"{path}.{key}", a.get(key, "<absent>"), b.get(key, "<absent>")
            found = first_difference(a[key], b[key], f"{path}.{key}")
            if found:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list):
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            found = first_difference(x, y, f"{path}[{i}]")
            if found:
                return found
        if len(a) != len(b):
            return f"{path}.length", len(a), len(b)
        return None
    return None if a == b and type(a) is type(b) else (path or ".", a, b)


def compare(make_a: MakeManager, make_b: MakeManager, script: Script) -> Difference | None:
    """Run ``script`` on both engines (in this process); the first difference, or None."""
    recs_a = iter_records(make_a, script)
    recs_b = iter_records(make_b, script)
    for i, (ra, rb) in enumerate(zip(recs_a, recs_b, strict=True)):
        ca, cb = canonical(ra), canonical(rb)
        if ca != cb:
            found = first_difference(json.loads(ca), json.loads(cb))
            assert found is not None
            path, va, vb = found
            return Difference(i, script.ops[i - 1] if i else None, path, va, vb)
    return None


# --------------------------------------------------------------------------- golden file


def record_golden(path: Path = GOLDEN, num_scripts: int = NUM_SCRIPTS) -> dict[str, Any]:
    scripts = {}
    for seed in range(num_scripts):
        d = digests(run_script(build_manager, random_script(seed)))
        scripts[str(seed)] = {"digest": d.script, "ops": d.ops}
    golden = {
        "about": "tests/cache/differential.py: one digest per seeded script, and "
        f"{OP_DIGEST_CHARS} hex characters of each record's digest. Re-record only for an "
        "intended behaviour change, explained in the commit.",
        "op_digest_chars": OP_DIGEST_CHARS,
        "scripts": scripts,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
    return golden


def load_golden(path: Path = GOLDEN) -> dict[str, Any]:
    return json.loads(path.read_text())  # type: ignore[no-any-return]


def check_against_golden(seed: int, golden: dict[str, Any]) -> str | None:
    """None when the script of ``seed`` records what the golden file holds, else why not
    (the first differing record, the op that led to it and what it records now)."""
    want = golden["scripts"][str(seed)]
    script = random_script(seed)
    records = run_script(build_manager, script)
    got = digests(records)
    if got.script == want["digest"]:
        return None
    n = golden["op_digest_chars"]
    for i in range(len(records)):
        if got.ops[i * n : (i + 1) * n] != want["ops"][i * n : (i + 1) * n]:
            op = script.ops[i - 1] if i else "(construction)"
            return (
                f"seed {seed}: record {i} differs from the golden file, after op {op}\n"
                f"now: {canonical(records[i])[:4000]}\n"
                f"(python tests/cache/differential.py --show {seed} --op {i})"
            )
    return f"seed {seed}: the records differ from the golden file (record count?)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", action="store_true", help="rewrite the golden file")
    parser.add_argument("--check", action="store_true", help="check every seed, timed")
    parser.add_argument("--show", type=int, metavar="SEED", help="print a script")
    parser.add_argument("--op", type=int, help="with --show: print that record instead")
    args = parser.parse_args(argv)
    if args.record:
        start = time.perf_counter()
        record_golden()
        print(f"recorded {NUM_SCRIPTS} scripts in {time.perf_counter() - start:.1f}s: {GOLDEN}")
        return 0
    if args.show is not None:
        script = random_script(args.show)
        if args.op is None:
            print(json.dumps(script.to_json(), indent=1))
        else:
            records = run_script(build_manager, script)
            print(json.dumps({"op": script.ops[args.op - 1] if args.op else None}, indent=1))
            print(json.dumps(records[args.op], indent=1, sort_keys=True))
        return 0
    if args.check:
        golden = load_golden()
        failed = 0
        for seed in range(NUM_SCRIPTS):
            start = time.perf_counter()
            why = check_against_golden(seed, golden)
            print(
                f"seed {seed}: {'ok' if why is None else 'DIFFERS'} "
                f"({time.perf_counter() - start:.2f}s)"
            )
            if why is not None:
                failed += 1
                print(why)
        return 1 if failed else 0
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())

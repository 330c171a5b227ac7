"""What engine-keyed blocks (the data plane's, so every block a connector stores) cost the
engine: compiled heap per block and open + release time per block, for the synthetic tokens
engine keys make now (``kvpool-key-v2``: 32-bit words, packed like real token ids) against
those they made before (``v1``: 63-bit words, kept in the engine's side table for wide
tokens), in one run.

    python bench/engine_keys.py [--capacity 20000] [--chains 200] [--rounds 3]

Memory: a compiled-core ``KVCacheManager`` of ``--capacity`` 16-token blocks filled with
64-block chains (``native_memory_bytes`` per block of capacity). Time: 256-block chains
opened and released into a full cache of 8,192 blocks (every block evicts one), best of
``--rounds`` alternating rounds, per policy. Needs the compiled core. Writes
``engine_keys.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvpool_agent.cache import KVCacheManager
from kvpool_agent.config import KvCacheConfig, ModelGeometry
from kvpool_agent.dataplane.keys import chain_tokens

TPB = 16
SALT = "\x1fkeys\x1fbench\x1f0\x1f0"
GEOMETRY = ModelGeometry(num_layers=1, num_kv_heads=1, head_dim=2, dtype="float32")
console = Console()


def v1_tokens(keys: list[bytes], tpb: int) -> list[int]:
    """The synthetic tokens of ``kvpool-key-v1`` (8 words of 63 bits), for comparison."""
    words = min(tpb, 8)
    out: list[int] = []
    for key in keys:
        digest = hashlib.blake2b(key, digest_size=8 * words, person=b"kvpool-key-v1").digest()
        out += [w >> 1 for w in struct.unpack(f"<{words}Q", digest)] + [0] * (tpb - words)
    return out


SCHEMES: dict[str, Callable[[list[bytes], int], list[int]]] = {
    "v1 (63-bit)": v1_tokens,
    "v2 (32-bit)": chain_tokens,
}


def manager(policy: str, blocks: int) -> KVCacheManager:
    cfg = KvCacheConfig(tokens_per_block=TPB, eviction_policy=policy)
    return KVCacheManager.with_capacity(GEOMETRY, cfg, blocks, device="cpu")


def store(mgr: KVCacheManager, tokens: list[int]) -> None:
    handle = mgr.open_sequence(tokens, cache_salt=SALT, recompute_last_token=False)
    mgr.release(handle.seq_id)


def memory_per_block(scheme: str, policy: str, capacity: int) -> float:
    mgr = manager(policy, capacity)
    make = SCHEMES[scheme]
    for c in range(capacity // 64):
        store(mgr, make([b"m%d-%d" % (c, i) for i in range(64)], TPB))
    native = mgr.native_memory_bytes()
    assert native is not None
    return native / capacity


def us_per_block(scheme: str, policy: str, chains: int) -> float:
    mgr = manager(policy, 8192)
    make = SCHEMES[scheme]
    work = [make([b"t%d-%d" % (c, i) for i in range(256)], TPB) for c in range(chains)]
    for tokens in work[: 8192 // 256]:  # fill the cache: from here on every block evicts
        store(mgr, tokens)
    t0 = time.perf_counter()
    for tokens in work:
        store(mgr, tokens)
    return (time.perf_counter() - t0) / (chains * 256) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--capacity", type=int, default=20000)
    parser.add_argument("--chains", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--policies", default="lru,mixture")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    os.environ["KVPOOL_CORE"] = "native"
    policies = args.policies.split(",")
    rows = []
    steps = len(policies) * len(SCHEMES) * (1 + args.rounds)
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("engine keys", total=steps)
        for policy in policies:
            mem = {}
            for scheme in SCHEMES:
                mem[scheme] = memory_per_block(scheme, policy, args.capacity)
                bar.advance(task)
            times: dict[str, list[float]] = {s: [] for s in SCHEMES}
            for _ in range(args.rounds):  # alternating: both see the same machine
                for scheme in SCHEMES:
                    times[scheme].append(us_per_block(scheme, policy, args.chains))
                    bar.advance(task)
            for scheme in SCHEMES:
                rows.append(
                    {
                        "policy": policy,
                        "scheme": scheme,
                        "bytes_per_block": mem[scheme],
                        "us_per_block": min(times[scheme]),
                        "us_per_block_rounds": times[scheme],
                    }
                )
    table = Table(title=f"engine-keyed blocks of {TPB} tokens, compiled core")
    for col in ("policy", "synthetic tokens", "heap B/block", "open+release us/block"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r["policy"], r["scheme"], f"{r['bytes_per_block']:.0f}", f"{r['us_per_block']:.2f}"
        )
    console.print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {"command": "python bench/engine_keys.py", "tokens_per_block": TPB, "rows": rows}
    (args.out / "engine_keys.json").write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()

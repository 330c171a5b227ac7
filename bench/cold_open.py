"""What the engine's open of a connector-sized store costs when other memory traffic has
gone through the caches since the last one, by eviction policy.

In a real agent the open of a same-node PUT (``begin_store``) runs between KV copies: the
engine's copies on the other core, and the agent's own frames. py-spy put the open at about a
quarter of a real agent's samples for 32-block PUTs, roughly twice what the same open takes
in a quiet process. This reproduces that in process: ``AgentService.begin_store`` +
``finish_store`` of new 32-block chains (32 tokens a block, the connector bench's geometry)
into a full cache, with ``--churn`` MiB copied between stores (a numpy copy, which sweeps that
much memory through the caches), and times the engine's open alone, per policy. Medians over
the stores after the first third (the cache is full by then: every open evicts).

    python bench/cold_open.py [--policies lru,mixture,guarded] [--churn 0 1 8 32] [--stores 9000]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import series  # bench/series.py
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvpool_agent.config import AgentConfig
from kvpool_agent.credentials import ANONYMOUS
from kvpool_agent.dataplane.keys import KeyNamespace
from kvpool_agent.server.service import AgentService

MODEL = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 32, "dtype": "bfloat16"}
TPB = 32
BLOCKS = 32
BLOCK_BYTES = 2 * MODEL["num_layers"] * MODEL["num_kv_heads"] * MODEL["head_dim"] * TPB * 2
CAPACITY = 8192
"""Blocks of the cache (``bench/wake_cost.py``'s agent)."""
console = Console()


async def open_us(policy: str, churn_mib: int, stores: int, bar: Progress, task: Any) -> float:
    """Median µs of the engine's open over the last two thirds of ``stores`` 32-block stores,
    each after ``churn_mib`` MiB copied."""
    config = AgentConfig.model_validate(
        {
            "model": MODEL,
            "kv_cache_config": {
                "tokens_per_block": TPB,
                "enable_partial_reuse": False,
                "eviction_policy": policy,
            },
            "device": "cpu",
            "cpu_budget_bytes": CAPACITY * BLOCK_BYTES,
            "events": {"endpoint": None, "replay_endpoint": None},
            "transfer": {"port": 0},
        }
    )
    service = AgentService(config)
    await service.start()
    core = service.engine._core
    opens: list[float] = []
    inner = core.open

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            opens.append(time.perf_counter() - start)

    core.open = timed  # type: ignore[method-assign]
    src = np.ones(max(churn_mib, 1) << 20, np.uint8)
    dst = np.empty_like(src)
    ns = KeyNamespace("cold-open")
    try:
        for c in range(stores):
            keys = [hashlib.sha256(b"%d/%d" % (c, j)).digest() for j in range(BLOCKS)]
            if churn_mib:
                np.copyto(dst, src)
            begun = await service.begin_store(ANONYMOUS, ns, keys, 0)
            assert begun.store is not None
            await service.finish_store(begun.store)
            bar.advance(task)
    finally:
        await service.stop()
    return statistics.median(opens[stores // 3 :]) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default="lru,mixture")
    parser.add_argument("--churn", type=int, nargs="+", default=[0, 1, 8, 32], help="MiB")
    parser.add_argument("--stores", type=int, default=9000, help="per policy and churn")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    policies = series.policies(parser, args.policies)
    rows: list[dict[str, Any]] = []
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("stores", total=len(policies) * len(args.churn) * args.stores)
        for policy in policies:
            for churn in args.churn:
                us = asyncio.run(open_us(policy, churn, args.stores, bar, task))
                rows.append({"policy": policy, "churn_mib": churn, "open_us": us})
    table = Table(title=f"engine open of a {BLOCKS}-block store into a full cache, µs (median)")
    table.add_column("policy")
    for churn in args.churn:
        table.add_column(f"{churn} MiB between", justify="right")
    for policy in policies:
        cells = [r["open_us"] for r in rows if r["policy"] == policy]
        table.add_row(policy, *(f"{us:.1f}" for us in cells))
    console.print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {
        "command": "python bench/cold_open.py",
        "blocks_per_store": BLOCKS,
        "tokens_per_block": TPB,
        "capacity_blocks": CAPACITY,
        "stores": args.stores,
        "rows": rows,
    }
    (args.out / "cold_open.json").write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()

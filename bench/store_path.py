"""What an agent spends storing a chain of engine keys (the data plane's PUT, without its
bytes): ``AgentService.begin_store`` + ``finish_store`` of new 256-block chains into a full
CPU cache (every block evicts one, the default eviction policy), in process, with the keys'
synthetic tokens digested by the compiled core (``kvpool_native.chain_tokens_packed``) and by
Python's ``hashlib`` (the path without the compiled core), in alternating rounds.

    python bench/store_path.py [--rounds 6] [--chains 60] [--blocks 256]

The geometry is ``bench/transfer.py``'s 128 KiB block (16 layers, 1 KV head, 128 dim, 16
tokens, bf16), whose PUTs are bound by this per-block bookkeeping rather than by their
bytes. Each round gives the median over its chains (the first tenth dropped as warm-up);
the table gives the median of the rounds and their paired ratio. Writes ``store_path.json``
under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvpool_agent.config import AgentConfig
from kvpool_agent.credentials import ANONYMOUS
from kvpool_agent.dataplane import keys as keys_module
from kvpool_agent.dataplane.keys import KeyNamespace
from kvpool_agent.server.service import AgentService

MODEL = {"num_layers": 16, "num_kv_heads": 1, "head_dim": 128, "dtype": "bfloat16"}
TPB = 16
BLOCK_BYTES = 2 * 16 * 1 * 128 * TPB * 2
console = Console()


async def measure(args: argparse.Namespace) -> dict[str, list[float]]:
    compiled = keys_module._fast_chain, keys_module._fast_packed_chain
    if None in compiled:
        raise SystemExit("store_path: needs the compiled core (kvpool_native)")
    config = AgentConfig.model_validate(
        {
            "model": MODEL,
            "kv_cache_config": {"tokens_per_block": TPB},
            "device": "cpu",
            "cpu_budget_bytes": 16 * args.blocks * BLOCK_BYTES,
            "events": {"endpoint": None, "replay_endpoint": None},
            "transfer": {"port": 0},
        }
    )
    service = AgentService(config)
    await service.start()
    ns = KeyNamespace("bench")
    rounds: dict[str, list[float]] = {"compiled": [], "python": []}
    chain, n = 0, args.blocks
    try:
        with Progress(console=console, transient=True) as bar:
            task = bar.add_task("stores", total=args.rounds * 2 * args.chains)
            for _ in range(args.rounds):
                for path in rounds:  # alternating: both see the same machine
                    digests = compiled if path == "compiled" else (None, None)
                    keys_module._fast_chain, keys_module._fast_packed_chain = digests
                    times = []
                    for _ in range(args.chains):
                        chain += 1
                        keys = [f"c{chain}/{i}".encode().ljust(32, b"_") for i in range(n)]
                        start = time.perf_counter()
                        begun = await service.begin_store(ANONYMOUS, ns, keys, 0)
                        assert begun.store is not None
                        await service.finish_store(begun.store)
                        times.append(time.perf_counter() - start)
                        bar.advance(task)
                    rounds[path].append(statistics.median(times[args.chains // 10 :]))
    finally:
        keys_module._fast_chain, keys_module._fast_packed_chain = compiled
        await service.stop()
    return rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--chains", type=int, default=60, help="per round and path")
    parser.add_argument("--blocks", type=int, default=256, help="per chain")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    rounds = asyncio.run(measure(args))
    paired = [c / p for c, p in zip(rounds["compiled"], rounds["python"], strict=True)]
    rows: list[dict[str, Any]] = [
        {
            "digests": path,
            "ms_per_chain": statistics.median(times) * 1e3,
            "us_per_block": statistics.median(times) * 1e6 / args.blocks,
            "ms_per_chain_rounds": [t * 1e3 for t in times],
        }
        for path, times in rounds.items()
    ]
    table = Table(title=f"begin_store + finish_store of {args.blocks}-block chains, in process")
    for col in ("digests", "ms per chain", "us per block"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["digests"], f"{r['ms_per_chain']:.2f}", f"{r['us_per_block']:.2f}")
    console.print(table)
    console.print(f"compiled / python, paired by round: median {statistics.median(paired):.2f}")
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {
        "command": "python bench/store_path.py",
        "blocks_per_chain": args.blocks,
        "rows": rows,
        "paired_ratio_median": statistics.median(paired),
        "paired_ratios": paired,
    }
    (args.out / "store_path.json").write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""What the agent's KV-event encoder keeps per live block, beside the engine's own metadata.

To publish vLLM-compatible events, the agent remembers each block it announced (its hash on
the wire, its parent's, its medium) until the block is gone: for a million cached blocks that
is a million records, which ``bench/policy_memory.py`` (the engine alone) does not count.
This feeds ``--blocks`` BlockStored events of 16- and 512-token blocks to the compiled
encoder (``kvpool_native.WireEncoder``: its ``memory_bytes()``, the capacity of its tables)
and to the Python one (``tracemalloc``: what it still holds once the events are gone), and
prints the bytes per live block. The tokens are distinct Python ints, as a real prompt's are.

    python bench/event_memory.py [--blocks 20000] [--out bench/results]
"""

from __future__ import annotations

import argparse
import gc
import json
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvpool_agent.cache.events import BlockStored
from kvpool_agent.server.events import NativeWireEncoder, WireEncoder

TOKENS_PER_BLOCK = (16, 512)


def events(blocks: int, tpb: int) -> Iterator[BlockStored]:
    """A chain of ``blocks`` stored blocks, made one at a time (none outlives its encoding)."""
    for k in range(blocks):
        tokens = tuple(range(70_000 + k, 70_000 + k + tpb))
        yield BlockStored(k + 1, k or None, tokens, "primary", 35)


def native_bytes(blocks: int, tpb: int) -> float:
    enc = NativeWireEncoder(tpb, "GPU")
    for event in events(blocks, tpb):
        enc.encode_batch([event], 0.0, 0)
    inner = enc._inner
    return float(inner.memory_bytes()) / int(inner.live_blocks)


def python_bytes(blocks: int, tpb: int) -> float:
    gc.collect()
    tracemalloc.start()
    try:
        enc = WireEncoder(tpb, "GPU")
        for event in events(blocks, tpb):
            enc.encode(event)
        del event
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    return held / blocks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=20_000)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    rows = [
        {
            "tokens_per_block": tpb,
            "encoder": name,
            "bytes_per_live_block": measure(args.blocks, tpb),
        }
        for tpb in TOKENS_PER_BLOCK
        for name, measure in (("compiled", native_bytes), ("python", python_bytes))
    ]
    table = Table(title=f"KV-event encoder memory per live block ({args.blocks} blocks)")
    for col in ("tokens per block", "encoder", "bytes per live block"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["tokens_per_block"]), r["encoder"], f"{r['bytes_per_live_block']:.0f}")
    Console().print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {"command": "python bench/event_memory.py", "blocks": args.blocks, "rows": rows}
    (args.out / "event_memory.json").write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()

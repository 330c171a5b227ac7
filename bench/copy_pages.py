"""The same-node read's scattered copy, by the kind of page it writes to.

A same-node GET (``ShmClient.get_into`` with the compiled core) copies one piece per layer per
block out of the agent's memfd arena with ``kvpool_native.copy_spans``: the pieces are read in
the order they lie in the arena (block by block) and written to the engine's layer-major
tensor, so consecutive writes are a layer apart. This times that pattern (``--layers`` x
``--blocks`` pieces of ``--piece`` bytes) into a torch tensor and into a numpy array of the
same size: here torch's large allocations sit on 4 KiB pages, and numpy advises transparent
huge pages for its large arrays (the ``AnonHugePages`` line says what the process got). For
each, the same copy in other orders (layer by layer, destination in order; block by block with
cached rather than streaming stores, in calls of 512 KiB) and one contiguous copy of all the
bytes, in interleaved rounds; medians.

    python bench/copy_pages.py [--rounds 31] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from kvpool_native import copy_spans
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

CACHED_CALL_BYTES = 512 << 10
"""Below ``STREAM_MIN_BYTES`` (1 MiB): ``copy_spans`` uses cached stores for such a call."""


def anon_huge_kib() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--piece", type=int, default=8192, help="bytes (128 KiB blocks: 8 KiB)")
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    layers, blocks, piece = args.layers, args.blocks, args.piece
    size = layers * blocks * piece
    fd = os.memfd_create("kvpool-copy-pages")
    os.ftruncate(fd, size)
    arena = np.frombuffer(mmap.mmap(fd, size), dtype=np.uint8)
    arena[:] = 1
    targets = {"torch (4 KiB pages)": torch.zeros(size, dtype=torch.uint8).numpy()}
    targets["numpy (huge pages advised)"] = np.zeros(size, dtype=np.uint8)
    for t in targets.values():
        t[:] = 0  # every page touched before the timing
    b = np.arange(blocks, dtype=np.int64)
    layer = np.arange(layers, dtype=np.int64)
    src = ((b[:, None] * layers + layer[None, :]) * piece).ravel()  # the arena: block-major
    dst = ((layer[None, :] * blocks + b[:, None]) * piece).ravel()  # the tensor: layer-major
    by_layer = np.argsort(dst, kind="stable")
    zero = np.zeros(1, dtype=np.int64)
    per_call = max(1, CACHED_CALL_BYTES // piece)

    def cached(out: np.ndarray) -> None:
        for i in range(0, len(src), per_call):
            copy_spans(out, dst[i : i + per_call], arena, src[i : i + per_call], piece, 1)

    orders: dict[str, Callable[[np.ndarray], None]] = {
        "block by block (what a GET does)": lambda o: copy_spans(o, dst, arena, src, piece, 1),
        "layer by layer": lambda o: copy_spans(o, dst[by_layer], arena, src[by_layer], piece, 1),
        "block by block, cached stores": cached,
        "one contiguous copy": lambda o: copy_spans(o, zero, arena, zero, size, 1),
    }
    times: dict[tuple[str, str], list[float]] = {}
    with Progress(transient=True) as bar:
        task = bar.add_task("copies", total=args.rounds)
        for _ in range(args.rounds):
            for target, out in targets.items():
                for order, copy in orders.items():
                    start = time.perf_counter()
                    copy(out)
                    times.setdefault((target, order), []).append(time.perf_counter() - start)
            bar.advance(task)
    huge = anon_huge_kib()
    rows = []
    for (target, order), ts in times.items():
        ms = statistics.median(ts[2:]) * 1e3
        rows.append({"destination": target, "order": order, "ms": ms, "gbps": size / ms / 1e6})
    table = Table(title=f"{layers * blocks} pieces of {piece} B ({size >> 20} MiB), medians")
    for col in ("destination", "order", "ms", "GB/s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["destination"], r["order"], f"{r['ms']:.2f}", f"{r['gbps']:.1f}")
    console = Console()
    console.print(table)
    console.print(f"AnonHugePages of this process: {huge} kB")
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {
        "command": "python bench/copy_pages.py",
        "layers": layers,
        "blocks": blocks,
        "piece": piece,
        "anon_huge_pages_kib": huge,
        "rows": rows,
    }
    (args.out / "copy_pages.json").write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""A same-node copy into and out of the agent's arena, by the pages behind the arena and by
where a request's blocks lie in it.

A same-node PUT (``ShmClient.write``) copies one piece per layer per block from the engine's
layer-major tensor into the blocks the agent reserved, each block's layers side by side in
the arena (``cache/storage.py``), layer by layer; a GET (``ShmClient._gather``) copies them
back out block by block. In a fresh arena a request's blocks are consecutive; in a cache
that has run for a while they are wherever the evictions freed them, so consecutive pieces
land on different pages, and with 4 KiB pages every few KiB is a TLB miss. This times both
directions (``--layers`` x ``--blocks`` pieces of ``--piece`` bytes, the source or
destination a torch tensor as an engine's is) for each arena:

- ``memfd``: the shared arena as the agent made it before it advised huge pages;
- ``memfd advised``: as it makes it now (``advise_huge_pages``): 2 MiB pages only where the
  node's ``transparent_hugepage/shmem_enabled`` allows them, else the same as ``memfd``;
- ``private advised``: the arena of an agent without a Unix socket (transfer port only), 2 MiB
  pages where ``transparent_hugepage/enabled`` is ``madvise`` or ``always``;

and, as the baseline, one memcpy of the same bytes from the same tensor. Interleaved rounds
(the cases in a new random order each), medians; the table says how much of each arena the
kernel backed with 2 MiB pages.

    python bench/arena_pages.py [--rounds 31] [--arena-mib 512] [--out bench/results]
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

from kvpool_agent.hugepages import (
    SHMEM_ENABLED,
    advise_huge_pages,
    huge_page_bytes,
    shmem_setting,
)

THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def arenas(size: int) -> dict[str, tuple[mmap.mmap, np.ndarray]]:
    """Each kind of arena, touched (as the agent's is) before any timing."""
    out = {}
    for name in ("memfd", "memfd advised", "private advised"):
        if name.startswith("memfd"):
            fd = os.memfd_create("kvpool-arena-pages")
            os.ftruncate(fd, size)
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
            os.close(fd)
        else:
            mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if name.endswith("advised"):
            advise_huge_pages(mapping)
        array = np.frombuffer(mapping, dtype=np.uint8)
        array[:] = 1
        out[name] = (mapping, array)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--piece", type=int, default=8192, help="bytes (128 KiB blocks: 8 KiB)")
    parser.add_argument("--arena-mib", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    layers, blocks, piece = args.layers, args.blocks, args.piece
    block_bytes = layers * piece
    size = args.arena_mib << 20
    slots = size // block_bytes
    nbytes = layers * blocks * piece
    kinds = arenas(size)
    engine = torch.randint(0, 255, (nbytes,), dtype=torch.uint8).numpy()  # 4 KiB pages
    contiguous = np.empty(nbytes, dtype=np.uint8)
    contiguous[:] = 1
    zero = np.zeros(1, dtype=np.int64)
    # The engine's tensor is [layers, blocks, piece]; the arena holds each block's layers
    # side by side: piece (layer l, block b) is at ids[b] * block_bytes + l * piece.
    at = ((np.arange(layers)[:, None] * blocks + np.arange(blocks)[None, :]) * piece).ravel()
    rng = np.random.default_rng(0)

    def by_block(offsets: np.ndarray) -> np.ndarray:
        """The GET's order (``ShmClient._gather``): block by block, as the arena holds them."""
        return offsets.reshape(layers, blocks).T.ravel()

    def placement(kind: str) -> np.ndarray:
        if kind == "consecutive":
            start = int(rng.integers(0, slots - blocks))
            ids = np.arange(start, start + blocks, dtype=np.int64)
        else:
            ids = rng.choice(slots, blocks, replace=False).astype(np.int64)
        return (np.arange(layers)[:, None] * piece + ids[None, :] * block_bytes).ravel()

    cases: list[tuple[str, str, str, Callable[[np.ndarray], None]]] = []
    for where in ("consecutive", "scattered"):
        for name, (_, array) in kinds.items():
            put = (lambda a: lambda to: copy_spans(a, to, engine, at, piece, 1))(array)
            get = (
                lambda a: lambda to: copy_spans(engine, by_block(at), a, by_block(to), piece, 1)
            )(array)
            cases += [(where, name, "put", put), (where, name, "get", get)]
    times: dict[tuple[str, str, str], list[float]] = {c[:3]: [] for c in cases}
    memcpy: list[float] = []
    with Progress(console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("copies", total=args.rounds)
        for _ in range(args.rounds):
            t = time.perf_counter()
            copy_spans(contiguous, zero, engine, zero, nbytes, 1)
            memcpy.append(time.perf_counter() - t)
            for i in rng.permutation(len(cases)):  # no case always first after the memcpy
                where, name, op, run = cases[i]
                offsets = placement(where)
                t = time.perf_counter()
                run(offsets)
                times[(where, name, op)].append(time.perf_counter() - t)
            bar.advance(task)
    base = statistics.median(memcpy)
    huge = {name: huge_page_bytes(array.ctypes.data, size) for name, (_, array) in kinds.items()}
    rows = [
        {
            "placement": where,
            "arena": name,
            "op": op,
            "ms": statistics.median(v) * 1e3,
            "memcpy_over": base / statistics.median(v),
            "huge_page_bytes": huge[name],
        }
        for (where, name, op), v in times.items()
    ]
    table = Table(
        title=f"{nbytes >> 20} MiB in {layers * blocks} pieces of {piece} B, arenas of "
        f"{args.arena_mib} MiB; memcpy of the same bytes {base * 1e3:.2f} ms (median of "
        f"{args.rounds}); shmem_enabled: {shmem_setting()}, enabled: {shmem_setting(THP_ENABLED)}"
    )
    for col in ("placement", "arena", "2 MiB pages", "op", "ms", "memcpy / this"):
        table.add_column(col, justify="left" if col in ("placement", "arena", "op") else "right")
    for r in rows:
        share = f"{r['huge_page_bytes'] / size:.0%}"
        table.add_row(
            r["placement"], r["arena"], share, r["op"], f"{r['ms']:.2f}", f"{r['memcpy_over']:.2f}"
        )
    Console().print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / (
        "arena_pages.json" if shmem_setting() in (None, "never", "deny") else "arena_pages_thp.json"
    )
    doc = {
        "command": "python bench/arena_pages.py",
        "shmem_enabled": shmem_setting(),
        "thp_enabled": shmem_setting(THP_ENABLED),
        "shmem_enabled_path": SHMEM_ENABLED,
        "bytes": nbytes,
        "memcpy_ms": base * 1e3,
        "rows": rows,
    }
    out.write_text(json.dumps(doc, indent=2) + "\n")
    Console().print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""What a TCP PUT's receive costs by where its bytes go, without the agent around it.

``bench/transfer.py`` compares the transfer port's PUT with a raw loopback socket whose server
receives every request into the same contiguous 32 MiB buffer. The agent cannot: a PUT's
blocks go wherever the allocator put them in its arena, one piece per layer per block, in the
wire's layer-major order. This receives the same 32 MiB requests over loopback TCP, with the
compiled ``Receiver`` the agent uses, into:

* ``one buffer``: one contiguous piece, the same 32 MiB each time (the raw baseline's case);
* ``runs in the arena``: one contiguous piece at a new place of a memfd arena each time;
* ``pieces in the arena``: the blocks of a request drawn at random from the arena (a full
  cache's free blocks), each layer's piece where the agent's block-major arena holds it, in
  wire order.

The arena is ``--arena-mib`` (the transfer bench's agent: 512 MiB). The client sends a request
header and its bytes and waits for a one-byte answer, as ``bench/transfer.py``'s raw client
does; the receiver is a thread of this process (the receive holds no GIL). The cases run in
turn for ``--seconds`` each, ``--rounds`` times; per round, each case's rate over the first's.

    python bench/recv_scatter.py [--payload 128KiB] [--rounds 7] [--seconds 2]
                                 [--out bench/results/recv_scatter.json]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import socket
import statistics
import struct
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from kvpool_native import Receiver
from plots import grouped_bars
from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from transfer import GEOMETRIES, request_blocks

CASES = ("one buffer", "runs in the arena", "pieces in the arena")
console = Console()


class Target:
    """Where a case's requests go, and the receiver's offsets for the next one."""

    def __init__(self, case: str, model: dict[str, Any], arena_bytes: int, seed: int) -> None:
        block, self.blocks = request_blocks(model, 16)
        self.layers = int(model["num_layers"])
        self.piece = block // self.layers
        self.nbytes = block * self.blocks
        self.case = case
        self.rng = np.random.default_rng(seed)
        if case == "one buffer":
            self.memory = memoryview(bytearray(self.nbytes))
        else:
            fd = os.memfd_create(f"kvpool-recv-scatter-{seed}")
            os.ftruncate(fd, arena_bytes)
            self.memory = memoryview(mmap.mmap(fd, arena_bytes))
            os.close(fd)
        np.frombuffer(self.memory, dtype=np.uint8)[:] = 1  # every page touched first
        self.slots = len(self.memory) // block
        self.block = block

    def next(self) -> tuple[np.ndarray, int]:
        """Offsets and piece size of the next request."""
        if self.case == "one buffer":
            return np.zeros(1, dtype=np.int64), self.nbytes
        if self.case == "runs in the arena":
            start = int(self.rng.integers(0, self.slots - self.blocks + 1))
            return np.array([start * self.block], dtype=np.int64), self.nbytes
        ids = self.rng.choice(self.slots, self.blocks, replace=False).astype(np.int64)
        layer = np.arange(self.layers, dtype=np.int64)
        return (layer[:, None] * self.piece + ids[None, :] * self.block).ravel(), self.piece


def serve(listener: socket.socket, target: Target) -> None:
    conn, _ = listener.accept()
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        head = bytearray(9)
        while True:
            conn.setblocking(True)
            if conn.recv_into(head, 9, socket.MSG_WAITALL) < 9:
                return
            offsets, size = target.next()
            receiver = Receiver()
            receiver.add(target.memory, offsets, size)
            conn.setblocking(False)
            while not receiver.done:
                receiver.recv(conn.fileno(), 0.5)
            receiver.close()
            conn.setblocking(True)
            conn.sendall(b"k")


def rate(target: Target, seconds: float, data: memoryview) -> float:
    """Bytes per second of back-to-back requests into ``target``."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        server = threading.Thread(target=serve, args=(listener, target), daemon=True)
        server.start()
        with socket.create_connection(listener.getsockname()) as client:
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            ack, moved = bytearray(1), 0
            start = time.perf_counter()
            while time.perf_counter() - start < seconds:
                client.sendall(struct.pack("<cQ", b"P", len(data)))
                client.sendall(data)
                client.recv_into(ack)
                moved += len(data)
            elapsed = time.perf_counter() - start
        server.join(5)
    return moved / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--payload", choices=sorted(GEOMETRIES), default="128KiB")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--arena-mib", type=int, default=512)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    model = GEOMETRIES[args.payload]
    targets = [Target(c, model, args.arena_mib << 20, i) for i, c in enumerate(CASES)]
    data = memoryview(np.random.default_rng(0).integers(0, 255, targets[0].nbytes, np.uint8))
    rates: dict[str, list[float]] = {c: [] for c in CASES}
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("rounds x cases", total=args.rounds * len(CASES))
        for _ in range(args.rounds):
            for target in targets:
                rates[target.case].append(rate(target, args.seconds, data) / 1e9)
                bar.advance(task)
    first = rates[CASES[0]]
    ratios = {c: [r / f for r, f in zip(rates[c], first, strict=True)] for c in CASES}
    t0 = targets[-1]
    table = Table(
        title=f"TCP receive of {t0.nbytes >> 20} MiB requests ({args.payload} blocks: "
        f"{t0.blocks} blocks x {t0.layers} pieces of {t0.piece >> 10} KiB), medians of "
        f"{args.rounds} rounds"
    )
    for col in ("into", "GB/s", "/ one buffer (paired)"):
        table.add_column(col, justify="left" if col == "into" else "right")
    for c in CASES:
        table.add_row(
            c, f"{statistics.median(rates[c]):.2f}", f"{statistics.median(ratios[c]):.2f}"
        )
    console.print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"recv_scatter_{args.payload}"
    doc = {
        "command": f"python bench/recv_scatter.py --payload {args.payload} --rounds "
        f"{args.rounds} --seconds {args.seconds:g} --arena-mib {args.arena_mib}",
        "cpus": os.cpu_count(),
        "request_bytes": t0.nbytes,
        "blocks": t0.blocks,
        "piece_bytes": t0.piece,
        "arena_bytes": args.arena_mib << 20,
        "gb_per_s": rates,
        "ratio_to_one_buffer": ratios,
    }
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=2) + "\n")
    grouped_bars(
        stem.with_suffix(".png"),
        [f"round {i + 1}" for i in range(args.rounds)],
        rates,
        "GB/s",
        f"A {t0.nbytes >> 20} MiB TCP receive by where its bytes go ({args.payload} blocks)",
    )
    console.print(f"wrote {stem}.json and {stem}.png")


if __name__ == "__main__":
    main()

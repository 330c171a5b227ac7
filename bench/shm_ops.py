"""One same-node op of ``bench/transfer.py`` alone: ``ShmClient`` PUTs or GETs against a real
agent, and a memcpy of the same bytes by as many threads, alternating, a ratio per round.

The full benchmark runs every row after the others, with the agent busy from the rows before;
this runs one row on a fresh agent, for comparing two versions of the client or the agent
back to back (a worktree's packages first on ``PYTHONPATH``: the agent process inherits it).
``--op ping`` times instead what one same-node round trip costs: PINGs back to back, and
PINGs each after a memcpy of a request's bytes (the agent idle meanwhile, as it is while an
engine copies), p50 and p90. ``--op phases`` times one PUT at a time by phase, through the
Python exchange (the reservation's round trip, the copy into the mapping, the commit's round
trip), medians over ``--puts`` PUTs of new chains, beside one memcpy of the same bytes.
``--tcp`` runs the transfer port's PUT or GET instead (``TransferClient``, as
``bench/transfer.py`` does), its GB/s per round and their median, with no baseline: for
telling two versions' agents apart, run in turn.

    python bench/shm_ops.py --payload 2MiB --op get --clients 1 [--rounds 3] [--seconds 2]
    python bench/shm_ops.py --op ping
    python bench/shm_ops.py --payload 128KiB --op phases [--puts 400]
    python bench/shm_ops.py --payload 128KiB --op put --tcp
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from transfer import (
    GEOMETRIES,
    NS,
    AgentProcess,
    bench_memcpy_threads,
    bench_protocol,
    bench_shm,
    keys,
    memcpy_fn,
    request_blocks,
)

from kvpool_agent.dataplane.shm import ShmClient

console = Console()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--payload", choices=sorted(GEOMETRIES), default="2MiB")
    ops = ("put", "put_many", "get", "ping", "phases")
    parser.add_argument("--op", choices=ops, default="get")
    parser.add_argument("--pings", type=int, default=2000, help="per case, with --op ping")
    parser.add_argument("--puts", type=int, default=400, help="with --op phases")
    parser.add_argument("--tcp", action="store_true", help="the transfer port (put or get)")
    parser.add_argument("--clients", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--blocks", type=int, default=16, help="blocks per request (2 MiB)")
    args = parser.parse_args()
    model = GEOMETRIES[args.payload]
    block, blocks = request_blocks(model, args.blocks)
    nbytes = block * blocks
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        agent = AgentProcess(Path(tmp), model, max(512 << 20, 16 * nbytes), None)
        try:
            if args.op == "ping":
                ping_after_copies(agent.unix_socket, nbytes, args.pings)
                return
            if args.op == "phases":
                put_phases(agent.unix_socket, blocks, args.puts)
                return
            if args.tcp:
                if args.op not in ("put", "get"):
                    parser.error("--tcp takes --op put or get")
                rates = []
                for r in range(args.rounds):
                    rate = bench_protocol(
                        agent.address, args.op, args.clients, blocks, args.seconds, r
                    )
                    rates.append(rate / 1e9)
                    console.print(
                        f"{args.payload} {args.op} x{args.clients} round {r}: "
                        f"transfer port {rates[-1]:.2f} GB/s"
                    )
                console.print(f"median {statistics.median(rates):.2f} GB/s")
                return
            for r in range(args.rounds):
                memcpy = bench_memcpy_threads(nbytes, args.clients, args.seconds) / 1e9
                shm = bench_shm(agent.unix_socket, args.op, args.clients, blocks, args.seconds, r)
                ratios.append(shm / 1e9 / memcpy)
                console.print(
                    f"{args.payload} {args.op} x{args.clients} round {r}: shared memory "
                    f"{shm / 1e9:.2f} GB/s, memcpy {memcpy:.2f} GB/s, ratio {ratios[-1]:.2f}"
                )
        finally:
            agent.stop()
    console.print(f"median ratio {statistics.median(ratios):.2f}")


def put_phases(path: str, blocks: int, puts: int) -> None:
    """One PUT at a time of new ``blocks``-block chains through the Python exchange, timed by
    phase (the first tenth dropped as warm-up), and one memcpy of the same bytes."""
    copy = memcpy_fn()[1]
    phases: dict[str, list[float]] = {"reserve": [], "copy in": [], "commit": [], "memcpy": []}
    with ShmClient(path, timeout=120) as client:
        geo = client.geometry()
        kv = [torch.randn(geo.kv_shape(p.index, blocks)).to(torch.bfloat16) for p in geo.pools]
        src = np.random.default_rng(0).integers(0, 255, blocks * geo.block_bytes, dtype=np.uint8)
        dst = np.empty_like(src)
        for i in range(puts):
            t0 = time.perf_counter()
            reservation = client.reserve(NS, keys(f"phases/{i}", blocks))
            t1 = time.perf_counter()
            client.write(reservation, kv)
            t2 = time.perf_counter()
            client.commit(reservation)
            t3 = time.perf_counter()
            copy(dst, src)
            t4 = time.perf_counter()
            if i >= puts // 10:
                for name, took in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                    phases[name].append(took)
    for name, times in phases.items():
        console.print(f"{name}: median {statistics.median(times) * 1e3:.3f} ms")


def ping_after_copies(path: str, nbytes: int, pings: int) -> None:
    """PING round trips back to back, then each after a memcpy of ``nbytes``."""
    copy = memcpy_fn()[1]
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty(nbytes, np.uint8)
    with ShmClient(path, map_arena=False) as client:
        for case in ("back to back", "after a memcpy"):
            times = []
            for _ in range(pings):
                if case == "after a memcpy":
                    copy(dst, src)
                start = time.perf_counter()
                client.ping()
                times.append(time.perf_counter() - start)
            times.sort()
            p50, p90 = times[len(times) // 2], times[int(len(times) * 0.9)]
            console.print(f"PING {case}: p50 {p50 * 1e3:.3f} ms, p90 {p90 * 1e3:.3f} ms")


if __name__ == "__main__":
    main()

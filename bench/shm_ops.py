"""One same-node op of ``bench/transfer.py`` alone: ``ShmClient`` PUTs or GETs against a real
agent, and a memcpy of the same bytes by as many threads, alternating, a ratio per round.

The full benchmark runs every row after the others, with the agent busy from the rows before;
this runs one row on a fresh agent, for comparing two versions of the client or the agent
back to back (a worktree's packages first on ``PYTHONPATH``: the agent process inherits it).

    python bench/shm_ops.py --payload 2MiB --op get --clients 1 [--rounds 3] [--seconds 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from rich.console import Console
from transfer import GEOMETRIES, TPB, AgentProcess, bench_memcpy_threads, bench_shm

console = Console()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--payload", choices=sorted(GEOMETRIES), default="2MiB")
    parser.add_argument("--op", choices=("put", "put_many", "get"), default="get")
    parser.add_argument("--clients", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--blocks", type=int, default=16, help="blocks per request (2 MiB)")
    args = parser.parse_args()
    model = GEOMETRIES[args.payload]
    block = 2 * model["num_layers"] * model["num_kv_heads"] * model["head_dim"] * TPB * 2
    blocks = args.blocks * ((2 << 20) // block)
    nbytes = block * blocks
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        agent = AgentProcess(Path(tmp), model, max(512 << 20, 16 * nbytes), None)
        try:
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


if __name__ == "__main__":
    main()

"""What a LOOKUP costs an engine's scheduler by what the machine did just before it.

The vLLM connector asks the pool once per new request, between forward passes: the agent
has then been idle for a whole prefill, and the engine's threads have had every core. This
times a LOOKUP of ``--keys`` keys (a chain the pool does not hold, as on a miss) against a
real agent, over the transfer port and over its Unix socket, right after:

- ``back to back``: another LOOKUP (the agent awake);
- ``a PUT``: a PUT of the chain's blocks (the agent has just worked);
- ``a sleep``: ``--gap-ms`` of sleeping (both sides idle);
- ``a spin``: ``--gap-ms`` of the client busy in a loop on one thread (only the agent idle);
- ``a prefill``: ``--gap-ms`` of torch matrix products on ``--threads`` threads (an engine's
  forward pass on the CPU cores, which the agent shares on a CPU node).

A third client asks over the Unix socket with the agent's first-block table mapped
(``ShmClient(map_index=True)``, what the connector's scheduler does on the same node): its
misses are answered from the table without a round trip. The cases take turns in a random
order; p50 and p90 per case. The tiny Llama of
``tests/vllm_engine`` gives the geometry (2 layers, 2 KV heads of 32, 32 tokens per block).

    python bench/lookup_wakeup.py [--lookups 300] [--gap-ms 12] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from transfer import NS, AgentProcess, keys  # bench/transfer.py

from kvpool_agent.dataplane.client import TransferClient
from kvpool_agent.dataplane.shm import ShmClient

MODEL = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 32, "dtype": "bfloat16"}
TPB = 32
CASES = ("back to back", "a PUT", "a sleep", "a spin", "a prefill")
UNIX = "unix socket"
TABLE = "unix socket, table"


def prefill_for(seconds: float) -> Callable[[], None]:
    """A fixed amount of matrix products that takes about ``seconds`` on an idle machine."""
    a, b = torch.randn(384, 384), torch.randn(384, 384)
    for _ in range(20):
        torch.mm(a, b)
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < 0.5:
        torch.mm(a, b)
        n += 1
    count = max(1, round(n * seconds / 0.5))

    def prefill() -> None:
        for _ in range(count):
            torch.mm(a, b)

    return prefill


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lookups", type=int, default=300, help="per case and transport")
    parser.add_argument("--keys", type=int, default=32, help="a 1k-token prompt: 32 blocks")
    parser.add_argument("--gap-ms", type=float, default=12.0, help="the prefill's length")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prefill = prefill_for(args.gap_ms / 1e3)
    rng = random.Random(0)
    times: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        agent = AgentProcess(Path(tmp), MODEL, 256 << 20, None, tokens_per_block=TPB)
        try:
            clients: dict[str, Any] = {
                "transfer port": TransferClient([agent.address]),
                UNIX: ShmClient(agent.unix_socket),
                TABLE: ShmClient(agent.unix_socket, map_arena=False, map_index=True),
            }
            assert clients[TABLE].index is not None
            geo = clients[UNIX].geometry()
            kv = [torch.randn(geo.kv_shape(p.index, args.keys)) for p in geo.pools]
            kv = [t.to(torch.bfloat16) for t in kv]
            total = args.lookups * len(CASES) * len(clients)
            with Progress(console=Console(stderr=True), transient=True) as bar:
                task = bar.add_task("lookups", total=total)
                for i in range(args.lookups):
                    for name, client in clients.items():
                        for case in rng.sample(CASES, len(CASES)):
                            chain = keys(f"{name}/{case}/{i}", args.keys)
                            if case == "back to back":
                                client.lookup(NS, chain)
                            elif case == "a PUT":  # (the table's client maps no arena)
                                writer = clients[UNIX] if name == TABLE else client
                                writer.put(NS, keys(f"put/{name}/{i}", args.keys), kv)
                            elif case == "a sleep":
                                time.sleep(args.gap_ms / 1e3)
                            elif case == "a spin":
                                until = time.perf_counter() + args.gap_ms / 1e3
                                while time.perf_counter() < until:
                                    pass
                            else:
                                prefill()
                            start = time.perf_counter()
                            client.lookup(NS, chain)
                            times.setdefault((name, case), []).append(time.perf_counter() - start)
                            bar.advance(task)
            answered = clients[TABLE].local_misses
            assert answered == args.lookups * (len(CASES) + 1), answered  # every miss
            for client in clients.values():
                client.close()
        finally:
            agent.stop()
    rows = []
    for (name, case), values in times.items():
        values.sort()
        rows.append(
            {
                "transport": name,
                "after": case,
                "p50_ms": statistics.median(values) * 1e3,
                "p90_ms": values[int(len(values) * 0.9)] * 1e3,
            }
        )
    table = Table(
        title=f"LOOKUP of {args.keys} keys after ...: {args.lookups} each, {os.cpu_count()} CPUs, "
        f"prefill {args.gap_ms:g} ms on {args.threads} threads"
    )
    for col in ("transport", "after", "p50 ms", "p90 ms"):
        table.add_column(col, justify="right" if col.startswith("p") else "left")
    for r in rows:
        table.add_row(r["transport"], r["after"], f"{r['p50_ms']:.3f}", f"{r['p90_ms']:.3f}")
    Console().print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "lookup_wakeup.json"
    doc = {"command": "python bench/lookup_wakeup.py", "args": vars(args) | {"out": None}}
    out.write_text(json.dumps(doc | {"cpus": os.cpu_count(), "rows": rows}, indent=2) + "\n")
    Console().print(f"wrote {out}")


if __name__ == "__main__":
    main()

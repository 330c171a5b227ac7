"""CPU time per request of the transfer port against a raw loopback socket moving the same bytes.

On a machine whose cores the benchmark saturates (this 2-core one with four clients), the
ratio of ``bench/transfer.py`` is about the ratio of CPU time per request: what the protocol
spends beyond the kernel's copies is what it loses. This runs ``bench/transfer.py``'s agent,
raw server and clients in alternating rounds and reads, per request, the CPU seconds
(user + system, from ``/proc``) of the agent's event-loop thread, of the whole agent, of the
raw server, and of the client process (``getrusage``, its threads included).

For PUTs it then times, in this process and without any protocol, the engine's part of the
event loop's work on the same chains (``engine_steps``): the chain's tokens
(``packed_chain_tokens``, the step named ``chain_tokens``), the open of the
chain's synthetic sequence (with the evictions a full cache makes), naming its blocks for
their events, the release that commits them, and draining the events into a published batch.
The event loop's CPU beyond their sum is the protocol's and asyncio's share, and the engine's
data going cold between requests (the receives stream 32 MiB through the caches).

    python bench/transfer_cpu.py [--payload 128KiB] [--op put] [--clients 4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from transfer import (  # bench/transfer.py
    GEOMETRIES,
    TPB,
    AgentProcess,
    RawServer,
    bench_protocol,
    bench_raw,
    keys,
    request_blocks,
)

from kvpool_agent.cache.manager import KVCacheManager
from kvpool_agent.config import AgentConfig
from kvpool_agent.dataplane.keys import packed_chain_tokens
from kvpool_agent.server.events import make_encoder

TICK = os.sysconf("SC_CLK_TCK")
STEPS = ("chain_tokens", "open", "name", "release", "drain")


def cpu_s(pid: int, tid: int | None = None) -> float:
    """User + system CPU seconds of a process (its threads, live and gone) or of one thread."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    fields = Path(path).read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def engine_steps(model: dict[str, Any], budget: int, blocks: int, puts: int) -> dict[str, float]:
    """Microseconds per PUT of each engine step on chains of ``blocks`` new keys, in this
    process, over the second half of ``puts`` (the cache full by then: every open evicts)."""
    doc = {
        "model": model,
        "kv_cache_config": {"tokens_per_block": TPB, "enable_partial_reuse": False},
        "cpu_budget_bytes": budget,
    }
    engine = KVCacheManager.from_agent_config(AgentConfig.model_validate(doc))
    encoder = make_encoder(TPB, "CPU", native=engine.core_name == "native")
    total = dict.fromkeys(STEPS, 0.0)
    for i in range(puts):
        chain = keys(f"steps/{i}", blocks)
        t0 = time.perf_counter()
        tokens = packed_chain_tokens(chain, TPB)
        t1 = time.perf_counter()
        handle = engine.open_sequence(tokens, cache_salt="bench", recompute_last_token=False)
        t2 = time.perf_counter()
        encoder.name_chain(tokens, chain)
        t3 = time.perf_counter()
        engine.release(handle.seq_id)
        t4 = time.perf_counter()
        encoder.drain_batch(engine.events, time.time(), 0)
        t5 = time.perf_counter()
        if i >= puts // 2:
            took = (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)
            for step, seconds in zip(STEPS, took, strict=True):
                total[step] += seconds
    counted = puts - puts // 2
    return {step: seconds / counted * 1e6 for step, seconds in total.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--payload", choices=sorted(GEOMETRIES), default="128KiB")
    parser.add_argument("--op", choices=("put", "get"), default="put")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=16, help="2 MiB blocks' worth per request")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    model = GEOMETRIES[args.payload]
    block, blocks = request_blocks(model, args.blocks)
    nbytes = block * blocks
    rounds = []
    budget = max(512 << 20, 16 * nbytes)
    with tempfile.TemporaryDirectory() as tmp:
        agent = AgentProcess(Path(tmp), model, budget, None)
        raw = RawServer(nbytes)
        pid = agent.proc.pid
        try:
            bench_protocol(agent.address, args.op, args.clients, blocks, 1.0, 0)  # warm-up
            for r in range(1, args.rounds + 1):
                main0, agent0, client0 = cpu_s(pid, pid), cpu_s(pid), own_cpu_s()
                rate = bench_protocol(agent.address, args.op, args.clients, blocks, args.seconds, r)
                main1, agent1, client1 = cpu_s(pid, pid), cpu_s(pid), own_cpu_s()
                requests = rate * args.seconds / nbytes
                server0, raw_client0 = cpu_s(raw.proc.pid), own_cpu_s()
                raw_rate = bench_raw(raw.port, args.op, args.clients, nbytes, args.seconds)
                server1, raw_client1 = cpu_s(raw.proc.pid), own_cpu_s()
                raw_requests = raw_rate * args.seconds / nbytes
                rounds.append(
                    {
                        "protocol_gbps": rate / 1e9,
                        "raw_gbps": raw_rate / 1e9,
                        "ratio": rate / raw_rate,
                        "agent_loop_ms": 1e3 * (main1 - main0) / requests,
                        "agent_ms": 1e3 * (agent1 - agent0) / requests,
                        "client_ms": 1e3 * (client1 - client0) / requests,
                        "raw_server_ms": 1e3 * (server1 - server0) / raw_requests,
                        "raw_client_ms": 1e3 * (raw_client1 - raw_client0) / raw_requests,
                    }
                )
        finally:
            agent.stop()
            raw.stop()
    title = (
        f"{args.op} of {nbytes >> 20} MiB ({blocks} blocks of {args.payload}) from "
        f"{args.clients} client(s): CPU ms per request"
    )
    table = Table(title=title)
    cols = ["ratio", "agent_loop_ms", "agent_ms", "client_ms", "raw_server_ms", "raw_client_ms"]
    table.add_column("round", justify="right")
    for col in cols:
        table.add_column(col.removesuffix("_ms").replace("_", " "), justify="right")
    for i, r in enumerate(rounds, 1):
        table.add_row(str(i), *(f"{r[c]:.2f}" for c in cols))
    table.add_row("median", *(f"{statistics.median(r[c] for r in rounds):.2f}" for c in cols))
    Console().print(table)
    steps = engine_steps(model, budget, blocks, 600) if args.op == "put" else {}
    if steps:
        loop = statistics.median(r["agent_loop_ms"] for r in rounds)
        parts = Table(title="the engine's part of a PUT, in process (no protocol), ms")
        parts.add_column("step")
        parts.add_column("ms", justify="right")
        for step, us in steps.items():
            parts.add_row(step, f"{us / 1e3:.3f}")
        parts.add_row("sum", f"{sum(steps.values()) / 1e3:.3f}")
        parts.add_row("the agent's event loop, per request (median)", f"{loop:.3f}")
        Console().print(parts)
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {
        "command": "python bench/transfer_cpu.py",
        "payload": args.payload,
        "op": args.op,
        "clients": args.clients,
        "bytes_per_request": nbytes,
        "rounds": rounds,
        "engine_steps_us_per_put": steps,
    }
    (args.out / "transfer_cpu.json").write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()

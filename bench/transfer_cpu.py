"""CPU time per request of the transfer port against a raw loopback socket moving the same bytes.

On a machine whose cores the benchmark saturates (this 2-core one with four clients), the
ratio of ``bench/transfer.py`` is about the ratio of CPU time per request: what the protocol
spends beyond the kernel's copies is what it loses. This runs ``bench/transfer.py``'s agent,
raw server and clients in alternating rounds and reads, per request, the CPU seconds
(user + system, from ``/proc``) of the agent's event-loop thread, of the whole agent, of the
raw server, and of the client process (``getrusage``, its threads included).

    python bench/transfer_cpu.py [--payload 128KiB] [--op put] [--clients 4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table
from transfer import (  # bench/transfer.py
    GEOMETRIES,
    AgentProcess,
    RawServer,
    bench_protocol,
    bench_raw,
    request_blocks,
)

TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int, tid: int | None = None) -> float:
    """User + system CPU seconds of a process (its threads, live and gone) or of one thread."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    fields = Path(path).read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


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
    with tempfile.TemporaryDirectory() as tmp:
        agent = AgentProcess(Path(tmp), model, max(512 << 20, 16 * nbytes), None)
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
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {
        "command": "python bench/transfer_cpu.py",
        "payload": args.payload,
        "op": args.op,
        "clients": args.clients,
        "bytes_per_request": nbytes,
        "rounds": rounds,
    }
    (args.out / "transfer_cpu.json").write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()

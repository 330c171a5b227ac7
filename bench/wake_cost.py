"""What one request costs a server's CPU, back to back and after the server sat idle.

A same-node store (the vLLM connector's save of a request's new blocks) costs the agent about
twice as much CPU when requests come 15 ms apart, as an engine's come, as back to back. This
measures how much of that any Python event loop pays on this machine, and how much is the
agent's own: servers on a Unix socket, each driven by one client that sends a request, waits
for the reply, then sleeps ``gap`` before the next:

* ``blocking echo``, ``asyncio echo``, ``uvloop echo``: 32 bytes echoed by a blocking
  ``recv``/``send`` loop, by asyncio streams, by asyncio on uvloop (the agent's loop);
* ``agent PING``, ``agent LOOKUP``, ``agent PUT``: a real ``kvpool agent`` (its same-node
  socket): a PING, a LOOKUP of 32 keys, and a PUT of 32 new blocks through ``ShmClient``
  (PUT_SHM, the copy into the mapped arena, COMMIT; the connector bench's geometry: 2 layers,
  2 KV heads, head dim 32, 32 tokens per block).

CPU is the server process's, all its threads (``/proc/<pid>/task/*/schedstat``), less what it
burns idle over the same time (measured first), per request; the client's is its calling
thread's (``time.thread_time``). Medians over rounds. ``--before WORKTREE`` runs a second
agent from that checkout's packages beside this one, in the same rounds (its rows named
``before``): the clients are this tree's for both.

    python bench/wake_cost.py [--rounds 3] [--gaps 0 1 5 15] [--before WORKTREE]
                              [--out bench/results/wake_cost.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from plots import grouped_bars
from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from transfer import AgentProcess
from vllm_connector import cpu_s

from kvpool_agent.dataplane.keys import KeyNamespace
from kvpool_agent.dataplane.shm import ShmClient

REPO = Path(__file__).resolve().parents[1]
MODEL = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 32, "dtype": "bfloat16"}
TPB = 32
BLOCKS = 32
BLOCK_BYTES = 2 * MODEL["num_layers"] * MODEL["num_kv_heads"] * MODEL["head_dim"] * TPB * 2
ECHOES = ("blocking", "asyncio", "uvloop")

ECHO_SERVER = r"""
import asyncio, os, socket, sys
kind, path = sys.argv[1], sys.argv[2]
if kind == "blocking":
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen()
    print("ready", flush=True)
    conn, _ = srv.accept()
    while data := conn.recv(64):
        conn.sendall(data)
    sys.exit()
if kind == "uvloop":
    import uvloop
    uvloop.install()
async def handle(reader, writer):
    while data := await reader.read(64):
        writer.write(data)
async def main():
    srv = await asyncio.start_unix_server(handle, path)
    print("ready", flush=True)
    await srv.serve_forever()
asyncio.run(main())
"""


class Server:
    """A server process, the one request the client sends it, and its idle CPU rate."""

    def __init__(self, name: str, pid: int, request: Callable[[], None]) -> None:
        self.name, self.pid, self.request = name, pid, request
        for _ in range(200):  # warm: connections made, code paths run once
            request()
        start, before = time.perf_counter(), cpu_s(pid)
        time.sleep(2.0)
        self.idle_rate = (cpu_s(pid) - before) / (time.perf_counter() - start)

    def measure(self, gap_s: float, n: int) -> tuple[float, float, float]:
        """CPU seconds per request (idle rate taken out), the client's CPU seconds per
        request and its median wait."""
        waits = []
        start, before, mine = time.perf_counter(), cpu_s(self.pid), time.thread_time()
        for _ in range(n):
            if gap_s:
                time.sleep(gap_s)
            t = time.perf_counter()
            self.request()
            waits.append(time.perf_counter() - t)
        client = (time.thread_time() - mine) / n
        busy = cpu_s(self.pid) - before - self.idle_rate * (time.perf_counter() - start)
        return max(busy, 0.0) / n, client, statistics.median(waits)


def echo_server(kind: str, tmp: Path) -> tuple[subprocess.Popen[bytes], Server]:
    path = str(tmp / f"{kind}.sock")
    proc = subprocess.Popen([sys.executable, "-c", ECHO_SERVER, kind, path], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    proc.stdout.readline()
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(path)

    def echo() -> None:
        sock.sendall(b"x" * 32)
        got = 0
        while got < 32:
            got += len(sock.recv(64))

    return proc, Server(f"{kind} echo", proc.pid, echo)


def agent_servers(agent: AgentProcess, label: str = "agent") -> tuple[ShmClient, list[Server]]:
    client = ShmClient(agent.unix_socket, timeout=30)
    geo = client.geometry()
    kv = [torch.randn(geo.kv_shape(p.index, BLOCKS)).to(torch.bfloat16) for p in geo.pools]
    ns = KeyNamespace("wake-cost", 0, 0)
    looked = [hashlib.sha256(b"lookup/%d" % j).digest() for j in range(BLOCKS)]
    count = [0]

    def put() -> None:
        count[0] += 1
        chain = [hashlib.sha256(b"put/%d/%d" % (count[0], j)).digest() for j in range(BLOCKS)]
        client.put(ns, chain, kv)

    pid = agent.proc.pid
    return client, [
        Server(f"{label} PING", pid, client.ping),
        Server(f"{label} LOOKUP {BLOCKS}", pid, lambda: client.lookup(ns, looked)),
        Server(f"{label} PUT {BLOCKS} blocks", pid, put),
    ]


def agent_of(tmp: Path, tree: Path | None) -> AgentProcess:
    """A real agent; with ``tree``, that checkout's packages first on its ``PYTHONPATH``."""
    packages = [] if tree is None else [str(tree / d) for d in ("agent", "cli")]
    paths = {"PYTHONPATH": os.pathsep.join(packages)} if packages else {}
    with mock.patch.dict(os.environ, paths):  # the agent's process inherits it
        return AgentProcess(tmp, MODEL, 8192 * BLOCK_BYTES, None, tokens_per_block=TPB)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gaps", type=float, nargs="+", default=[0.0, 1.0, 5.0, 15.0])
    parser.add_argument("--requests", type=int, default=300, help="per cell and round")
    parser.add_argument(
        "--before",
        type=Path,
        help="a checkout of another version (a git worktree): its agent too, in the same "
        "rounds, its rows named 'before'",
    )
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/wake_cost.json")
    args = parser.parse_args()
    console = Console(width=max(Console().width, 110))
    procs: list[subprocess.Popen[bytes]] = []
    cpu: dict[tuple[str, float], list[float]] = {}
    client_cpu: dict[tuple[str, float], list[float]] = {}
    wait: dict[tuple[str, float], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp_name, Progress(console=console) as bar:
        tmp = Path(tmp_name)
        agents = [agent_of(tmp, None)]
        if args.before is not None:
            agents.append(agent_of(tmp, args.before))
        clients: list[ShmClient] = []
        try:
            servers = []
            for kind in ECHOES:
                proc, server = echo_server(kind, tmp)
                procs.append(proc)
                servers.append(server)
            for agent, label in zip(agents, ("agent", "before"), strict=False):
                client, theirs = agent_servers(agent, label)
                clients.append(client)
                servers += theirs
            cells = bar.add_task("rounds x gaps x servers", total=args.rounds * len(args.gaps))
            for r in range(args.rounds):
                for gap in args.gaps:
                    order = servers if r % 2 == 0 else servers[::-1]
                    for server in order:
                        c, mine, w = server.measure(gap / 1e3, args.requests)
                        cpu.setdefault((server.name, gap), []).append(c)
                        client_cpu.setdefault((server.name, gap), []).append(mine)
                        wait.setdefault((server.name, gap), []).append(w)
                    bar.advance(cells)
        finally:
            for client in clients:
                client.close()
            for agent in agents:
                agent.stop()
            for proc in procs:
                proc.kill()
                proc.wait()
    names = list(dict.fromkeys(name for name, _ in cpu))
    rows: list[dict[str, Any]] = []
    for name in names:
        for gap in args.gaps:
            rows.append(
                {
                    "server": name,
                    "gap_ms": gap,
                    "cpu_us": 1e6 * statistics.median(cpu[(name, gap)]),
                    "cpu_us_rounds": [1e6 * x for x in cpu[(name, gap)]],
                    "client_cpu_us": 1e6 * statistics.median(client_cpu[(name, gap)]),
                    "client_wait_us": 1e6 * statistics.median(wait[(name, gap)]),
                }
            )
    show(console, rows, args.gaps)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "command": "python bench/wake_cost.py " + " ".join(sys.argv[1:]),
        "cpus": os.cpu_count(),
        "rounds": args.rounds,
        "requests_per_cell": args.requests,
        "before": None if args.before is None else _commit(args.before),
    }
    args.out.write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    grouped_bars(
        args.out.with_suffix(".png"),
        [f"{g:g} ms apart" for g in args.gaps],
        {n: [r["cpu_us"] for r in rows if r["server"] == n] for n in names},
        "server CPU per request (µs)",
        "What a request costs a server's CPU, by the idle time before it",
        log=True,
    )
    console.print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


def _commit(tree: Path) -> str:
    """The commit a checkout is at (what a 'before' row ran)."""
    out = subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return out.stdout.strip() or str(tree)


def show(console: Console, rows: list[dict[str, Any]], gaps: list[float]) -> None:
    table = Table(title="Server CPU per request, µs (client's CPU / wait in brackets)")
    table.add_column("server")
    for gap in gaps:
        table.add_column(f"{gap:g} ms apart", justify="right")
    table.add_column(f"{gaps[-1]:g} ms / {gaps[0]:g} ms", justify="right")
    for name in dict.fromkeys(r["server"] for r in rows):
        mine = [r for r in rows if r["server"] == name]
        cells = [
            f"{r['cpu_us']:.0f} ({r['client_cpu_us']:.0f} / {r['client_wait_us']:.0f})"
            for r in mine
        ]
        first = mine[0]["cpu_us"]
        cells.append(f"{mine[-1]['cpu_us'] / first:.1f}x" if first else "-")
        table.add_row(name, *cells)
    console.print(table)


if __name__ == "__main__":
    main()

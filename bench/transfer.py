"""Throughput of the transfer protocol (PUT and GET of KV blocks) and lookup latency.

A real ``kvpool agent`` process (CPU pools, uvloop, as in a pod) serves the transfer port on
loopback; the client is ``kvpool_agent.dataplane.client.TransferClient`` with 1 and 4 client
threads (one connection each). Baselines measured in the same run, moving the same bytes:

- raw TCP: a minimal server process (one thread per connection, ``recv_into``/``sendall``
  of a preallocated buffer, a 1-byte ack per PUT) with the same client threads;
- memcpy: one copy of the same bytes between two contiguous host buffers by one thread, and
  the same with as many threads as clients, each its own pair (the baseline of the
  shared-memory rows). The copy is ``kvpool_native.copy_spans`` of one piece (a plain
  memcpy loop with streaming stores, run without the GIL), which on the development machine
  is as fast as glibc's ``memcpy`` on one thread and faster on several (without the compiled
  core: ``ctypes.memmove``, glibc's). Not ``torch``'s ``copy_``: that one splits a copy over
  torch's intra-op threads (all cores), which is not one thread, and whose barrier makes it
  swing by a factor of five on a loaded machine.

Shared memory (the same-node path, ``transfer.unix_socket``): the same agent also listens on
a Unix socket; ``kvpool_agent.dataplane.shm.ShmClient`` (one per client thread) maps the
agent's arena and moves the same bytes by copying (PUT: reserve, copy in, commit; GET:
GET_SHM names the leased blocks, copy out). Its rows give GB/s and the ratio to a memcpy of
the same bytes by as many threads, measured in the same rounds (best against best, and the
median of the per-round ratios). PUT rows also give ``ShmClient.put_many``: four chains a
call, the next chain reserved while this one is copied and the last one committed meanwhile
(the agent's per-block work overlapped with the client's copy, as a stream of PUTs can be).

Block payloads: 2 MiB (32 layers x 8 kv heads x 128 dim x 16 tokens x bf16, K and V) and
128 KiB (16 layers x 1 kv head x 128 dim x 16 tokens x bf16: a tensor-parallel slice).
Each request moves ``--blocks`` 2 MiB blocks' worth of bytes (the same bytes for both
payloads); every PUT stores a new chain (so the cache fills and evicts, as it does in
service, with the default eviction policy); GETs read a leased chain. The protocol and its
raw-TCP baseline run in alternating rounds (``--rounds``); the table gives each one's best
round and the median of the per-round ratios (a round's two runs are back to back, so they
see about the same load from the rest of a shared machine). Then LOOKUP of a 64-key
resident chain: p50/p99 latency over ``--lookups`` calls per round (each round reported,
and all rounds pooled).

    python bench/transfer.py [--seconds 3] [--rounds 3] [--blocks 16] [--lookups 2000]

Prints a table and writes ``bench/results/transfer.json`` and ``bench/results/transfer.png``
(``transfer_<policy>.*`` with ``--eviction-policy``: small-block PUTs are bound by the
engine's per-block bookkeeping, which the policy dominates).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
import yaml
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvpool_agent.dataplane.client import TransferClient
from kvpool_agent.dataplane.keys import KeyNamespace
from kvpool_agent.dataplane.shm import ShmClient

console = Console()
NS = KeyNamespace("bench")
GEOMETRIES: dict[str, dict[str, Any]] = {
    "2MiB": {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "dtype": "bfloat16"},
    "128KiB": {"num_layers": 16, "num_kv_heads": 1, "head_dim": 128, "dtype": "bfloat16"},
}
TPB = 16

RAW_SERVER = r"""
import socket, struct, sys, threading
buf = bytearray(int(sys.argv[1]))
view = memoryview(buf)
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", 0))
srv.listen(64)
print(srv.getsockname()[1], flush=True)

def recv_exact(conn, mv):
    got = 0
    while got < len(mv):
        n = conn.recv_into(mv[got:])
        if n == 0:
            raise ConnectionError
        got += n

def serve(conn):
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    head = memoryview(bytearray(9))
    try:
        while True:
            recv_exact(conn, head)
            op, n = struct.unpack("<cQ", head)
            if op == b"P":
                recv_exact(conn, view[:n])
                conn.sendall(b"k")
            else:
                conn.sendall(view[:n])
    except (ConnectionError, OSError):
        conn.close()

while True:
    c, _ = srv.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"""


@dataclass
class Row:
    payload: str
    op: str
    clients: int
    protocol_gbps: float
    raw_tcp_gbps: float
    memcpy_gbps: float
    protocol_rounds: list[float]
    raw_tcp_rounds: list[float]
    shm_gbps: float
    """Same-node path (shared memory), best round."""
    shm_rounds: list[float]
    memcpy_par_gbps: float
    """memcpy of the same bytes with one thread per client (the shm rows' baseline)."""
    memcpy_par_rounds: list[float]
    shm_many_gbps: float | None = None
    """PUT rows: the same-node path with ``ShmClient.put_many`` (``STREAM`` chains a call, the
    agent's work overlapped with the copies), best round."""
    shm_many_rounds: list[float] | None = None

    @property
    def ratio(self) -> float:
        """Best round against best round."""
        return self.protocol_gbps / self.raw_tcp_gbps

    @property
    def paired_ratio(self) -> float:
        """Median over rounds of protocol / raw TCP of the same round (run back to back, so
        they saw about the same load from the machine's other work)."""
        pairs = zip(self.protocol_rounds, self.raw_tcp_rounds, strict=True)
        return statistics.median(p / r for p, r in pairs)

    @property
    def shm_ratio(self) -> float:
        """Shared memory against memcpy of the same bytes by as many threads (best rounds)."""
        return self.shm_gbps / self.memcpy_par_gbps

    @property
    def shm_paired_ratio(self) -> float:
        """Median over rounds of shared memory / memcpy of the same round (back to back)."""
        pairs = zip(self.shm_rounds, self.memcpy_par_rounds, strict=True)
        return statistics.median(s / m for s, m in pairs)

    @property
    def shm_many_paired_ratio(self) -> float | None:
        """The same for ``put_many`` (PUT rows only)."""
        if self.shm_many_rounds is None:
            return None
        pairs = zip(self.shm_many_rounds, self.memcpy_par_rounds, strict=True)
        return statistics.median(s / m for s, m in pairs)


def request_blocks(model: dict[str, Any], blocks_2mib: int) -> tuple[int, int]:
    """A block's bytes in ``model``'s geometry (bf16, ``TPB`` tokens), and how many of them
    carry the bytes of ``blocks_2mib`` 2 MiB blocks: every geometry moves the same bytes per
    request."""
    block = 2 * model["num_layers"] * model["num_kv_heads"] * model["head_dim"] * TPB * 2
    return block, blocks_2mib * ((2 << 20) // block)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class AgentProcess:
    """A ``kvpool agent`` with ``budget`` bytes of primary tier: CPU memory, or, with
    ``device="cuda"``, the GPU's (sized by ``max_tokens``)."""

    def __init__(
        self,
        tmp: Path,
        model: dict[str, Any],
        budget: int,
        policy: str | None,
        device: str = "cpu",
        tokens_per_block: int = TPB,
    ) -> None:
        self.port, self.transfer = free_port(), free_port()
        cache: dict[str, Any] = {
            "tokens_per_block": tokens_per_block,
            "enable_partial_reuse": False,
        }
        if policy is not None:
            cache["eviction_policy"] = policy
        sizing: dict[str, Any] = {"cpu_budget_bytes": budget}
        if device == "cuda":
            assert model["dtype"] == "bfloat16"  # every geometry here
            heads, dim = model["num_kv_heads"], model["head_dim"]
            block_bytes = 2 * model["num_layers"] * heads * dim * tokens_per_block * 2
            cache["max_tokens"] = budget // block_bytes * tokens_per_block
            sizing = {}
        doc = {
            "model": model,
            "kv_cache_config": cache,
            "device": device,
            **sizing,
            "events": {"endpoint": None, "replay_endpoint": None},
            "transfer": {
                "port": self.transfer,
                "max_lease_ttl_s": 3600,
                "unix_socket": str(tmp / f"agent-{self.transfer}.sock"),
            },
        }
        config = tmp / f"agent-{self.transfer}.yaml"
        config.write_text(yaml.safe_dump(doc))
        self.log = tmp / f"agent-{self.transfer}.log"
        cmd = [sys.executable, "-m", "kvpool_cli", "agent", "--config", str(config)]
        cmd += ["--port", str(self.port), "--log-level", "warning"]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(self.log.read_text())
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("agent not ready: " + self.log.read_text())
            time.sleep(0.1)
        self.address = f"127.0.0.1:{self.transfer}"
        self.unix_socket = str(tmp / f"agent-{self.transfer}.sock")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


class RawServer:
    def __init__(self, nbytes: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", RAW_SERVER, str(nbytes)], stdout=subprocess.PIPE
        )
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def keys(tag: str, n: int) -> list[bytes]:
    return [f"{tag}/{i}".encode() for i in range(n)]


def run_threads(clients: int, seconds: float, work: Any) -> float:
    """Run ``work(i, stop)`` in ``clients`` threads for ``seconds``; returns bytes per second."""
    moved = [0] * clients
    stop = threading.Event()
    errors: list[BaseException] = []

    def body(i: int) -> None:
        try:
            while not stop.is_set():
                moved[i] += work(i)
        except BaseException as err:
            errors.append(err)
            stop.set()

    threads = [threading.Thread(target=body, args=(i,)) for i in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    if errors:
        raise errors[0]
    return sum(moved) / elapsed


def bench_protocol(
    address: str, op: str, clients: int, blocks: int, seconds: float, run: int
) -> float:
    client = TransferClient([address], max_idle_connections=clients + 1, timeout=120)
    geo = client.geometry()
    kv = [torch.randn(geo.kv_shape(p.index, blocks)).to(torch.bfloat16) for p in geo.pools]
    nbytes = blocks * geo.block_bytes
    counter = [0] * clients
    if op == "put":

        def work(i: int) -> int:
            counter[i] += 1
            client.put(NS, keys(f"put/{run}/{clients}/{i}/{counter[i]}", blocks), kv)
            return nbytes

    else:
        leases = []
        for i in range(clients):
            chain = keys(f"get/{run}/{clients}/{i}", blocks)
            client.put(NS, chain, kv)
            lease = client.lease(NS, chain, ttl_s=3600)
            assert lease is not None and lease.count == blocks
            leases.append(lease)
        outs = [client.empty_kv(blocks) for _ in range(clients)]

        def work(i: int) -> int:
            client.get_into(leases[i], outs[i])
            return nbytes

    try:
        return run_threads(clients, seconds, work)
    finally:
        if op == "get":
            for lease in leases:
                client.release(lease)
        client.close()


STREAM = 4
"""Chains per ``put_many`` call in the ``put_many`` rounds."""


def bench_shm(path: str, op: str, clients: int, blocks: int, seconds: float, run: int) -> float:
    """The same work as ``bench_protocol`` over the same-node path (a client per thread);
    ``put_many``: PUTs of ``STREAM`` chains a call, pipelined."""
    shms = [ShmClient(path, timeout=120) for _ in range(clients)]
    geo = shms[0].geometry()
    kv = [torch.randn(geo.kv_shape(p.index, blocks)).to(torch.bfloat16) for p in geo.pools]
    nbytes = blocks * geo.block_bytes
    counter = [0] * clients
    leases = []
    if op == "put":

        def work(i: int) -> int:
            counter[i] += 1
            shms[i].put(NS, keys(f"shm-put/{run}/{clients}/{i}/{counter[i]}", blocks), kv)
            return nbytes

    elif op == "put_many":

        def work(i: int) -> int:
            chains = []
            for _ in range(STREAM):
                counter[i] += 1
                chains.append((keys(f"shm-many/{run}/{clients}/{i}/{counter[i]}", blocks), kv))
            shms[i].put_many(NS, chains)
            return STREAM * nbytes

    else:
        for i in range(clients):
            chain = keys(f"shm-get/{run}/{clients}/{i}", blocks)
            shms[i].put(NS, chain, kv)
            lease = shms[i].lease(NS, chain, ttl_s=3600)
            assert lease is not None and lease.count == blocks
            leases.append(lease)
        outs = [shms[i].empty_kv(blocks) for i in range(clients)]

        def work(i: int) -> int:
            shms[i].get_into(leases[i], outs[i])
            return nbytes

    try:
        return run_threads(clients, seconds, work)
    finally:
        for i, lease in enumerate(leases):
            shms[i].release(lease)  # ends the reads too
        for c in shms:
            c.close()


def memcpy_fn() -> tuple[str, Any]:
    """What the memcpy baselines run, and ``copy(dst, src)`` of two equal contiguous uint8
    arrays on the calling thread alone, without the GIL (see the module docstring)."""
    try:
        from kvpool_native import copy_spans
    except ImportError:
        import ctypes

        def copy(dst: np.ndarray, src: np.ndarray) -> None:
            ctypes.memmove(dst.ctypes.data, src.ctypes.data, len(src))

        return "ctypes.memmove (glibc memcpy), one thread per copy", copy
    zero = np.zeros(1, dtype=np.int64)

    def copy_one(dst: np.ndarray, src: np.ndarray) -> None:
        copy_spans(dst, zero, src, zero, len(src), 1)

    return "kvpool_native.copy_spans of one piece (streaming stores), one thread per copy", copy_one


def bench_memcpy_threads(nbytes: int, clients: int, seconds: float) -> float:
    """memcpy of ``nbytes`` per copy, one thread and one pair of buffers per client."""
    copy = memcpy_fn()[1]
    rng = np.random.default_rng(0)
    pairs = [(rng.integers(0, 255, nbytes, dtype=np.uint8), np.empty(nbytes, np.uint8))]
    pairs += [(pairs[0][0].copy(), np.empty(nbytes, np.uint8)) for _ in range(clients - 1)]
    for src, dst in pairs:  # first touch of the pages outside the timing
        copy(dst, src)

    def work(i: int) -> int:
        src, dst = pairs[i]
        copy(dst, src)
        return nbytes

    return run_threads(clients, seconds, work)


def bench_raw(port: int, op: str, clients: int, nbytes: int, seconds: float) -> float:
    socks = []
    for _ in range(clients):
        s = socket.create_connection(("127.0.0.1", port))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        socks.append(s)
    bufs = [memoryview(bytearray(nbytes)) for _ in range(clients)]
    ack = bytearray(1)

    def recv_exact(s: socket.socket, mv: memoryview) -> None:
        got = 0
        while got < len(mv):
            n = s.recv_into(mv[got:])
            if n == 0:
                raise ConnectionError("raw server closed")
            got += n

    def work(i: int) -> int:
        s = socks[i]
        if op == "put":
            s.sendall(struct.pack("<cQ", b"P", nbytes))
            s.sendall(bufs[i])
            recv_exact(s, memoryview(ack))
        else:
            s.sendall(struct.pack("<cQ", b"G", nbytes))
            recv_exact(s, bufs[i])
        return nbytes

    try:
        return run_threads(clients, seconds, work)
    finally:
        for s in socks:
            s.close()


def bench_memcpy(nbytes: int, seconds: float) -> float:
    return bench_memcpy_threads(nbytes, 1, seconds)


def bench_lookup(address: str, n: int, lookups: int, rounds: int) -> dict[str, Any]:
    client = TransferClient([address])
    geo = client.geometry()
    chain = keys("lookup", n)
    for i in range(0, n, 16):  # store the chain 16 blocks at a time
        part = chain[: i + 16]
        kv = [torch.zeros(geo.kv_shape(p.index, 16), dtype=torch.bfloat16) for p in geo.pools]
        client.put(NS, part, kv, first=i)
    assert len(client.lookup(NS, chain)) == n
    pooled: list[float] = []
    per_round = []
    for _ in range(rounds):
        times = []
        for _ in range(lookups + 100):
            t = time.perf_counter()
            client.lookup(NS, chain)
            times.append(time.perf_counter() - t)
        times = sorted(times[100:])
        pooled.extend(times)
        per_round.append({"p50_ms": _pct(times, 0.5), "p99_ms": _pct(times, 0.99)})
        time.sleep(0.5)
    client.close()
    pooled.sort()
    return {
        "keys": n,
        "lookups": lookups * rounds,
        "p50_ms": _pct(pooled, 0.5),
        "p99_ms": _pct(pooled, 0.99),
        "rounds": per_round,
    }


def _pct(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per case")
    parser.add_argument("--blocks", type=int, default=16, help="blocks per request (2 MiB)")
    parser.add_argument("--lookups", type=int, default=2000)
    parser.add_argument(
        "--eviction-policy", default=None, help="the agent's (default: the config default)"
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    rows: list[Row] = []
    lookup: dict[str, Any] = {}
    plans = []
    for name, model in GEOMETRIES.items():
        block, blocks = request_blocks(model, args.blocks)
        plans.append((name, model, block, blocks))
    steps = len(plans) * 2 * (4 + 5) * args.rounds + 1
    with Progress(console=console, transient=True) as bar, tempfile.TemporaryDirectory() as tmp:
        task = bar.add_task("transfer", total=steps)
        for run, (name, model, block, blocks) in enumerate(plans):
            nbytes = block * blocks
            budget = max(512 << 20, 16 * nbytes)
            agent = AgentProcess(Path(tmp), model, budget, args.eviction_policy)
            raw = RawServer(nbytes)
            memcpy = max(bench_memcpy(nbytes, min(1.0, args.seconds)) for _ in range(3))
            try:
                for clients in (1, 4):
                    for op in ("put", "get"):
                        protos, tcps, shms, mems, many = [], [], [], [], []
                        for r in range(args.rounds):
                            bar.update(task, description=f"{name} {op} x{clients}: memcpy")
                            mems.append(bench_memcpy_threads(nbytes, clients, args.seconds) / 1e9)
                            bar.advance(task)
                            for kind, out in ((op, shms), ("put_many", many)):
                                if kind == "put_many" and op != "put":
                                    continue
                                bar.update(task, description=f"{name} {kind} x{clients}: shm")
                                shm = bench_shm(
                                    agent.unix_socket,
                                    kind,
                                    clients,
                                    blocks,
                                    args.seconds,
                                    run * 100 + r,
                                )
                                out.append(shm / 1e9)
                                bar.advance(task)
                            bar.update(task, description=f"{name} {op} x{clients}: protocol")
                            protos.append(
                                bench_protocol(
                                    agent.address,
                                    op,
                                    clients,
                                    blocks,
                                    args.seconds,
                                    run * 100 + r,
                                )
                                / 1e9
                            )
                            bar.advance(task)
                            bar.update(task, description=f"{name} {op} x{clients}: raw TCP")
                            tcps.append(
                                bench_raw(raw.port, op, clients, nbytes, args.seconds) / 1e9
                            )
                            bar.advance(task)
                        rows.append(
                            Row(
                                name,
                                op,
                                clients,
                                max(protos),
                                max(tcps),
                                memcpy / 1e9,
                                protos,
                                tcps,
                                max(shms),
                                shms,
                                max(mems),
                                mems,
                                max(many) if many else None,
                                many or None,
                            )
                        )
                if name == "2MiB":
                    bar.update(task, description="lookup of 64 keys")
                    lookup = bench_lookup(agent.address, 64, args.lookups, args.rounds)
                    bar.advance(task)
            finally:
                agent.stop()
                raw.stop()
    table = Table(
        title=f"transfer protocol vs raw TCP vs memcpy ({args.blocks * 2} MiB per request, "
        f"loopback, {os.cpu_count()} CPUs, best of {args.rounds} alternating rounds); "
        "shared memory vs memcpy by as many threads, alternated"
    )
    for col in ("payload", "op", "clients", "protocol GB/s", "raw TCP GB/s", "memcpy GB/s",
                "best / best", "paired median", "shm GB/s", "memcpy xN GB/s",
                "shm / memcpy", "shm paired", "put_many GB/s",
                "put_many paired"):  # fmt: skip
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r.payload,
            r.op,
            str(r.clients),
            f"{r.protocol_gbps:.2f}",
            f"{r.raw_tcp_gbps:.2f}",
            f"{r.memcpy_gbps:.2f}",
            f"{r.ratio:.2f}",
            f"{r.paired_ratio:.2f}",
            f"{r.shm_gbps:.2f}",
            f"{r.memcpy_par_gbps:.2f}",
            f"{r.shm_ratio:.2f}",
            f"{r.shm_paired_ratio:.2f}",
            "" if r.shm_many_gbps is None else f"{r.shm_many_gbps:.2f}",
            "" if r.shm_many_paired_ratio is None else f"{r.shm_many_paired_ratio:.2f}",
        )
    # Fourteen columns: wider than a terminal's default, and a log (no terminal) gets 80.
    Console(width=max(console.width, 180)).print(table)
    rounds = ", ".join(f"{r['p50_ms']:.3f}/{r['p99_ms']:.3f}" for r in lookup["rounds"])
    console.print(
        f"LOOKUP of {lookup['keys']} keys: p50 {lookup['p50_ms']:.3f} ms, "
        f"p99 {lookup['p99_ms']:.3f} ms ({lookup['lookups']} calls, one client; "
        f"p50/p99 per round: {rounds} ms)"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {
        "command": " ".join(["python", "bench/transfer.py", *sys.argv[1:]]),
        "cpus": os.cpu_count(),
        "loadavg_after": os.getloadavg(),
        "bytes_per_request": args.blocks * (2 << 20),
        "rounds": args.rounds,
        "eviction_policy": args.eviction_policy or "default (mixture)",
        "seconds_per_round": args.seconds,
        "chains_per_put_many": STREAM,
        "memcpy": memcpy_fn()[0],
        "rows": [
            {
                **asdict(r),
                "ratio": r.ratio,
                "paired_ratio": r.paired_ratio,
                "shm_ratio": r.shm_ratio,
                "shm_paired_ratio": r.shm_paired_ratio,
                "shm_many_paired_ratio": r.shm_many_paired_ratio,
            }
            for r in rows
        ],
        "lookup": lookup,
    }
    stem = "transfer" if args.eviction_policy is None else f"transfer_{args.eviction_policy}"
    (args.out / f"{stem}.json").write_text(json.dumps(doc, indent=2))
    _plot(rows, lookup, args.out / f"{stem}.png")


def _plot(rows: list[Row], lookup: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.5))
    labels = [f"{r.payload}\n{r.op} x{r.clients}" for r in rows]
    x = range(len(rows))
    series = (
        ("protocol", "protocol_gbps"),
        ("raw TCP", "raw_tcp_gbps"),
        ("memcpy", "memcpy_gbps"),
        ("shared memory", "shm_gbps"),
        ("shared memory, put_many", "shm_many_gbps"),
        ("memcpy (as many threads)", "memcpy_par_gbps"),
    )
    width = 0.14
    for k, (name, attr) in enumerate(series):
        heights = [getattr(r, attr) or 0.0 for r in rows]
        ax.bar([i + (k - 2.5) * width for i in x], heights, width, label=name)
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("GB/s")
    ax.set_title(
        "KV transfer over loopback "
        f"(LOOKUP of 64 keys: p50 {lookup.get('p50_ms', 0):.2f} ms, "
        f"p99 {lookup.get('p99_ms', 0):.2f} ms)"
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()

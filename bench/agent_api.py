"""Benchmark the agent's HTTP API: open + release cycles of 2k-token prompts on loopback.

Baseline, measured in the same run: the same cycles called in-process on a
``KVCacheManager`` of the same config. Prompts cycle over a set of distinct 2k-token
sequences, so after the first round every open reuses all but the last block (the common
case for a prefix cache) and the cache never fills.

    python bench/agent_api.py                  # 2000 cycles, one client
    python bench/agent_api.py --cycles 300 --clients 4

Prints a table and writes ``bench/results/agent_api.json``.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import yaml
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

console = Console()

CONFIG = {
    "model": {"num_layers": 8, "num_kv_heads": 4, "head_dim": 64, "dtype": "float16"},
    "kv_cache_config": {"tokens_per_block": 32},
    "device": "cpu",
    "cpu_budget_bytes": 128 << 20,
    "events": {"endpoint": "tcp://*:*", "replay_endpoint": None},
}


@dataclass
class Result:
    mode: str
    clients: int
    cycles: int
    cycles_per_s: float
    p50_ms: float
    p99_ms: float
    ratio_to_in_process: float


def prompts(n: int, length: int) -> list[list[int]]:
    return [[(p * 7919 + i) % 50_000 for i in range(length)] for p in range(n)]


def percentile(xs: list[float], q: float) -> float:
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def in_process(cycles: int, toks: list[list[int]], progress: Progress) -> list[float]:
    from kvpool_agent.cache import KVCacheManager
    from kvpool_agent.config import AgentConfig

    engine = KVCacheManager.from_agent_config(AgentConfig.model_validate(CONFIG))
    task = progress.add_task("in-process", total=cycles)
    lat = []
    for i in range(cycles):
        t0 = time.perf_counter()
        h = engine.open_sequence(toks[i % len(toks)])
        engine.release(h.seq_id)
        lat.append(time.perf_counter() - t0)
        engine.events.drain()
        progress.advance(task)
    return lat


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_agent(tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    path = tmp / "agent.yaml"
    path.write_text(yaml.safe_dump(CONFIG))
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "kvpool_agent.cli",
        "agent",
        "--config",
        str(path),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("agent did not become ready")


def loopback(
    url: str, cycles: int, clients: int, toks: list[list[int]], progress: Progress
) -> tuple[list[float], float]:
    task = progress.add_task(f"loopback x{clients}", total=cycles)
    lats: list[list[float]] = [[] for _ in range(clients)]

    def worker(k: int) -> None:
        with httpx.Client(base_url=url, timeout=30) as c:
            for i in range(k, cycles, clients):
                t0 = time.perf_counter()
                r = c.post("/v1/sequences", json={"tokens": toks[i % len(toks)]})
                r.raise_for_status()
                c.delete(f"/v1/sequences/{r.json()['seq_id']}").raise_for_status()
                lats[k].append(time.perf_counter() - t0)
                progress.advance(task)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return [x for xs in lats for x in xs], wall


def summarize(mode: str, clients: int, lat: list[float], wall: float, base: float) -> Result:
    rate = len(lat) / wall
    return Result(
        mode=mode,
        clients=clients,
        cycles=len(lat),
        cycles_per_s=round(rate, 1),
        p50_ms=round(statistics.median(lat) * 1e3, 3),
        p99_ms=round(percentile(lat, 0.99) * 1e3, 3),
        ratio_to_in_process=round(rate / base, 4) if base else 1.0,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=2000)
    ap.add_argument("--clients", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    toks = prompts(args.prompts, args.tokens)
    results = []
    with tempfile.TemporaryDirectory() as tmp, Progress(console=console) as progress:
        proc, url = start_agent(Path(tmp))
        try:
            in_lat = in_process(args.cycles, toks, progress)
            base_rate = len(in_lat) / sum(in_lat)
            results.append(summarize("in-process", 1, in_lat, sum(in_lat), base_rate))
            lat, wall = loopback(url, args.cycles, 1, toks, progress)
            results.append(summarize("HTTP loopback", 1, lat, wall, base_rate))
            if args.clients > 1:
                lat, wall = loopback(url, args.cycles, args.clients, toks, progress)
                results.append(summarize("HTTP loopback", args.clients, lat, wall, base_rate))
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    table = Table(title=f"open + release of {args.tokens}-token prompts")
    for col in ("mode", "clients", "cycles", "cycles/s", "p50 ms", "p99 ms", "ratio"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(
            r.mode,
            str(r.clients),
            str(r.cycles),
            f"{r.cycles_per_s:.0f}",
            f"{r.p50_ms:.2f}",
            f"{r.p99_ms:.2f}",
            f"{r.ratio_to_in_process:.3f}",
        )
    console.print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "agent_api.json").write_text(
        json.dumps(
            {
                "args": {k: str(v) for k, v in vars(args).items()},
                "results": [asdict(r) for r in results],
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()

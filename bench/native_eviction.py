"""The compiled eviction orders (``kvpool_native``) beside the Python ones: memory per block
of capacity and time per operation, on the same streams.

- ``memory``: each registry policy run as the miniature runs it (the policy observes each
  request, then a shadow cache over its ``EvictionQueue`` serves it), bytes per block of
  capacity once the workload is through: Python by ``tracemalloc`` (the shadow's nodes, the
  queue and the policy's state), compiled by ``memory_bytes`` (the same, every ``Vec`` and
  map at its capacity), and the compiled queue alone (the policy's state without the nodes
  that stand for the engine's tree).
- ``queued``: an ``EvictionQueue`` of each policy holding ``capacity`` evictable blocks (flat
  leaves), each key observed once first (so a mixture's shadows are full): bytes per queued
  block of the queue's state, Python by ``tracemalloc`` (blocks and nodes made before
  tracing starts), compiled by ``memory_bytes``.
- ``time``: the miniature runs untraced, nanoseconds per requested block; each expert's
  shadow cache alone; and raw queue operations (push and pop of blocks at fresh ticks, no
  requests observed), nanoseconds per operation.

Workloads: "distinct" (64-block requests that are all new, ten capacities' worth: every
history grows to its bound, the worst case for memory) and the committed GSP trace at 10%
of its unique blocks, keyed as the engine keys blocks.

    python bench/native_eviction.py [--capacity 20000] [--out bench/results]

Writes ``native_eviction.json``. Absolute times are this machine's; the ratios are what to
compare.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import kvpool_native
from rich.console import Console
from rich.table import Table

from kvpool_agent.cache.block import Block, TreeNode
from kvpool_agent.traces import load_trace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.native.twins import EXPERTS, Mini, chained_paths, eviction_queue, shadow  # noqa: E402

POLICIES = ("lru", "reuse-gap", "mixture", "mixture-v1", "guarded")
GSP = ROOT / "examples" / "traces" / "gsp_64g_bs16.jsonl"


def distinct(capacity: int) -> list[list[int]]:
    n = 64
    return [list(range(r * n + 1, (r + 1) * n + 1)) for r in range(10 * capacity // n)]


def python_mini(policy: str, capacity: int, paths: list[list[int]], traced: bool) -> float:
    """Bytes held (traced) or seconds taken (untraced) by the Python run."""
    gc.collect()
    if traced:
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
    start = time.perf_counter()
    mini = Mini(policy, capacity)
    for keys in paths:
        mini.step(keys)
    took = time.perf_counter() - start
    if not traced:
        return took
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del mini
    return held


def python_shadow(name: str, capacity: int, paths: list[list[int]]) -> float:
    cache = shadow(name, capacity)
    start = time.perf_counter()
    for keys in paths:
        cache.step(keys)
    return time.perf_counter() - start


def python_queue(policy: str, blocks: int, rounds: int) -> tuple[int, float]:
    """The Python twin of ``kvpool_native.bench_queue``."""
    queue = eviction_queue(policy, blocks)
    root = TreeNode(0, b"", None, 1)
    items = []
    for b in range(blocks):
        node = TreeNode(b + 1, b"", root, 1)
        root.children[node.key] = node
        block = Block(0, 0, b)
        block.node = node
        items.append(block)
    ops = tick = 0
    start = time.perf_counter()
    for _ in range(rounds):
        for block in items:
            tick += 1
            block.node.last_used = tick  # type: ignore[union-attr]
            queue.push(block, 0.0)
        while queue.pop(0.0) is not None:
            ops += 2
    return ops, time.perf_counter() - start


def queued(policy: str, capacity: int) -> tuple[float, float]:
    """Bytes per queued block of the queue's state: (compiled, Python)."""
    twin = kvpool_native.EvictionQueueTwin(policy, capacity)
    root = twin.add_node(0)
    items = [twin.add_item(twin.add_node(k, root, k)) for k in range(1, capacity + 1)]
    tree = TreeNode(0, b"", None, 1)
    blocks = []
    for k in range(1, capacity + 1):
        node = TreeNode(k, b"", tree, 1)
        node.last_used = k
        tree.children[k] = node
        block = Block(0, 0, k - 1)
        block.node = node
        blocks.append(block)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    queue = eviction_queue(policy, capacity)
    for block in blocks:
        queue.observe([block.node.key])  # type: ignore[union-attr]
        queue.push(block, 0.0)
    gc.collect()
    python = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    for k, item in enumerate(items, 1):
        twin.observe([k])
        twin.push(item, 0.0)
    assert len(twin) == len(queue) == capacity
    return twin.memory_bytes() / capacity, python / capacity


def measure(capacity: int) -> dict[str, Any]:
    gsp = load_trace(GSP)
    workloads = {
        "distinct": (capacity, distinct(capacity)),
        "gsp@10%": (gsp.capacity_blocks(0.1), chained_paths(gsp)),
    }
    rows: list[dict[str, Any]] = []
    for workload, (cap, paths) in workloads.items():
        blocks = sum(len(p) for p in paths)
        for policy in POLICIES:
            mini = kvpool_native.MiniTwin(policy, cap)
            for keys in paths:
                mini.step(keys)
            _, ns, _ = kvpool_native.bench_mini(policy, cap, paths)
            rows.append(
                {
                    "kind": "miniature",
                    "workload": workload,
                    "policy": policy,
                    "capacity": cap,
                    "native_bytes_per_block": mini.memory_bytes() / cap,
                    "native_queue_bytes_per_block": mini.queue_memory_bytes() / cap,
                    "python_bytes_per_block": python_mini(policy, cap, paths, True) / cap,
                    "native_ns_per_block": ns / blocks,
                    "python_ns_per_block": 1e9 * python_mini(policy, cap, paths, False) / blocks,
                }
            )
        for name in EXPERTS:
            _, ns = kvpool_native.bench_shadow(name, cap, paths)
            rows.append(
                {
                    "kind": "shadow",
                    "workload": workload,
                    "policy": name,
                    "capacity": cap,
                    "native_ns_per_block": ns / blocks,
                    "python_ns_per_block": 1e9 * python_shadow(name, cap, paths) / blocks,
                }
            )
    for policy in POLICIES:
        native, python = queued(policy, capacity)
        rows.append(
            {
                "kind": "queued",
                "workload": "flat",
                "policy": policy,
                "capacity": capacity,
                "native_queue_bytes_per_block": native,
                "python_bytes_per_block": python,
            }
        )
        ops, ns = kvpool_native.bench_queue(policy, capacity, 5)
        py_ops, seconds = python_queue(policy, capacity, 5)
        assert ops == py_ops
        rows.append(
            {
                "kind": "queue",
                "workload": "push+pop",
                "policy": policy,
                "capacity": capacity,
                "native_ns_per_op": ns / ops,
                "python_ns_per_op": 1e9 * seconds / ops,
            }
        )
    return {"capacity": capacity, "rows": rows}


def _fmt(r: dict[str, Any], key: str) -> str:
    return f"{r[key]:.0f}" if key in r else ""


def report(result: dict[str, Any]) -> None:
    table = Table(title="compiled vs Python eviction orders (per block of capacity, per op)")
    columns = ("kind", "workload", "policy", "B native", "B native queue", "B python")
    for col in (*columns, "ns native", "ns python", "speedup"):
        table.add_column(col)
    for r in result["rows"]:
        native = r.get("native_ns_per_block", r.get("native_ns_per_op"))
        python = r.get("python_ns_per_block", r.get("python_ns_per_op"))
        timed = native is not None and python is not None
        table.add_row(
            r["kind"],
            r["workload"],
            r["policy"],
            _fmt(r, "native_bytes_per_block"),
            _fmt(r, "native_queue_bytes_per_block"),
            _fmt(r, "python_bytes_per_block"),
            f"{native:.0f}" if timed else "",
            f"{python:.0f}" if timed else "",
            f"{python / native:.1f}x" if timed else "",
        )
    Console(width=140).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity", type=int, default=20_000)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--report-only", action="store_true", help="print the last results")
    args = parser.parse_args()
    out = args.out / "native_eviction.json"
    if args.report_only:
        report(json.loads(out.read_text()))
        return
    result = measure(args.capacity)
    args.out.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    report(result)


if __name__ == "__main__":
    main()

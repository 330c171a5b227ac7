"""Host memory of the cache engine's metadata per block of capacity, by eviction policy.

The mixture policy keeps three shadow caches (keys, tree links, each expert's history)
beside the real radix tree; this measures what they cost. For each policy a
``KVCacheManager`` with the replay geometry (1 layer, 1 head, head dim 1, so its KV tensors
are negligible, and torch's allocations are not traced anyway) serves a workload, and
``tracemalloc`` reports the Python memory the manager still holds afterwards; with the
compiled core (``--cores native``, rows ``native:<policy>``), tracemalloc does not see the
engine's own heap, so its ``memory_bytes()`` (the capacity of every table the engine
allocated, records, tokens and queues) is added. Baselines
measured in the same run: plain LRU, and the real vLLM ``KVCacheManager`` and SGLang
``RadixCache`` (``bench/baselines.py``) when this Python has them (run it with
``.venv-bench/bin/python`` after ``hack/bench-venv.sh``). Tensor storage is not traced for any
of them: the figures are the metadata, which is what grows with a host tier of millions of
blocks.

Workloads: "distinct" (64-block requests that are all new: every history grows to its
bound, the worst case; 16 tokens per block, and again with 512-token blocks named by engine
keys), "synthetic" (the Mooncake trace at 10% of its unique blocks, 512 tokens per block,
each block's tokens its own) and "synthetic, engine keys" (the same requests, each block
named by an engine key as the data plane names it: its tokens are the key's digest words,
then 0s, ``kvpool_agent.dataplane.keys.block_tokens``).

    python bench/policy_memory.py [--capacity 20000] [--cores native,python] [--policies ...]
        [--out bench/results]
"""

from __future__ import annotations

import argparse
import gc
import json
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import baselines  # bench/baselines.py, beside this script
import series  # bench/series.py
from plots import grouped_bars  # bench/plots.py
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvpool_agent.cache import KVCacheManager
from kvpool_agent.config import EVICTION_POLICIES, KvCacheConfig
from kvpool_agent.dataplane import keys
from kvpool_agent.replay.runner import REPLAY_MODEL, block_tokens
from kvpool_agent.traces import load_trace

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "synthetic_trace.jsonl"
BLOCKS_PER_REQUEST = 64  # of the distinct workload


@dataclass
class Row:
    workload: str
    policy: str
    capacity_blocks: int
    bytes_per_block: float
    ratio_to_lru: float = 0.0
    ratio_to_vllm: float | None = None


TokensOf = Callable[[int, int], Sequence[int]]
"""The tokens of block ``id`` at ``tokens_per_block``."""

Workload = tuple[str, int, int, list[list[int]], TokensOf]
"""Name, tokens per block, capacity in blocks, each request's block ids, and their tokens."""


def keyed_tokens(block_id: int, tpb: int) -> list[int]:
    """The synthetic tokens the data plane gives a block named by an engine key (here the
    block id's 8 bytes)."""
    return keys.block_tokens(block_id.to_bytes(8, "little"), tpb)


def distinct(capacity: int, keyed_tpb: int | None = None) -> Workload:
    """Ten capacities' worth of new blocks, 64 per request: 16 tokens each, or (keyed_tpb)
    blocks of that many tokens named by engine keys."""
    n = BLOCKS_PER_REQUEST
    requests = [list(range(r * n, (r + 1) * n)) for r in range(10 * capacity // n)]
    if keyed_tpb is None:
        return "distinct", 16, capacity, requests, block_tokens
    return f"distinct, {keyed_tpb}-token engine keys", keyed_tpb, capacity, requests, keyed_tokens


def synthetic(keyed: bool = False) -> Workload:
    """The Mooncake trace at 10% of its unique blocks: each block's own tokens, or (keyed)
    the tokens of an engine key."""
    trace = load_trace(TRACE)
    requests = [list(r.hash_ids) for r in trace.requests if r.hash_ids]
    capacity = trace.capacity_blocks(0.10)
    if not keyed:
        return "synthetic@10%", trace.block_size, capacity, requests, block_tokens
    # made per use, not kept: a table of them would be traced as the first engine's memory
    return "synthetic@10%, engine keys", trace.block_size, capacity, requests, keyed_tokens


def held_bytes(
    policy: str,
    tpb: int,
    capacity: int,
    requests: list[list[int]],
    core: str = "python",
    tokens_of: TokensOf = block_tokens,
) -> int:
    """Memory a manager under ``policy`` on ``core`` holds after serving ``requests``: the
    Python heap, and the compiled engine's heap for the native core."""
    gc.collect()
    tracemalloc.start()
    config = KvCacheConfig(tokens_per_block=tpb, event_buffer_max_size=0, eviction_policy=policy)
    manager = KVCacheManager.with_capacity(REPLAY_MODEL, config, num_blocks=capacity, core=core)
    for ids in requests:
        tokens = [t for h in ids for t in tokens_of(h, tpb)]
        handle = manager.open_sequence(tokens, recompute_last_token=False)
        manager.release(handle.seq_id)
    gc.collect()
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    native = manager.native_memory_bytes()
    del manager
    return held + (native or 0)


def held_bytes_baseline(
    name: str,
    tpb: int,
    capacity: int,
    requests: list[list[int]],
    tokens_of: TokensOf = block_tokens,
) -> int:
    """Python memory the real ``name`` manager holds after serving ``requests``."""
    prompts = [[t for h in ids for t in tokens_of(h, tpb)] for ids in requests]
    max_len = max(map(len, prompts)) + tpb
    gc.collect()
    tracemalloc.start()
    manager = baselines.make(name, tpb, capacity, max_len)
    for i, tokens in enumerate(prompts):
        manager.serve(i, tokens)
    gc.collect()
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del manager
    return held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity", type=int, default=20_000, help="blocks, distinct workload")
    parser.add_argument("--cores", default="native,python", help="native and/or python")
    parser.add_argument(
        "--policies",
        default=",".join(EVICTION_POLICIES),
        help="the config's, and the defaults before it "
        f"({', '.join(series.EXTRA_SERIES)}, bench/series.py)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    cores = [c for c in args.cores.split(",") if c]
    if not cores or any(c not in ("native", "python") for c in cores):
        parser.error("--cores: native and/or python")
    policies = series.policies(parser, args.policies, required=["lru"])  # lru: the reference
    engines = [(c, p) for c in cores for p in policies]
    rows: list[Row] = []
    cases = [
        distinct(args.capacity),
        distinct(args.capacity, keyed_tpb=512),
        synthetic(),
        synthetic(keyed=True),
    ]
    found = [name for name, why in baselines.available().items() if why is None]
    for name, why in baselines.available().items():
        if why is not None:
            Console(stderr=True).print(f"[yellow]baseline {name} left out: {why}[/]")
    # one small run of each first, so that lazy imports and caches a first use fills are not
    # counted against whichever workload comes first
    for core, policy in engines:
        held_bytes(policy, 16, 128, [list(range(64)), list(range(64, 128))], core)
    for baseline in found:
        held_bytes_baseline(baseline, 16, 128, [list(range(64)), list(range(64, 128))])
    with Progress() as progress:
        task = progress.add_task("policy memory", total=len(cases) * (len(engines) + len(found)))
        for name, tpb, capacity, requests, tokens_of in cases:
            for core, policy in engines:
                held = held_bytes(policy, tpb, capacity, requests, core, tokens_of)
                rows.append(Row(name, f"{core}:{policy}", capacity, held / capacity))
                progress.advance(task)
            for baseline in found:
                held = held_bytes_baseline(baseline, tpb, capacity, requests, tokens_of)
                rows.append(Row(name, baseline, capacity, held / capacity))
                progress.advance(task)
    lru = f"{cores[-1]}:lru"  # the Python core's plain LRU when it runs, the reference before
    base = {r.workload: r.bytes_per_block for r in rows if r.policy == lru}
    vllm = {r.workload: r.bytes_per_block for r in rows if r.policy == "vllm"}
    for r in rows:
        r.ratio_to_lru = r.bytes_per_block / base[r.workload]
        if r.workload in vllm:
            r.ratio_to_vllm = r.bytes_per_block / vllm[r.workload]
    table = Table(title="engine metadata per block of capacity (Python heap + compiled core's)")
    for col in ("workload", "capacity", "policy", "bytes / block", f"vs {lru}", "vs vllm"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r.workload,
            str(r.capacity_blocks),
            r.policy,
            f"{r.bytes_per_block:.0f}",
            f"{r.ratio_to_lru:.2f}x",
            "" if r.ratio_to_vllm is None else f"{r.ratio_to_vllm:.2f}x",
        )
    Console().print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "policy_memory.json").write_text(json.dumps([asdict(r) for r in rows], indent=2))
    _plot(rows, args.out / "policy_memory.png")


def _plot(rows: list[Row], path: Path) -> None:
    names = list(dict.fromkeys(r.workload for r in rows))
    series = {}
    for policy in dict.fromkeys(r.policy for r in rows):
        per = {r.workload: r.bytes_per_block for r in rows if r.policy == policy}
        series[policy] = [per[name] for name in names]
    grouped_bars(
        path,
        [name.replace(", ", ",\n") for name in names],
        series,
        "bytes per block of capacity",
        "cache metadata per block (Python heap + compiled core): kvpool, vLLM, SGLang",
        log=True,
    )


if __name__ == "__main__":
    main()

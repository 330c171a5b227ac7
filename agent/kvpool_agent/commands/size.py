"""``kvpool size CONFIG``: print the pool plan (blocks, tokens and bytes per pool and tier)."""

from __future__ import annotations

import argparse
import json

HELP = "Print the pool plan of an agent config: blocks, tokens and bytes per pool and tier."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="agent config file (YAML or JSON)")
    parser.add_argument(
        "--free-bytes",
        type=int,
        default=None,
        help="free device memory to size the primary tier from (default: the config's "
        "cpu_budget_bytes on CPU, the device's free memory on CUDA)",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from kvpool_agent.cache.sizing import plan_pools
    from kvpool_agent.config import load_agent_config

    cfg = load_agent_config(args.config)
    cache = cfg.kv_cache_config
    if args.free_bytes is not None:
        primary = int(
            cache.free_gpu_memory_fraction * max(0, args.free_bytes - cfg.reserved_device_bytes)
        )
    elif cfg.device == "cpu" or not _cuda():
        primary = cfg.cpu_budget_bytes
    else:
        import torch

        from kvpool_agent.cache.manager import primary_budget

        primary = primary_budget(torch.device("cuda"), cache, cfg.reserved_device_bytes)
    plan = plan_pools(cfg.model, cache, primary_bytes=primary, max_seq_len=cfg.max_seq_len)
    data = plan.to_dict()
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    table = Table(title=f"kvpool pool plan ({args.config})")
    for col in (
        "pool",
        "window",
        "kv heads",
        "layers",
        "bytes/block",
        "tier",
        "blocks",
        "tokens",
        "bytes",
    ):
        table.add_column(col, justify="right")
    for pool in data["pools"]:
        for tier in ("primary", "secondary"):
            t = pool[tier]
            table.add_row(
                str(pool["index"]),
                "full" if pool["window"] is None else str(pool["window"]),
                str(pool["kv_heads"]),
                _layers(pool["layers"]),
                f"{pool['bytes_per_block']:,}",
                tier,
                f"{t['blocks']:,}",
                f"{t['tokens']:,}",
                _human(t["bytes"]),
            )
    console = Console()
    console.print(table)
    console.print(
        f"tokens_per_block={plan.tokens_per_block} kv_dtype={plan.kv_dtype} "
        f"primary budget={_human(plan.primary.budget_bytes)} "
        f"secondary budget={_human(plan.secondary.budget_bytes)}"
    )
    return 0


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _layers(layers: list[int]) -> str:
    if len(layers) > 4:
        return f"{len(layers)} ({layers[0]},{layers[1]},..)"
    return ",".join(map(str, layers))


def _human(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    return f"{n} B"

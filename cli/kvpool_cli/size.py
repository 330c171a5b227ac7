"""``kvpool size CONFIG``: print the pool plan (blocks, tokens and bytes per pool and tier).

It reads either component's file: an agent config (the agent's models) or a KVCachePool
manifest (the operator's models), so it lives above both, in the CLI package."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

import yaml

if TYPE_CHECKING:
    from kvpool_agent.config import AgentConfig

HELP = "Print the pool plan of an agent config: blocks, tokens and bytes per pool and tier."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "config", help="agent config file (YAML or JSON), or a KVCachePool manifest"
    )
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

    from kvpool_agent.cache.sizing import place, plan_pools

    cfg = _agent_config(args.config)
    primary = place(cfg, args.free_bytes).primary_bytes
    plan = plan_pools(
        cfg.model, cfg.kv_cache_config, primary_bytes=primary, max_seq_len=cfg.max_seq_len
    )
    data = plan.to_dict()
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    # Fits 80 columns: one row per pool, the tiers side by side.
    table = Table(title=f"kvpool pool plan ({args.config})")
    for col in ("pool", "window", "heads", "layers", "block", "primary", "host"):
        table.add_column(col, justify="right", no_wrap=True)
    for pool in data["pools"]:
        tiers = [pool[t] for t in ("primary", "secondary")]
        table.add_row(
            str(pool["index"]),
            "full" if pool["window"] is None else str(pool["window"]),
            str(pool["kv_heads"]),
            str(len(pool["layers"])),
            _human(pool["bytes_per_block"]),
            *(f"{t['blocks']:,} ({_human(t['bytes'])})" for t in tiers),
        )
    console = Console()
    console.print(table)
    console.print(
        f"blocks of {plan.tokens_per_block} tokens, {plan.kv_dtype}; budgets: primary "
        f"{_human(plan.primary.budget_bytes)}, host {_human(plan.secondary.budget_bytes)}. "
        "--json for tokens and layer lists."
    )
    return 0


def _agent_config(path: str) -> AgentConfig:
    """The agent config in ``path``: an agent config file, or the one a KVCachePool
    manifest asks for (what the operator writes to the pool's ConfigMap)."""
    from pydantic import ValidationError

    from kvpool_agent.config import ConfigError, format_validation_error, load_agent_config

    try:
        with open(path) as f:
            doc = yaml.safe_load(f)
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        doc = None  # load_agent_config says what is wrong with the file
    if not isinstance(doc, dict) or doc.get("kind") != "KVCachePool":
        return load_agent_config(path)
    from kvpool_operator.models import KVCachePool  # pydantic only: no kopf, no torch

    try:
        return KVCachePool.model_validate(doc).spec.agent_config()
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, f"KVCachePool in {path}")) from None


def _human(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.3g} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    return f"{n} B"

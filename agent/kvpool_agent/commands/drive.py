"""``kvpool drive TRACE``: replay a trace over HTTP through running agents (a pool client).

Unlike ``kvpool replay`` (the engine in-process), this talks to deployed agents: given as
``--endpoints`` or found from a KVCachePool's pods (``--pool``), and routed by prefix affinity.
"""

from __future__ import annotations

import argparse
import json

HELP = (
    "Replay a prefix trace over HTTP through a pool's agents and report the hit rates "
    "(exit 1 when any request failed)."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", help="trace file (JSON Lines with hash_ids per request)")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--endpoints", help="comma-separated agent base URLs (or IPs: port 8000 is assumed)"
    )
    where.add_argument("--pool", help="a KVCachePool name: drive its Running, Ready pods")
    parser.add_argument("--namespace", "-n", default="default", help="namespace of --pool")
    parser.add_argument("--kubeconfig", default=None, help="kubeconfig (default: $KUBECONFIG)")
    parser.add_argument("--limit", type=int, help="replay only the first N requests")
    parser.add_argument("--rate", type=float, help="requests per second (default: unpaced)")
    parser.add_argument(
        "--block-size", type=int, help="tokens per trace block (default: inferred from the file)"
    )
    parser.add_argument(
        "--tokens-per-block",
        type=int,
        help="the agents' tokens_per_block for prefix affinity (default: the pool's, else 32)",
    )
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per HTTP call")
    parser.add_argument(
        "--token-file",
        help="file holding the tenant's bearer token (default: $KVPOOL_TOKEN; with --pool, "
        "the token in the pool's Secret of --tenant)",
    )
    parser.add_argument(
        "--tenant",
        default="default",
        help="with --pool: the tenant whose Secret <pool>-tenant-<tenant> holds the token",
    )
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")


def run(args: argparse.Namespace) -> int:
    import os
    from pathlib import Path

    import httpx
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kvpool_agent.client import PoolClient
    from kvpool_agent.config import ConfigError
    from kvpool_agent.drive import DriveResult, drive, endpoint_urls, pool_endpoints
    from kvpool_agent.traces import load_trace

    if args.limit is not None and args.limit <= 0:
        raise ConfigError(f"--limit must be positive, got {args.limit}")
    if args.rate is not None and args.rate <= 0:
        raise ConfigError(f"--rate must be positive, got {args.rate}")
    trace = load_trace(args.trace, block_size=args.block_size).head(args.limit)
    tokens_per_block = args.tokens_per_block or 32
    token = os.environ.get("KVPOOL_TOKEN") or None
    if args.token_file:
        try:
            token = Path(args.token_file).read_text().strip()
        except OSError as err:
            raise ConfigError(f"--token-file: cannot read {args.token_file}: {err}") from None
    if args.pool:
        found = pool_endpoints(
            args.pool, args.namespace, args.kubeconfig, tenant=None if token else args.tenant
        )
        urls, addresses = found.urls, found.addresses
        token = token or found.token
        tokens_per_block = args.tokens_per_block or found.tokens_per_block
        if not urls:
            raise ConfigError(f"--pool: no Running, Ready pod of {args.namespace}/{args.pool}")
    else:
        urls, addresses = endpoint_urls(args.endpoints.split(",")), {}
        if not urls:
            raise ConfigError("--endpoints: no URL given")

    console = Console(stderr=True)
    http = httpx.Client(timeout=args.timeout, trust_env=False)  # pod IPs: never via a proxy
    with (
        PoolClient(
            urls, tokens_per_block=tokens_per_block, client=http, token=token, addresses=addresses
        ) as client,
        Progress(
            TextColumn("[bold]drive[/] {task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("hit {task.fields[hit]:.1%}"),
            TimeElapsedColumn(),
            console=console,
            disable=args.json or not console.is_terminal,
        ) as progress,
    ):
        task = progress.add_task(trace.name, total=len(trace.requests), hit=0.0)

        def tick(result: DriveResult) -> None:
            progress.update(task, completed=result.requests, hit=result.block_hit_rate)

        result = drive(trace, client, rate=args.rate, on_request=tick)
    doc = {**result.as_dict(), "endpoints": urls, "addresses": addresses}
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        out = Console()
        out.print(
            f"{trace.name}: {result.requests} requests to {len(urls)} agents in "
            f"{result.seconds:.1f}s ({doc['requests_per_second']:.1f}/s), {result.failed} failed"
        )
        out.print(
            f"block hit rate {result.block_hit_rate:.2%} "
            f"({result.hit_blocks}/{result.query_blocks}), token hit rate "
            f"{result.token_hit_rate:.2%} ({result.hit_tokens}/{result.query_tokens})"
        )
        for url, count in sorted(result.per_replica.items()):
            out.print(f"  {url}: {count} requests")
    if result.errors:
        console.print(f"[yellow]first failure:[/] {result.errors[0]}")
    return 1 if result.failed else 0  # a failed request is a failed drive (scripts check it)

"""``kvpool trace synth OUT``: write a deterministic shared-prefix workload trace."""

from __future__ import annotations

import argparse

HELP = "Generate workload traces (JSON Lines with hash_ids), deterministic for a seed."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvpool_agent.replay.synth import SharedPrefixSpec

    sub = parser.add_subparsers(dest="trace_command", metavar="KIND", required=True)
    synth = sub.add_parser(
        "synth",
        help="shared system prompts per group (the generated-shared-prefix pattern)",
        description="Groups of requests sharing a system prompt, each with its own suffix, "
        "interleaved in a seeded order. The defaults give the trace the repository ships.",
    )
    synth.add_argument("out", help="file to write (JSON Lines)")
    d = SharedPrefixSpec()
    synth.add_argument("--groups", type=int, default=d.groups, help="system prompts")
    synth.add_argument(
        "--requests-per-group", type=int, default=d.requests_per_group, help="requests each"
    )
    synth.add_argument("--prefix-blocks", type=int, default=d.prefix_blocks, help="shared blocks")
    synth.add_argument("--suffix-blocks", type=int, default=d.suffix_blocks, help="own blocks")
    synth.add_argument("--block-size", type=int, default=d.block_size, help="tokens per block")
    synth.add_argument("--output-length", type=int, default=d.output_length, help="tokens out")
    synth.add_argument("--rate", type=float, default=d.rate, help="requests per second")
    synth.add_argument("--seed", type=int, default=d.seed)


def run(args: argparse.Namespace) -> int:
    from dataclasses import fields
    from pathlib import Path

    from kvpool_agent.config import ConfigError
    from kvpool_agent.replay.synth import SharedPrefixSpec, write_trace

    # every flag is a field of the spec, under the same name
    spec = SharedPrefixSpec(**{f.name: getattr(args, f.name) for f in fields(SharedPrefixSpec)})
    try:
        count = write_trace(spec, Path(args.out))
    except ValueError as err:
        raise ConfigError(str(err)) from None
    print(f"wrote {count} requests to {args.out}")
    return 0

"""``kvpool trace synth OUT``: write a deterministic shared-prefix workload trace.

``kvpool trace generate KIND OUT``: write one of the validation workloads of
``kvpool_agent.replay.workloads`` (agentic, tenants, rag, shift, phases, scan)."""

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
    _add_generate(sub)


def _add_generate(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from dataclasses import fields

    from kvpool_agent.replay.workloads import KINDS, WorkloadSpec

    gen = sub.add_parser(
        "generate",
        help="validation workloads: agentic, tenants, rag, shift, phases, scan",
        description="Workloads to validate eviction on (see kvpool_agent.replay.workloads for "
        "each kind and parameter). The defaults give the files in bench/traces.",
    )
    gen.add_argument("kind", choices=list(KINDS))
    gen.add_argument("out", help="file to write (JSON Lines)")
    spec = WorkloadSpec()
    for f in fields(WorkloadSpec):
        default = getattr(spec, f.name)
        gen.add_argument(
            "--" + f.name.replace("_", "-"), type=type(default), default=default, dest=f.name
        )


def run(args: argparse.Namespace) -> int:
    from dataclasses import fields
    from pathlib import Path

    from kvpool_agent.config import ConfigError
    from kvpool_agent.replay.synth import SharedPrefixSpec, write_trace
    from kvpool_agent.replay.workloads import WorkloadSpec, write_workload

    if args.trace_command == "generate":
        wspec = WorkloadSpec(**{f.name: getattr(args, f.name) for f in fields(WorkloadSpec)})
        try:
            count = write_workload(args.kind, wspec, Path(args.out))
        except ValueError as err:
            raise ConfigError(str(err)) from None
        print(f"wrote {count} requests to {args.out}")
        return 0

    # every flag is a field of the spec, under the same name
    spec = SharedPrefixSpec(**{f.name: getattr(args, f.name) for f in fields(SharedPrefixSpec)})
    try:
        count = write_trace(spec, Path(args.out))
    except ValueError as err:
        raise ConfigError(str(err)) from None
    print(f"wrote {count} requests to {args.out}")
    return 0

"""The ``kvpool`` command line.

Each subcommand lives in its own module that exposes ``HELP``, ``add_arguments(parser)`` and
``run(args) -> int``. Modules are imported only to build the parser, so they keep heavy
imports (torch, kopf) inside ``run``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

COMMANDS: dict[str, str] = {
    "dev-cluster": "kvpool_operator.commands.devcluster",
    "size": "kvpool_agent.commands.size",
    "replay": "kvpool_agent.commands.replay",
    "drive": "kvpool_agent.commands.drive",
    "plan": "kvpool_agent.commands.plan",
    "trace": "kvpool_agent.commands.trace",
    "agent": "kvpool_agent.commands.agent",
    "crd": "kvpool_operator.commands.crd",
    "operator": "kvpool_operator.commands.operator",
}
"""Subcommand name -> module implementing it."""


def build_parser() -> argparse.ArgumentParser:
    from kvpool_agent import __version__

    parser = argparse.ArgumentParser(
        prog="kvpool", description="Kubernetes-native paged KV cache for LLM serving."
    )
    parser.add_argument("--version", action="version", version=f"kvpool {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        cmd = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(cmd)
        cmd.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from kvpool_agent.config import ConfigError

    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except ConfigError as err:
        print(f"kvpool {args.command}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

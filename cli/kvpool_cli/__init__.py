"""The ``kvpool`` command line, above the components.

The agent and the operator each register their subcommands in their own ``commands``
package (``COMMANDS``: name -> module, and ``EXTRA``: the extra their ``run`` needs); this
package merges them, adds the commands that need both (``size``: an agent config or a
KVCachePool manifest), and dispatches. Dependencies point down only: the components never
import this package.

Each subcommand module exposes ``HELP``, ``add_arguments(parser)`` and ``run(args) -> int``.
Modules are imported only to build the parser, so they keep heavy imports (torch, kopf)
inside ``run``; a ``run`` that misses a third-party module says which extra to install.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass

COMPONENTS: tuple[str, ...] = ("kvpool_agent.commands", "kvpool_operator.commands")
"""The packages whose ``COMMANDS`` the CLI offers, in help order (after its own)."""

OWN_COMMANDS: dict[str, str] = {"size": "kvpool_cli.size"}
"""Commands of this package: they read what both components define."""

OWN_EXTRA = "agent"
"""``size`` runs the agent's sizing (base dependencies only today; the agent extra covers
whatever it imports)."""


@dataclass(frozen=True)
class Command:
    name: str
    module: str
    extra: str
    """The extra of ``kvpool`` that its ``run`` needs (named in the error when missing)."""


def commands() -> list[Command]:
    """Every subcommand: this package's, then each component's, in ``COMPONENTS`` order."""
    found = [Command(name, module, OWN_EXTRA) for name, module in OWN_COMMANDS.items()]
    for package_name in COMPONENTS:
        package = importlib.import_module(package_name)
        extra: str = package.EXTRA
        found.extend(Command(name, module, extra) for name, module in package.COMMANDS.items())
    names = [c.name for c in found]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise RuntimeError(f"kvpool subcommands registered twice: {', '.join(duplicates)}")
    return found


def build_parser() -> argparse.ArgumentParser:
    from kvpool_agent import __version__

    parser = argparse.ArgumentParser(
        prog="kvpool", description="Kubernetes-native paged KV cache for LLM serving."
    )
    parser.add_argument("--version", action="version", version=f"kvpool {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in commands():
        module = importlib.import_module(command.module)
        cmd = sub.add_parser(command.name, help=module.HELP, description=module.HELP)
        module.add_arguments(cmd)
        cmd.set_defaults(_run=module.run, _extra=command.extra)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from kvpool_agent.config import ConfigError

    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except ConfigError as err:
        print(f"kvpool {args.command}: {err}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as err:
        missing = (err.name or "").partition(".")[0]
        if not missing or missing.startswith("kvpool_"):
            raise  # a module of kvpool itself: a broken install, not a missing extra
        print(
            f"kvpool {args.command}: needs the '{args._extra}' extra (no module {missing!r}): "
            f"pip install 'kvpool[{args._extra}]'",
            file=sys.stderr,
        )
        return 2

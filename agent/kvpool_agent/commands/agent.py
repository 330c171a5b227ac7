"""``kvpool agent --config FILE``: run the node agent of one pool pod."""

from __future__ import annotations

import argparse

HELP = "Run the node agent: the paged KV cache behind an HTTP API, metrics and KV events."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", required=True, help="agent config file (the mounted ConfigMap); watched live"
    )
    parser.add_argument("--host", default=None, help="bind address (overrides server.host)")
    parser.add_argument("--port", type=int, default=None, help="HTTP port (overrides server.port)")
    parser.add_argument(
        "--transfer-port",
        type=int,
        default=None,
        help="transfer protocol port (overrides transfer.port; 0: any free port)",
    )
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from pydantic import ValidationError

    from kvpool_agent.config import ConfigError, format_validation_error, load_agent_config

    config = load_agent_config(args.config)  # a bad file fails fast, before torch is imported

    from kvpool_agent.server.reload import apply_overrides
    from kvpool_agent.server.runner import endpoint_overrides, serve

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    overrides = endpoint_overrides(args.host, args.port, args.transfer_port)
    try:
        config = apply_overrides(config, overrides)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, args.config)) from None
    try:
        import uvloop  # the faster event loop when installed (the agent extra has it)
    except ImportError:
        return asyncio.run(serve(config, args.config, overrides))
    return uvloop.run(serve(config, args.config, overrides))

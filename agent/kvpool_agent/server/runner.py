"""Run one agent under uvicorn: service, app, config watcher, warm start and SIGTERM drain.

uvicorn's own signal handling is replaced: on SIGTERM/SIGINT the agent drains (see
``lifecycle.drain``) and only then asks uvicorn to exit, so in-flight sequences can finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Generator
from pathlib import Path

import uvicorn

from kvpool_agent.cache.gc_tuning import tune_gc
from kvpool_agent.config import AgentConfig
from kvpool_agent.dataplane.server import TransferServer
from kvpool_agent.server.app import create_app
from kvpool_agent.server.lifecycle import drain, warm_start
from kvpool_agent.server.limits import header_timeout_protocol
from kvpool_agent.server.reload import ConfigWatcher
from kvpool_agent.server.service import AgentService

log = logging.getLogger("kvpool.agent")


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield  # the agent installs its own handlers (drain first, then exit)


def endpoint_overrides(
    host: str | None, port: int | None, transfer_port: int | None = None
) -> dict[str, object]:
    """Dotted-path overrides from ``--host/--port/--transfer-port`` (a ``*`` event host and
    the transfer port follow the server host, so they follow ``--host`` too)."""
    out: dict[str, object] = {}
    if host is not None:
        out["server.host"] = host
    if port is not None:
        out["server.port"] = port
    if transfer_port is not None:
        out["transfer.port"] = transfer_port
    return out


async def serve(
    config: AgentConfig, config_path: str | Path | None, overrides: dict[str, object]
) -> int:
    service = AgentService(config)
    tune_gc()  # a large tree makes CPython's default full collections cost more than requests
    watcher = (
        ConfigWatcher(service, config_path, overrides=overrides)
        if config_path is not None
        else None
    )
    server: _Server | None = None
    drain_task: asyncio.Task[str] | None = None
    transfer: TransferServer | None = None

    def stop() -> None:
        assert server is not None
        server.should_exit = True

    def on_signal() -> None:
        nonlocal drain_task
        if drain_task is None:
            drain_task = asyncio.get_running_loop().create_task(drain(service, stop))
        else:  # a second signal: stop now
            stop()

    async def on_startup() -> None:
        nonlocal transfer
        await warm_start(service)
        service.flush_events()
        if config.transfer.port is not None or config.transfer.unix_socket is not None:
            transfer = TransferServer(service)
            await transfer.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)
        if watcher is not None:
            watcher.start()

    async def on_shutdown() -> None:
        if transfer is not None:
            await transfer.stop()
        if watcher is not None:
            await watcher.stop()

    app = create_app(service, on_startup=on_startup, on_shutdown=on_shutdown)
    limits = config.limits
    uv_config = uvicorn.Config(
        app,
        host=config.server.host,
        port=config.server.port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=2,
        lifespan="on",
        http=header_timeout_protocol(limits.header_timeout_s),
        timeout_keep_alive=limits.idle_timeout_s,
        limit_concurrency=limits.max_connections,
    )
    server = _Server(uv_config)
    await server.serve()
    if drain_task is not None and not drain_task.done():
        drain_task.cancel()
    return 0

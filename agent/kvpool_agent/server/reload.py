"""Live reload: poll the config file and apply what may change without a restart.

A mounted ConfigMap is updated by swapping a symlink, so the watcher compares the
(device, inode, mtime, size) of the resolved file every ``interval`` seconds rather than
relying on inotify events on the path. A change is parsed and validated first; an invalid
file is logged and counted and the running config stays. See ``AgentService.apply_config``
for what happens to a valid one. Any other failure of a check is logged and counted
(``reloads.errors``) and the watcher goes on polling, so a later valid edit still applies.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path

from kvpool_agent.config import AgentConfig, ConfigError, load_agent_config
from kvpool_agent.server.service import AgentService

log = logging.getLogger("kvpool.agent.reload")

Fingerprint = tuple[int, int, int, int] | None


def fingerprint(path: Path) -> Fingerprint:
    try:
        st = os.stat(path)  # follows the symlink the kubelet swaps
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


class ConfigWatcher:
    """Polls one file and hands every valid change to the service."""

    def __init__(
        self,
        service: AgentService,
        path: str | Path,
        *,
        interval: float = 1.0,
        overrides: dict[str, object] | None = None,
    ) -> None:
        self.service = service
        self.path = Path(path)
        self.interval = interval
        self.overrides = overrides or {}
        """Command-line settings (server host/port) that win over the file."""
        self._seen = fingerprint(self.path)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.check()
            except Exception:  # keep watching: a later edit may be fine
                self.service.reloads.errors += 1
                log.exception("config reload check of %s failed, still watching", self.path)

    async def check(self) -> bool:
        """Reload if the file changed since the last look; returns whether it had."""
        now = fingerprint(self.path)
        if now == self._seen or now is None:
            return False
        self._seen = now
        try:
            new = self.load()
        except ConfigError as err:
            self.service.reloads.invalid += 1
            log.error("config reload rejected, keeping the running config: %s", err)
            return True
        with contextlib.suppress(ConfigError):  # logged and counted by the service
            await self.service.apply_config(new)
        return True

    def load(self) -> AgentConfig:
        config = load_agent_config(self.path)
        return apply_overrides(config, self.overrides)


def apply_overrides(config: AgentConfig, overrides: dict[str, object]) -> AgentConfig:
    """The config with dotted-path overrides (``server.port``) applied."""
    data = config.model_dump()
    for path, value in overrides.items():
        node = data
        *parents, leaf = path.split(".")
        for step in parents:
            node = node[step]
        node[leaf] = value
    return AgentConfig.model_validate(data)

"""Live reload: live fields apply at once; a restart-only change is counted, never half-applied."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import yaml

from kvpool_agent.config import AgentConfig, ConfigError, load_agent_config
from kvpool_agent.server import AgentService
from kvpool_agent.server.reload import ConfigWatcher

from .conftest import small_config

pytestmark = pytest.mark.asyncio


def write(path: Path, config: AgentConfig) -> None:
    """Write like the kubelet: a new file swapped in with a rename."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    os.replace(tmp, path)


def edited(config: AgentConfig, **changes: dict[str, object]) -> AgentConfig:
    doc = config.model_dump()
    for section, values in changes.items():
        doc[section].update(values)
    return AgentConfig.model_validate(doc)


async def test_live_fields_apply_without_restart(
    tmp_path: Path, client: httpx.AsyncClient, service: AgentService
) -> None:
    path = tmp_path / "agent.yaml"
    write(path, service.config)
    watcher = ConfigWatcher(service, path)
    assert not await watcher.check()
    new = edited(
        service.config,
        kv_cache_config={"enable_block_reuse": False, "secondary_offload_min_priority": 60},
        retention={"priority": 80},
        lifecycle={"grace_period_s": 7.0},
    )
    write(path, new)
    assert await watcher.check()
    assert service.engine.config.enable_block_reuse is False
    assert service.engine.config.secondary_offload_min_priority == 60
    assert service.config.lifecycle.grace_period_s == 7.0
    assert service.reloads.applied == 1 and not service.reloads.pending_restart
    toks = list(range(9))
    for _ in range(2):  # reuse is off: nothing is stored or found
        seq = (await client.post("/v1/sequences", json={"tokens": toks})).json()
        assert seq["num_reused_tokens"] == 0
        await client.delete(f"/v1/sequences/{seq['seq_id']}")

    write(path, edited(service.config, kv_cache_config={"enable_block_reuse": True}))
    assert await watcher.check()
    seq = (await client.post("/v1/sequences", json={"tokens": toks})).json()
    await client.delete(f"/v1/sequences/{seq['seq_id']}")
    assert {n.priority for n in service.engine.iter_nodes()} == {80}  # the new default


async def test_restart_fields_are_counted_and_nothing_is_applied(
    tmp_path: Path, service: AgentService, client: httpx.AsyncClient
) -> None:
    path = tmp_path / "agent.yaml"
    write(path, service.config)
    watcher = ConfigWatcher(service, path)
    before = service.config
    mixed = edited(
        service.config,
        kv_cache_config={"tokens_per_block": 8, "enable_block_reuse": False},
    )
    write(path, mixed)
    assert await watcher.check()
    assert service.config == before
    assert service.engine.config.enable_block_reuse is True  # not half-applied
    assert service.reloads.restart_required == 1
    assert service.reloads.pending_restart == ["kv_cache_config.tokens_per_block"]
    metrics = (await client.get("/metrics")).text
    assert 'kvpool_config_reloads_total{result="restart_required"} 1.0' in metrics
    assert "kvpool_config_restart_pending 1.0" in metrics

    path.write_text("model: {num_layers: -1}\n")
    assert await watcher.check()
    assert service.reloads.invalid == 1 and service.config == before


async def test_watcher_follows_a_swapped_symlink(tmp_path: Path, service: AgentService) -> None:
    """ConfigMap volumes point the file at a new ..data directory on update."""
    old_dir, new_dir = tmp_path / "v1", tmp_path / "v2"
    old_dir.mkdir()
    new_dir.mkdir()
    write(old_dir / "agent.yaml", service.config)
    write(new_dir / "agent.yaml", edited(service.config, retention={"priority": 50}))
    link = tmp_path / "agent.yaml"
    link.symlink_to(old_dir / "agent.yaml")
    watcher = ConfigWatcher(service, link)
    tmp_link = tmp_path / "swap"
    tmp_link.symlink_to(new_dir / "agent.yaml")
    os.replace(tmp_link, link)
    assert await watcher.check()
    assert service.config.retention.priority == 50


async def test_live_fields_are_documented_for_the_operator() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "agent.md").read_text()
    from kvpool_agent.config import LIVE_FIELDS

    for field in LIVE_FIELDS:
        assert f"`{field}`" in doc, field
    assert small_config().server.port == 8000


async def wait_for(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_a_non_utf8_config_is_invalid_and_a_later_edit_still_applies(
    tmp_path: Path, service: AgentService
) -> None:
    """A non-UTF-8 file used to kill the watcher task (UnicodeDecodeError), silently: no
    later edit ever applied."""
    path = tmp_path / "agent.yaml"
    write(path, service.config)
    before = service.config
    watcher = ConfigWatcher(service, path, interval=0.01)
    watcher.start()
    try:
        tmp = path.with_name("agent.yaml.new")
        tmp.write_bytes(b"retention:\n  priority: \xff\xfe 80\n")
        os.replace(tmp, path)
        await wait_for(lambda: service.reloads.invalid == 1)
        assert service.config == before and service.reloads.errors == 0
        write(path, edited(service.config, retention={"priority": 70}))
        await wait_for(lambda: service.reloads.applied == 1)
        assert service.config.retention.priority == 70
    finally:
        await watcher.stop()


async def test_the_watcher_survives_any_error_in_a_check(
    tmp_path: Path, service: AgentService, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "agent.yaml"
    write(path, service.config)
    real = service.apply_config
    calls = 0

    async def fails_once(new: AgentConfig) -> list[str]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("unexpected")
        return await real(new)

    monkeypatch.setattr(service, "apply_config", fails_once)
    watcher = ConfigWatcher(service, path, interval=0.01)
    watcher.start()
    try:
        write(path, edited(service.config, retention={"priority": 60}))
        await wait_for(lambda: service.reloads.errors == 1)
        assert service.config.retention.priority != 60
        write(path, edited(service.config, retention={"priority": 61}))
        await wait_for(lambda: service.reloads.applied == 1)
        assert service.config.retention.priority == 61 and service.reloads.errors == 1
    finally:
        await watcher.stop()


@pytest.mark.parametrize(
    "content, needle",
    [
        (b"model: {num_layers: 2}\ncomment: \xc3\x28\n", "not UTF-8"),
        (b"[" * 5000, "nested too deeply"),
        (b"when: 2001-13-01\n", "YAML cannot read"),
        (b"[1, 2\n", "not valid YAML"),
    ],
)
async def test_unreadable_config_files_are_config_errors_naming_the_file(
    tmp_path: Path, content: bytes, needle: str
) -> None:
    path = tmp_path / "agent.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        load_agent_config(path)
    assert str(path) in str(info.value) and needle in str(info.value)

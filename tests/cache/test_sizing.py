"""Pool sizing: bytes per block, one pool per (window, heads), budgets and the initial split."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from kvpool_agent.cache.sizing import plan_pools
from kvpool_agent.config import KvCacheConfig, ModelGeometry
from kvpool_cli import main


def test_bytes_per_block_formula() -> None:
    model = ModelGeometry(num_layers=4, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    plan = plan_pools(model, KvCacheConfig(tokens_per_block=32), primary_bytes=1 << 30)
    (pool,) = plan.pools
    assert pool.block_bytes == 2 * 4 * 8 * 128 * 32 * 2
    assert plan.primary.group_blocks == ((1 << 30) // pool.block_bytes,)


def test_one_pool_per_window_and_heads() -> None:
    model = ModelGeometry(num_layers=4, num_kv_heads=[8, 8, 4, 4], head_dim=64)
    cfg = KvCacheConfig(max_attention_window=[1024, 128])
    plan = plan_pools(model, cfg, primary_bytes=64 << 20)
    combos = {(p.window, p.kv_heads): p.layers for p in plan.pools}
    assert combos == {(1024, 8): (0,), (128, 8): (1,), (1024, 4): (2,), (128, 4): (3,)}
    assert plan.layer_pool == (0, 1, 2, 3)
    # Pools with the same window share ids: two groups.
    assert len(plan.groups) == 2


def test_fp8_halves_the_block() -> None:
    model = ModelGeometry(num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16")
    a = plan_pools(model, KvCacheConfig(), primary_bytes=1 << 24).pools[0].block_bytes
    b = plan_pools(model, KvCacheConfig(dtype="fp8"), primary_bytes=1 << 24).pools[0].block_bytes
    assert a == 2 * b


def test_max_tokens_caps_the_primary_tier() -> None:
    model = ModelGeometry(num_layers=2, num_kv_heads=2, head_dim=64)
    cfg = KvCacheConfig(tokens_per_block=16, max_tokens=1000)
    plan = plan_pools(model, cfg, primary_bytes=1 << 30)
    assert plan.primary.group_blocks == (63,)  # ceil(1000 / 16)
    # The fraction still wins when it is smaller.
    small = plan_pools(model, cfg, primary_bytes=10 * plan.pools[0].block_bytes)
    assert small.primary.group_blocks == (10,)


def test_host_tier_is_host_cache_size() -> None:
    model = ModelGeometry(num_layers=2, num_kv_heads=2, head_dim=64)
    plan = plan_pools(model, KvCacheConfig(host_cache_size=1 << 20), primary_bytes=1 << 20)
    assert plan.secondary.group_blocks == ((1 << 20) // plan.pools[0].block_bytes,)


def test_initial_split_weights_window_and_width() -> None:
    model = ModelGeometry(num_layers=2, num_kv_heads=4, head_dim=64)
    cfg = KvCacheConfig(tokens_per_block=32, max_attention_window=[4096, 480])
    plan = plan_pools(model, cfg, primary_bytes=256 << 20, max_seq_len=4096)
    full, window = plan.primary.group_blocks
    # Same width: blocks split about (4096 + 32) : (480 + 32).
    assert full / window == pytest.approx((4096 + 32) / (480 + 32), rel=0.1)
    used = sum(
        b * g.block_bytes for b, g in zip(plan.primary.group_blocks, plan.groups, strict=True)
    )
    assert 0.95 * (256 << 20) <= used <= 256 << 20


def test_size_command_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text(
        "model: {num_layers: 2, num_kv_heads: 2, head_dim: 64, dtype: float16}\n"
        "kv_cache_config: {tokens_per_block: 16, host_cache_size: 1048576}\n"
        "device: cpu\ncpu_budget_bytes: 2097152\n"
    )
    assert main(["size", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    (pool,) = data["pools"]
    assert pool["bytes_per_block"] == 2 * 2 * 2 * 64 * 16 * 2
    assert pool["primary"]["blocks"] == 2097152 // pool["bytes_per_block"]
    assert pool["primary"]["tokens"] == pool["primary"]["blocks"] * 16
    assert pool["secondary"]["bytes"] == 1048576


def test_size_command_reports_bad_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text(
        "model: {num_layers: 2, num_kv_heads: 2, head_dim: 64}\n"
        "kv_cache_config: {free_gpu_memory_fraction: 2}\n"
    )
    assert main(["size", str(path)]) == 2
    assert "kv_cache_config.free_gpu_memory_fraction" in capsys.readouterr().err


def test_size_takes_a_kvcachepool_manifest_as_the_operator_would_configure_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`kvpool size` on the manifest a user is about to apply: the plan of the agent config
    its pods get, printed in 80 columns."""
    from kvpool_operator.models import KVCachePool

    manifest = Path(__file__).resolve().parents[2] / "crds" / "examples" / "cpu-dev.yaml"
    assert main(["size", str(manifest), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    cfg = KVCachePool.model_validate(yaml.safe_load(manifest.read_text())).spec.agent_config()
    assert plan["tiers"]["primary"]["budget_bytes"] == cfg.cpu_budget_bytes
    assert plan["tokens_per_block"] == cfg.kv_cache_config.tokens_per_block
    assert main(["size", str(manifest)]) == 0
    table = capsys.readouterr().out
    assert "…" not in table  # nothing cut in an 80-column terminal (pytest's capture width)

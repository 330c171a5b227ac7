"""Config models: reference names and defaults, clear errors naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from kvpool_agent.config import (
    AgentConfig,
    ConfigError,
    KvCacheConfig,
    ModelGeometry,
    load_agent_config,
    restart_fields,
)


def test_defaults_follow_the_reference() -> None:
    cfg = KvCacheConfig()
    assert cfg.free_gpu_memory_fraction == 0.9
    assert cfg.secondary_offload_min_priority == 35
    assert cfg.host_cache_size == 0
    assert cfg.enable_block_reuse and cfg.enable_partial_reuse and cfg.copy_on_partial_reuse
    assert cfg.dtype == "auto"
    assert cfg.max_tokens is None


@pytest.mark.parametrize("value", [0, 1, 3, 48, -4])
def test_tokens_per_block_must_be_power_of_two(value: int) -> None:
    with pytest.raises(ValidationError) as err:
        KvCacheConfig(tokens_per_block=value)
    text = str(err.value)
    assert "tokens_per_block" in text and "power of two" in text


@pytest.mark.parametrize("value", [0.0, 1.0, -0.1, 1.5])
def test_fraction_must_be_inside_zero_one(value: float) -> None:
    with pytest.raises(ValidationError, match="free_gpu_memory_fraction"):
        KvCacheConfig(free_gpu_memory_fraction=value)


def test_dtype_error_lists_allowed_values() -> None:
    with pytest.raises(ValidationError) as err:
        KvCacheConfig(dtype="fp4")  # type: ignore[arg-type]
    text = str(err.value)
    for allowed in ("auto", "float16", "bfloat16", "fp8", "int8"):
        assert allowed in text


def test_priority_threshold_range() -> None:
    with pytest.raises(ValidationError, match="secondary_offload_min_priority"):
        KvCacheConfig(secondary_offload_min_priority=101)


def test_camel_case_is_accepted() -> None:
    cfg = KvCacheConfig.model_validate({"tokensPerBlock": 64, "hostCacheSize": 1024})
    assert cfg.tokens_per_block == 64 and cfg.host_cache_size == 1024
    assert cfg.model_dump(by_alias=True)["tokensPerBlock"] == 64


def test_unknown_field_is_rejected() -> None:
    with pytest.raises(ValidationError, match="tokens_per_blok"):
        KvCacheConfig.model_validate({"tokens_per_blok": 32})


def test_window_list_repeats_over_layers() -> None:
    model = ModelGeometry(num_layers=5, num_kv_heads=2, head_dim=8)
    cfg = KvCacheConfig(max_attention_window=[4096, 256])
    assert model.windows_per_layer(cfg) == [4096, 256, 4096, 256, 4096]


def test_kv_heads_per_layer_must_match_layers() -> None:
    with pytest.raises(ValidationError, match="num_kv_heads"):
        ModelGeometry(num_layers=3, num_kv_heads=[2, 2], head_dim=8)
    assert ModelGeometry(num_layers=2, num_kv_heads=[2, 4], head_dim=8).kv_heads_per_layer() == [
        2,
        4,
    ]


def test_load_agent_config_names_every_bad_field(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text(
        "model: {num_layers: 2, num_kv_heads: 2, head_dim: 8}\n"
        "kv_cache_config: {tokens_per_block: 24, dtype: fp4}\n"
    )
    with pytest.raises(ConfigError) as err:
        load_agent_config(path)
    text = str(err.value)
    assert "kv_cache_config.tokens_per_block" in text
    assert "kv_cache_config.dtype" in text and "bfloat16" in text


def test_load_agent_config_rejects_non_mapping(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_agent_config(path)


def test_restart_fields_split_live_from_restart() -> None:
    base = AgentConfig(model=ModelGeometry(num_layers=2, num_kv_heads=2, head_dim=8))
    live = base.model_copy(deep=True)
    live.kv_cache_config.enable_block_reuse = False
    live.kv_cache_config.secondary_offload_min_priority = 50
    assert restart_fields(base, live) == []
    restart = base.model_copy(deep=True)
    restart.kv_cache_config.tokens_per_block = 64
    restart.model.head_dim = 16
    assert set(restart_fields(base, restart)) == {
        "kv_cache_config.tokens_per_block",
        "model.head_dim",
    }

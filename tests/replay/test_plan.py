"""Capacity search and model geometry parsing for ``kvpool plan``."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool_agent.config import ConfigError
from kvpool_agent.replay.plan import bytes_per_block, parse_geometry, smallest_capacity


@given(st.integers(1, 5000), st.integers(1, 5000))
def test_exact_search_finds_the_threshold(threshold: int, max_blocks: int) -> None:
    result = smallest_capacity(lambda c: float(c >= threshold), 1.0, max_blocks)
    if threshold > max_blocks:
        assert result.capacity_blocks is None
    else:
        assert result.capacity_blocks == threshold
        assert result.hit_rate == 1.0


@given(st.integers(100, 100_000), st.floats(0.01, 0.2))
def test_tolerant_search_overshoots_by_at_most_the_tolerance(threshold: int, tol: float) -> None:
    probes: list[int] = []

    def rate(c: int) -> float:
        probes.append(c)
        return min(1.0, c / threshold)

    result = smallest_capacity(rate, 1.0, 200_000, min_blocks=50, rel_tol=tol)
    assert result.capacity_blocks is not None
    # Bisection stops once the bracket is within tol of the answer itself.
    assert threshold <= result.capacity_blocks <= threshold / (1 - tol) + 1
    assert min(probes) >= 50
    assert result.probes == len(set(probes))


def test_known_ceiling_skips_the_probe_and_reports_out_of_reach() -> None:
    calls: list[int] = []

    def rate(c: int) -> float:
        calls.append(c)
        return 0.5

    result = smallest_capacity(rate, 0.9, 100, max_rate=0.6)
    assert result.capacity_blocks is None
    assert calls == []


def test_bytes_per_block_is_k_and_v_over_all_layers() -> None:
    model = parse_geometry("layers=32,kv_heads=8,head_dim=128,dtype=bfloat16")
    assert bytes_per_block(model, 16) == 2 * 32 * 8 * 128 * 16 * 2


def test_geometry_from_a_file_or_an_agent_config(tmp_path: Path) -> None:
    (tmp_path / "m.yaml").write_text("numLayers: 4\nnumKvHeads: 2\nheadDim: 64\n")
    assert parse_geometry(str(tmp_path / "m.yaml")).num_layers == 4
    (tmp_path / "a.yaml").write_text("model:\n  num_layers: 2\n  num_kv_heads: 1\n  head_dim: 8\n")
    assert parse_geometry(str(tmp_path / "a.yaml")).head_dim == 8


def test_bad_geometry_names_the_field() -> None:
    with pytest.raises(ConfigError, match="headDim: Field required"):
        parse_geometry("layers=2,kv_heads=1")
    with pytest.raises(ConfigError, match="key=value"):
        parse_geometry("llama")

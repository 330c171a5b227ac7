"""``kvpool replay`` and ``kvpool plan`` end to end on a small trace file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool_cli import main


@pytest.fixture
def trace_file(tmp_path: Path) -> Path:
    # Three shared prompts, each followed by per-request suffixes, reused round-robin.
    rows = []
    for i in range(60):
        group = i % 3
        ids = [1000 * group + j for j in range(4)] + [10_000 + i]
        rows.append({"timestamp": i, "input_length": 16 * 5, "output_length": 1, "hash_ids": ids})
    path = tmp_path / "small.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_replay_json_with_optimum(trace_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(trace_file), "--capacity", "14", "--optimal", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["capacity_blocks"] == 14
    assert out["block_size"] == 16
    assert out["query_blocks"] == 300
    assert 0 < out["block_hit_rate"] <= out["optimal_block_hit_rate"] <= 1
    assert out["hit_tokens"] == 16 * out["hit_blocks"]


def test_replay_text_and_limit(trace_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["replay", str(trace_file), "--capacity-fraction", "0.5", "--limit", "6"])
    assert code == 0
    text = capsys.readouterr().out
    assert "6 requests" in text
    assert "block hit rate" in text and "token hit rate" in text


def test_replay_rejects_unknown_policy_and_tiny_capacity(
    trace_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["replay", str(trace_file), "--policy", "mru"]) == 2
    assert "unknown 'mru'" in capsys.readouterr().err
    assert main(["replay", str(trace_file), "--capacity", "2"]) == 2
    assert "too small" in capsys.readouterr().err


def test_sweep_writes_a_png(
    trace_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png = tmp_path / "sweep.png"
    code = main(
        [
            "replay",
            str(trace_file),
            "--sweep",
            "--fractions",
            "0.4,0.8",
            "--output",
            str(png),
            "--json",
        ]
    )
    assert code == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    points = json.loads(capsys.readouterr().out)["points"]
    assert {p["series"] for p in points} == {"lru", "reuse-gap", "mixture", "optimal"}
    best = {p["fraction"]: p["block_hit_rate"] for p in points if p["series"] == "optimal"}
    for p in points:
        assert p["block_hit_rate"] <= best[p["fraction"]] + 1e-12


def test_plan_reports_blocks_and_gib(trace_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "plan",
            str(trace_file),
            "--target-hit-rate",
            "50",
            "--model",
            "layers=2,kv_heads=2,head_dim=64",
            "--json",
        ]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["target_hit_rate"] == 0.5
    assert out["optimal_blocks"] <= out["policy_blocks"]
    assert out["policy_hit_rate"] >= 0.5
    assert out["bytes_per_block"] == 2 * 2 * 2 * 64 * 16 * 2
    assert out["policy_gib"] == pytest.approx(out["policy_blocks"] * out["bytes_per_block"] / 2**30)


def test_plan_out_of_reach(trace_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(trace_file), "--target-hit-rate", "0.99"]) == 1
    assert "out of reach" in capsys.readouterr().out

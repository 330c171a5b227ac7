"""Trace loading: the JSON Lines format, block size inference and clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool_agent.config import ConfigError
from kvpool_agent.traces import load_trace


def write(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_block_size_from_ceil_convention(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]},
        {"timestamp": 3, "input_length": 513, "output_length": 5, "hash_ids": [0, 2]},
    ]
    trace = load_trace(write(tmp_path / "t.jsonl", rows))
    assert trace.block_size == 512
    assert trace.total_blocks == 4
    assert trace.unique_blocks() == 3
    assert trace.total_tokens == 1513
    assert trace.requests[1].hash_ids == (0, 2)


def test_block_size_from_floor_convention(tmp_path: Path) -> None:
    # 40 tokens in 16-token blocks: two full blocks get ids, the partial one does not.
    rows = [
        {"timestamp": i, "input_length": 40, "output_length": 1, "hash_ids": [0, i + 1]}
        for i in range(3)
    ]
    assert load_trace(write(tmp_path / "t.jsonl", rows)).block_size == 16


def test_explicit_block_size_wins(tmp_path: Path) -> None:
    rows = [{"timestamp": 0, "input_length": 40, "output_length": 1, "hash_ids": [0, 1]}]
    assert load_trace(write(tmp_path / "t.jsonl", rows), block_size=32).block_size == 32


def test_head_and_capacity(tmp_path: Path) -> None:
    rows = [
        {"timestamp": i, "input_length": 32, "output_length": 1, "hash_ids": [i, 100 + i]}
        for i in range(10)
    ]
    trace = load_trace(write(tmp_path / "t.jsonl", rows))
    assert len(trace.head(3).requests) == 3
    assert trace.head(None) is trace
    assert trace.capacity_blocks(0.1) == 2
    assert trace.capacity_blocks(0.001) == 1
    with pytest.raises(ConfigError, match="positive"):
        trace.capacity_blocks(0.0)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "line 2: not valid JSON"),
        ('{"input_length": 3, "hash_ids": ["a"]}', "line 2: hash_ids must be a list of integers"),
        ('{"input_length": -1, "hash_ids": [1]}', "line 2: input_length"),
        ("[1, 2]", "line 2: expected an object"),
    ],
)
def test_bad_lines_name_the_line_and_field(tmp_path: Path, line: str, message: str) -> None:
    good = json.dumps({"timestamp": 0, "input_length": 32, "output_length": 1, "hash_ids": [0, 1]})
    path = tmp_path / "t.jsonl"
    path.write_text(good + "\n" + line + "\n")
    with pytest.raises(ConfigError, match=message):
        load_trace(path)


def test_missing_and_empty_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read trace"):
        load_trace(tmp_path / "absent.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ConfigError, match="no requests"):
        load_trace(tmp_path / "empty.jsonl")

"""Sizing from free device memory, on a real GPU (GPU machines only).

``kvpool agent`` with ``free_gpu_memory_fraction`` and a host tier allocates what ``kvpool
size`` plans from the same free memory, and a second agent on the same GPU sizes from what
the first one left."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import yaml

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

FRACTION = 0.3
HOST_BYTES = 1 << 30
TOLERANCE = 0.02
"""Free memory moves between two readings by what other processes' CUDA contexts take."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _planned(config: Path) -> dict[str, int]:
    """``kvpool size --json``'s blocks per tier (one pool), sized from the free memory now."""
    out = subprocess.run(
        [sys.executable, "-m", "kvpool_cli", "size", "--json", str(config)],
        check=True,
        capture_output=True,
        text=True,
    )
    (pool,) = json.loads(out.stdout)["pools"]
    return {tier: int(pool[tier]["blocks"]) for tier in ("primary", "secondary")}


def _allocated(url: str) -> dict[str, int]:
    rows = httpx.get(f"{url}/v1/stats", timeout=10).json()["pools"]
    return {str(r["tier"]): int(r["blocks_total"]) for r in rows}


def test_agents_size_from_the_free_memory_they_find(start_agent: Any, tmp_path: Path) -> None:
    doc = {
        "model": {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "dtype": "bfloat16"},
        "kv_cache_config": {
            "tokens_per_block": 16,
            "free_gpu_memory_fraction": FRACTION,
            "host_cache_size": HOST_BYTES,
        },
        "device": "cuda",
        "events": {"endpoint": None, "replay_endpoint": None},
        "transfer": {"port": None},
    }
    config = tmp_path / "agent.yaml"
    config.write_text(yaml.safe_dump(doc))
    block_bytes = 32 * 2 * 16 * 8 * 128 * 2

    plan_a = _planned(config)
    port_a = _free_port()
    agent_a = start_agent(config, port_a, "--port", str(port_a))
    got_a = _allocated(agent_a.url)
    assert got_a["secondary"] == plan_a["secondary"] == HOST_BYTES // block_bytes
    assert abs(got_a["primary"] - plan_a["primary"]) <= TOLERANCE * plan_a["primary"]
    free, total = torch.cuda.mem_get_info()
    assert got_a["primary"] * block_bytes <= FRACTION * total
    assert free >= (1 - FRACTION) * total * 0.5  # the first agent took about its fraction

    plan_b = _planned(config)  # what is left once the first agent holds its pool
    assert plan_b["primary"] < (1 - FRACTION + TOLERANCE) * plan_a["primary"]
    port_b = _free_port()
    agent_b = start_agent(config, port_b, "--port", str(port_b))
    try:
        got_b = _allocated(agent_b.url)
        assert abs(got_b["primary"] - plan_b["primary"]) <= TOLERANCE * plan_b["primary"]
        print(
            f"\nsizing on {torch.cuda.get_device_name()}: total {total / 2**30:.1f} GiB; "
            f"agent A planned {plan_a['primary']} blocks, allocated {got_a['primary']}; "
            f"agent B planned {plan_b['primary']}, allocated {got_b['primary']} "
            f"({block_bytes >> 20} MiB blocks, fraction {FRACTION})"
        )
    finally:
        agent_b.stop()
        agent_a.stop()

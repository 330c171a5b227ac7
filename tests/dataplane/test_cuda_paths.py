"""The data plane with the primary tier in CUDA memory (GPU machines only).

The transfer port stages a CUDA pool's blocks through host memory, the host tier holds what
the device tier evicts, and an engine on the same node maps the device tier through a CUDA
IPC handle and copies with its own GPU. Each is checked for bit-exact round trips of random
KV; on a machine without CUDA every test here skips."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvpool_agent.dataplane.client import TORCH_DTYPES
from kvpool_agent.dataplane.shm import ShmClient

from .conftest import (
    NS,
    TOKENS,
    TPB,
    Agent,
    agent_config,
    cuda_socket_agent,
    free_port,
    keys_for,
    random_kv,
    round_trip_six_blocks,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

PRIMARY_BLOCKS = 32
HOST_BLOCKS = 64


def cuda_doc() -> dict[str, Any]:
    """The tests' geometry (2 layers, 2 kv heads, head dim 8, 4 tokens per block) with a
    primary tier of ``PRIMARY_BLOCKS`` in CUDA memory and a pinned host tier behind it."""
    block_bytes = 2 * 2 * TPB * 2 * 8 * 4
    return {
        "device": "cuda",
        "kv_cache_config": {
            "tokens_per_block": TPB,
            "enable_partial_reuse": False,
            "max_tokens": PRIMARY_BLOCKS * TPB,
            "host_cache_size": HOST_BLOCKS * block_bytes,
        },
    }


@pytest.fixture
def cuda_agent() -> Iterator[Agent]:
    a = Agent(agent_config(**cuda_doc()))
    yield a
    a.close()


def test_the_agent_sizes_its_cuda_tier_from_max_tokens(cuda_agent: Agent) -> None:
    engine = cuda_agent.service.engine
    assert engine.storage[0].arena.device.type == "cuda"
    tiers = {row["tier"]: int(row["blocks_total"]) for row in cuda_agent.usage()}
    assert tiers == {"primary": PRIMARY_BLOCKS, "secondary": HOST_BLOCKS}
    assert engine.storage[1].arena.is_pinned()


def test_tcp_round_trips_random_kv_through_a_cuda_pool(cuda_agent: Agent) -> None:
    with cuda_agent.client() as client:
        round_trip_six_blocks(client)


def test_blocks_the_cuda_tier_evicts_come_back_bit_exact_from_the_host_tier(
    cuda_agent: Agent,
) -> None:
    """More chains than the device tier holds: the oldest are offloaded (device -> pinned
    host), then read back (onboarded or served from the host tier) unchanged."""
    with cuda_agent.client() as client:
        chains = [(keys_for(100 + i, 4), random_kv(client, 4, seed=100 + i)) for i in range(12)]
        for keys, kv in chains:
            assert client.put(NS, keys, kv).stored == 4
        first_keys, _ = chains[0]
        assert client.lookup(NS, first_keys) == ["secondary"] * 4
        assert cuda_agent.service.engine.stats.offloads > 0
        for keys, kv in chains:
            lease = client.lease(NS, keys, ttl_s=30)
            assert lease is not None and lease.count == 4
            out = client.empty_kv(4)
            client.get_into(lease, out)
            client.release(lease)
            assert torch.equal(out[0], kv[0])


# ---------------------------------------------------------------------- CUDA IPC


@pytest.mark.slow
def test_an_engine_maps_the_cuda_tier_and_copies_with_its_own_gpu(
    start_agent: Any, tmp_path: Path
) -> None:
    """A real ``kvpool agent`` on CUDA with a Unix socket: a client in this process maps its
    device tier through CUDA IPC (after AUTH), writes CUDA tensors into reserved blocks and
    reads them back into CUDA tensors; the transfer port sees the same bytes."""
    transfer_port = free_port()
    doc = {
        "model": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float32"},
        "transfer": {"port": transfer_port},
        **cuda_doc(),
    }
    agent, path = cuda_socket_agent(start_agent, tmp_path, doc, "cuda.sock")
    try:
        with ShmClient(path, token=TOKENS["a"], cuda=True) as shm:
            assert shm.arena.device.type == "cuda"
            geo = shm.geometry()
            g = torch.Generator(device="cuda").manual_seed(5)
            kv = [
                torch.randn(geo.kv_shape(p.index, 5), generator=g, device="cuda").to(
                    TORCH_DTYPES[p.dtype]
                )
                for p in geo.pools
            ]
            keys = keys_for(7, 5)
            assert shm.put(NS, keys, kv).stored == 5
            assert shm.lookup(NS, keys) == ["primary"] * 5
            lease = shm.lease(NS, keys, ttl_s=30)
            assert lease is not None
            out = [torch.full_like(t, float("nan")) for t in kv]
            shm.get_into(lease, out)
            shm.release(lease)
            assert torch.equal(out[0], kv[0])
        from kvpool_agent.dataplane.client import TransferClient

        with TransferClient([f"127.0.0.1:{transfer_port}"], token=TOKENS["a"]) as tcp:
            lease = tcp.lease(NS, keys)
            assert lease is not None
            host = tcp.empty_kv(5)
            tcp.get_into(lease, host)
            tcp.release(lease)
            assert torch.equal(host[0], kv[0].cpu())
    finally:
        agent.stop()

"""The connector's copies between vLLM's pages on a GPU and the pool (GPU machines only).

vLLM itself is not needed: the worker side's data movement lives in ``layerwise.py`` and
``layout.py``. Pages are CUDA tensors in FlashAttention's layout; saves copy each layer out
on the current stream into pinned memory while later work on that stream overwrites the
pages, loads read into pinned buffers and upload each layer on the current stream."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from dataplane.conftest import NS, TOKENS, Agent, agent_config, cuda_socket_agent, keys_for

from kvpool_agent.connectors.stats import ConnectorStats
from kvpool_agent.connectors.vllm.layerwise import (
    LayerLoad,
    LayerSave,
    LoadItem,
    SavePart,
    scatter_layer,
)
from kvpool_agent.connectors.vllm.layout import BlockLayout, gather
from kvpool_agent.dataplane.shm import ShmClient

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

LAYERS, HEADS, DIM, BS, PAGES = 4, 2, 64, 16, 24


@pytest.fixture
def agent() -> Iterator[Agent]:
    """A CPU agent (the node's host tier) whose blocks match the pages: bf16, 16 tokens."""
    block_bytes = LAYERS * 2 * BS * HEADS * DIM * 2
    a = Agent(
        agent_config(
            model={
                "num_layers": LAYERS,
                "num_kv_heads": HEADS,
                "head_dim": DIM,
                "dtype": "bfloat16",
            },
            kv_cache_config={"tokens_per_block": BS},
            cpu_budget_bytes=64 * block_bytes,
        )
    )
    yield a
    a.close()


def pages(seed: int) -> list[torch.Tensor]:
    """One bf16 CUDA tensor per layer, as vLLM registers them for FLASH_ATTN."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [
        torch.randn(PAGES, HEADS, BS, 2 * DIM, generator=g, device="cuda").to(torch.bfloat16)
        for _ in range(LAYERS)
    ]


def test_saved_blocks_load_bit_exact_into_other_pages_layer_by_layer(agent: Agent) -> None:
    layout = BlockLayout.for_backend("FLASH_ATTN", BS, HEADS, DIM)
    src = pages(1)
    src_views = [layout.blocks_view(t) for t in src]
    saved_ids = [9, 2, 17, 5]
    want = gather(src_views, saved_ids)  # [layers, 4, 2, bs, heads, dim] on the host

    save = LayerSave([SavePart("r", [], 0, 0, len(saved_ids))], saved_ids, src_views[0])
    for layer in range(LAYERS):
        assert save.copy(src_views, layer)
        src[layer].fill_(7.0)  # queued after the copy on the same stream: must not leak in
    ((_, kv),) = save.finish(src_views)
    assert kv.is_pinned() and torch.equal(kv, want)

    client = agent.client(retries=0)
    keys = keys_for(3, len(saved_ids))
    assert client.put(NS, keys, [kv]).stored == len(saved_ids)

    dst = pages(2)
    before = [t.clone() for t in dst]
    dst_views = [layout.blocks_view(t) for t in dst]
    load_ids = [20, 0, 11]  # the chain's blocks 1..3
    lease = client.lease(NS, keys, ttl_s=30)
    assert lease is not None
    index = torch.tensor(load_ids, device="cuda")
    item = LoadItem("r", load_ids, 1, lease, len(load_ids), index)
    job = LayerLoad(
        [item], LAYERS, 2, client=lambda: client, usable=lambda: True, timeout_s=30,
        stats=ConnectorStats(), pin_memory=True,
    )  # fmt: skip
    job.start()
    for layer in range(LAYERS):
        (taken,) = job.take(layer)
        assert taken.kv is not None and taken.kv.is_pinned()
        scatter_layer(dst_views[layer], index, taken.kv[layer])
    outcome = job.finish()
    assert outcome.loaded_blocks == 3 and not outcome.failed_block_ids
    torch.cuda.synchronize()
    got = gather(dst_views, load_ids)
    assert torch.equal(got, want[:, 1:])
    untouched = [i for i in range(PAGES) if i not in load_ids]
    for layer, old in zip(dst, before, strict=True):
        assert torch.equal(layer[untouched], old[untouched])


def test_a_save_waits_for_the_forward_pass_on_its_stream() -> None:
    """The copy of a layer is ordered after the kernels that wrote it: a page written by a
    long kernel on the current stream is saved with the written values."""
    layout = BlockLayout.for_backend("FLASH_ATTN", BS, HEADS, DIM)
    src = pages(3)
    views = [layout.blocks_view(t) for t in src]
    big = torch.randn(4096, 4096, device="cuda")
    for t in src:
        (big @ big).sum()  # keeps the stream busy before the write below
        t[4].fill_(3.0)
    save = LayerSave([SavePart("r", [], 0, 0, 1)], [4], views[0])
    ((_, kv),) = save.finish(views)
    assert bool((kv.float() == 3.0).all())


@pytest.mark.slow
def test_a_same_node_cuda_agent_loads_device_to_device(start_agent: Any, tmp_path: Path) -> None:
    """A real ``kvpool agent`` with its primary tier on this GPU and a Unix socket: the
    connector's same-node client maps the device tier without being told its kind, saved
    blocks (copied out into a buffer on the GPU) land there through a sibling connection (its
    IPC handle checked to be the same),
    and a load reads into buffers on the pages' GPU (no host buffer) and writes bit-exact
    pages, leaving the others untouched; no byte crosses a socket."""
    doc = {
        "model": {
            "num_layers": LAYERS,
            "num_kv_heads": HEADS,
            "head_dim": DIM,
            "dtype": "bfloat16",
        },
        "device": "cuda",
        "kv_cache_config": {"tokens_per_block": BS, "max_tokens": 64 * BS},
        "transfer": {"port": None},
    }
    agent, path = cuda_socket_agent(start_agent, tmp_path, doc, "conn.sock")
    try:
        with ShmClient(path, token=TOKENS["a"]) as shm:
            assert shm.device is not None and shm.device.type == "cuda"
            layout = BlockLayout.for_backend("FLASH_ATTN", BS, HEADS, DIM)
            src = pages(4)
            src_views = [layout.blocks_view(t) for t in src]
            saved_ids = [9, 2, 17, 5]
            want = gather(src_views, saved_ids)
            part = SavePart("r", [], 0, 0, len(saved_ids))
            save = LayerSave([part], saved_ids, src_views[0], on_device=True)
            for layer in range(LAYERS):
                assert save.copy(src_views, layer)
                src[layer].fill_(7.0)  # queued after the copy on the same stream
            ((_, kv),) = save.finish(src_views)
            assert kv.device == src_views[0].device  # the buffer stayed on the GPU
            assert torch.equal(kv.cpu(), want)
            keys = keys_for(5, len(saved_ids))
            with shm.sibling() as saver:  # the saves' own connection, as the connector's
                assert saver.arena is shm.arena
                assert saver.put(NS, keys, [kv]).stored == len(saved_ids)

            with ShmClient(path, token=TOKENS["a"], map_arena=False) as scheduler:
                assert scheduler.lookup(NS, keys) == ["primary"] * len(saved_ids)
                lease = scheduler.lease(NS, keys, ttl_s=30)
            assert lease is not None

            dst = pages(6)
            before = [t.clone() for t in dst]
            dst_views = [layout.blocks_view(t) for t in dst]
            load_ids = [20, 0, 11]
            index = torch.tensor(load_ids, device="cuda")
            item = LoadItem("r", load_ids, 1, lease, len(load_ids), index)
            job = LayerLoad(
                [item], LAYERS, 2, client=lambda: shm, usable=lambda: True, timeout_s=30,
                stats=ConnectorStats(), pin_memory=True, pages_device=dst_views[0].device,
            )  # fmt: skip
            job.start()
            for layer in range(LAYERS):
                (taken,) = job.take(layer)
                assert taken.kv is not None and taken.kv.device == dst_views[0].device
                scatter_layer(dst_views[layer], index, taken.kv[layer])
            outcome = job.finish()
            assert outcome.loaded_blocks == 3 and not outcome.failed_block_ids
            torch.cuda.synchronize()
            assert torch.equal(gather(dst_views, load_ids), want[:, 1:])
            untouched = [i for i in range(PAGES) if i not in load_ids]
            for layer, old in zip(dst, before, strict=True):
                assert torch.equal(layer[untouched], old[untouched])
        assert agent.metric("kvpool_transfer_bytes_total") == 0
    finally:
        agent.stop()

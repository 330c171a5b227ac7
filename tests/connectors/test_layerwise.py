"""Layer-wise loads and saves (``connectors/vllm/layerwise.py``) against an in-process agent:
layers land in order and each can be taken before the next arrived; whatever did not land in
time (a range that failed, came too late, a layer never taken) fails its request's load."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest
import torch
from dataplane.conftest import NS, Agent, agent_config, keys_for, random_kv

from kvpool_agent.connectors.saves import StepBuffers
from kvpool_agent.connectors.stats import ConnectorStats
from kvpool_agent.connectors.vllm.layerwise import (
    LayerLoad,
    LayerSave,
    LoadItem,
    SavePart,
    layer_chunks,
)
from kvpool_agent.connectors.vllm.layout import BlockLayout, gather
from kvpool_agent.dataplane.client import TransferClient

pytestmark = pytest.mark.timeout(120)

LAYERS = 2


@pytest.fixture
def agent() -> Iterator[Agent]:
    a = Agent(agent_config())
    yield a
    if not a.loop.is_closed():  # (a test may have stopped it)
        a.close()


def stored(
    agent: Agent, blocks: int, seed: int
) -> tuple[TransferClient, list[bytes], torch.Tensor]:
    """A client, and a chain of ``blocks`` the agent holds, with its KV."""
    client = agent.client(retries=0)
    keys = keys_for(seed, blocks)
    kv = random_kv(client, blocks, seed)[0]
    client.put(NS, keys, [kv])
    return client, keys, kv


def load(
    client: TransferClient,
    keys: list[bytes],
    block_ids: list[int],
    *,
    first: int = 0,
    timeout_s: float = 10.0,
    on_chunk: Callable[[int], object] | None = None,
    stats: ConnectorStats | None = None,
    streams: int = 1,
) -> LayerLoad:
    lease = client.lease(NS, keys, ttl_s=30)
    assert lease is not None
    count = min(lease.count - first, len(block_ids))
    item = LoadItem("r", block_ids, first, lease, count, torch.tensor(block_ids[:count]))
    return LayerLoad(
        [item],
        LAYERS,
        4,
        client=lambda: client,
        usable=lambda: True,
        timeout_s=timeout_s,
        stats=stats or ConnectorStats(),
        on_chunk=on_chunk,
        streams=streams,
    )


def test_layer_chunks_split_in_order() -> None:
    assert layer_chunks(2, 4) == [(0, 1), (1, 2)]
    assert layer_chunks(32, 4) == [(0, 8), (8, 16), (16, 24), (24, 32)]
    assert layer_chunks(5, 3) == [(0, 1), (1, 3), (3, 5)]
    assert layer_chunks(7, 1) == [(0, 7)]


def test_a_layer_is_taken_before_the_next_one_arrived(agent: Agent) -> None:
    client, keys, kv = stored(agent, 4, 1)
    gate, seen = threading.Event(), []

    def landed(chunk: int) -> None:
        seen.append(chunk)
        if chunk == 0:
            assert gate.wait(10)

    stats = ConnectorStats()
    job = load(client, keys, [7, 3, 5], first=1, on_chunk=landed, stats=stats)
    job.start()
    (item,) = job.take(0)  # layer 0 landed; layer 1 is held back
    assert not job.landed[1].is_set() and seen == [0]
    assert item.kv is not None and torch.equal(item.kv[0], kv[0, 1:4])
    gate.set()
    assert job.take(1) == [item]
    assert torch.equal(item.kv, kv[:, 1:4])
    outcome = job.finish()
    assert outcome.loaded_blocks == 3 and not outcome.failed_block_ids
    assert stats.load_chunks == LAYERS and stats.load_chunk_errors == 0


def test_streams_read_ranges_at_once_on_connections_of_their_own(agent: Agent) -> None:
    """With two streams the second range lands while the first one's reader is held: it
    was read beside it, over another connection; both land bit-exact."""
    client, keys, kv = stored(agent, 4, 6)
    gate, stats = threading.Event(), ConnectorStats()
    job = load(
        client, keys, [7, 3, 5, 1], on_chunk=lambda c: c == 0 and gate.wait(10), stats=stats,
        streams=2,
    )  # fmt: skip
    job.start()
    # Range 0's reader lands it, then is held in the hook; range 1 lands all the same (over
    # another connection). Either may land first: the two reads run at once.
    assert job.landed[0].wait(10) and job.landed[1].wait(10)
    (item,) = job.take(1)
    assert item.kv is not None and torch.equal(item.kv[1], kv[1])
    gate.set()
    assert job.take(0) == [item]
    assert torch.equal(item.kv, kv)
    outcome = job.finish()
    assert outcome.loaded_blocks == 4 and not outcome.failed_block_ids
    assert stats.load_chunks == LAYERS and stats.load_chunk_errors == 0
    assert job._thread is not None
    job._thread.join(10)
    assert sum(int(r["blocks_pinned"]) for r in agent.usage()) == 0  # leases released


def test_a_range_that_fails_fails_the_request(agent: Agent) -> None:
    client, keys, _ = stored(agent, 3, 2)
    stats = ConnectorStats()
    job = load(client, keys, [1, 2, 3], on_chunk=lambda c: c == 0 and agent.close(), stats=stats)
    job.run()
    assert len(job.take(0)) == 1
    assert job.take(1) == []  # never landed
    outcome = job.finish()
    assert outcome.loaded_blocks == 0
    assert outcome.failed_block_ids == [1, 2, 3] and outcome.failed_requests == {"r"}
    assert stats.load_chunks == 1 and stats.load_chunk_errors == 1


def test_a_late_range_is_abandoned(agent: Agent) -> None:
    client, keys, _ = stored(agent, 2, 3)
    gate, stats = threading.Event(), ConnectorStats()
    job = load(client, keys, [4, 5], timeout_s=0.5, on_chunk=lambda c: gate.wait(10), stats=stats)
    job.start()
    assert len(job.take(0)) == 1
    assert job.take(1) == []  # the deadline passed: the second range is held back
    assert job.abandoned
    gate.set()
    assert job.finish().failed_block_ids == [4, 5]
    assert job._thread is not None
    job._thread.join(10)
    assert stats.load_chunks == 1  # abandoned: the second range was never read


def test_a_layer_never_taken_fails_every_load(agent: Agent) -> None:
    client, keys, _ = stored(agent, 2, 4)
    job = load(client, keys, [4, 5])
    job.run()
    job.take(0)
    outcome = job.finish()
    assert outcome.untaken_layers == 1
    assert outcome.loaded_blocks == 0 and outcome.failed_block_ids == [4, 5]


def test_a_short_lease_fails_the_blocks_it_lacks(agent: Agent) -> None:
    client, keys, _ = stored(agent, 2, 5)
    job = load(client, keys + keys_for(99, 2), [6, 7, 8, 9])
    job.run()
    for layer in range(LAYERS):
        job.take(layer)
    outcome = job.finish()
    assert outcome.loaded_blocks == 2 and outcome.failed_block_ids == [8, 9]


def test_saves_copy_layer_by_layer_and_finish_what_the_hooks_missed() -> None:
    layout = BlockLayout.for_backend("CPU_ATTN", block_size=32, kv_heads=2, head_dim=32)
    pages = [torch.randn(8, 2, 32, 64) for _ in range(3)]
    views = [layout.blocks_view(t) for t in pages]
    parts = [SavePart("a", [], 0, 0, 2), SavePart("b", [], 1, 2, 1)]
    save = LayerSave(parts, [5, 2, 7], views[0])
    assert save.copy(views, 1) and not save.copy(views, 1)
    want = gather(views, [5, 2, 7])
    pages[1].zero_()  # written after its copy: the copy holds what was there before
    got = save.finish(views)
    assert [part.req_id for part, _ in got] == ["a", "b"]
    assert torch.equal(got[0][1], want[:, :2]) and torch.equal(got[1][1], want[:, 2:])


def test_a_cpu_steps_save_buffer_is_reused_once_its_saves_were_sent() -> None:
    layout = BlockLayout.for_backend("CPU_ATTN", block_size=32, kv_heads=2, head_dim=32)
    pages = [torch.randn(8, 2, 32, 64) for _ in range(3)]
    views = [layout.blocks_view(t) for t in pages]
    buffers = StepBuffers()
    parts = [SavePart("a", [], 0, 0, 2), SavePart("b", [], 1, 2, 1)]
    first = LayerSave(parts, [5, 2, 7], views[0], buffers=buffers)
    got = first.finish(views)
    assert torch.equal(torch.cat([kv for _, kv in got], dim=1), gather(views, [5, 2, 7]))
    done = first.lend(len(got))
    assert done is not None
    done()
    second = LayerSave([SavePart("c", [], 0, 0, 1)], [3], views[0], buffers=buffers)
    second.finish(views)
    assert second.out is not None
    # One of the first step's saves is still queued: its buffer is not handed out again.
    assert second.out.data_ptr() != got[0][1].data_ptr()
    done()
    third = LayerSave([SavePart("d", [], 0, 0, 2)], [1, 6], views[0], buffers=buffers)
    ((_, kv),) = third.finish(views)
    assert kv.data_ptr() == got[0][1].data_ptr()  # the first step's buffer, back in use
    assert torch.equal(kv, gather(views, [1, 6]))
    assert LayerSave(parts, [5, 2, 7], views[0]).lend(2) is None  # not from a pool

"""The compiled wire encoder (``kvpool_native.WireEncoder``) against the Python one: the same
engine events give the same published bytes, batch after batch, and the same counters."""

from __future__ import annotations

import random
import tracemalloc
from collections.abc import Iterator

import msgpack
import pytest

from kvpool_agent.cache import KVCacheManager
from kvpool_agent.cache.events import BlockStored
from kvpool_agent.cache.packed import PackedTokens, block_key, pack_all
from kvpool_agent.cache.sizing import build_pools
from kvpool_agent.config import KvCacheConfig, ModelGeometry
from kvpool_agent.server.events import NativeWireEncoder, WireEncoder, make_encoder

TPB = 4
MODEL = ModelGeometry(num_layers=2, num_kv_heads=1, head_dim=4, dtype="float32")


def manager(core: str, blocks: int = 12, host_blocks: int = 6) -> KVCacheManager:
    probe = KvCacheConfig(tokens_per_block=TPB, eviction_policy="lru")
    _, groups, _ = build_pools(MODEL, probe)
    host = host_blocks * sum(g.block_bytes for g in groups)
    config = probe.model_copy(update={"host_cache_size": host})
    return KVCacheManager.with_capacity(MODEL, config, blocks, core=core)


def workload(seed: int) -> list[tuple[str, list[int]]]:
    """Opens (shared prefixes, some huge token ids), a few clears."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 4) * TPB)] for _ in range(4)]
    steps: list[tuple[str, list[int]]] = []
    for _ in range(120):
        if rng.random() < 0.03:
            steps.append(("clear", []))
            continue
        huge = (1 << 63) - 1 - rng.randrange(9)
        tail = [
            rng.choice([rng.randrange(50), rng.randrange(1 << 40), huge])
            for _ in range(rng.randrange(1, 4) * TPB + rng.randrange(TPB))
        ]
        steps.append(("open", rng.choice(prefixes) + tail))
    return steps


@pytest.mark.parametrize("medium", ["GPU", "CPU"])
@pytest.mark.parametrize("seed", range(3))
def test_same_events_same_bytes(seed: int, medium: str) -> None:
    """Three pairs run one workload: the Python encoder over the Python core's events, the
    compiled one straight from the compiled core's records (``drain_wire``), and the
    compiled one over the Python core's event objects. Every batch is byte-identical."""
    reference = (manager("python"), WireEncoder(TPB, medium))
    compiled = (manager("native"), NativeWireEncoder(TPB, medium))
    mixed = (manager("python"), NativeWireEncoder(TPB, medium))
    rng = random.Random(seed)
    batches = gone = 0
    for step, (kind, tokens) in enumerate(workload(seed)):
        named = rng.random() < 0.4 and len(tokens) >= TPB
        n = len(tokens) // TPB
        keys = [rng.randbytes(rng.choice([3, 8, 32])) for _ in range(n)]
        # The first-block tables watch a stored chain's first block (its key, the engine's).
        watched = block_key(0, tuple(tokens[:TPB])) if n and rng.random() < 0.5 else None
        outs, gones = [], []
        for mgr, enc in (reference, compiled, mixed):
            if kind == "clear":
                mgr.clear()
            else:
                if named:  # the data plane names the blocks it is about to store
                    enc.name_chain(tokens[: n * TPB], keys)
                mgr.release(mgr.open_sequence(tokens).seq_id)
            outs.append(enc.drain_batch(mgr.events, 1000.0 + step, 0))
            gones.append(sorted(enc.take_gone()))
            if watched is not None:  # (after the drain: what came before is not its removal)
                enc.watch(watched)
        assert outs[1] == outs[0], f"step {step}"
        assert outs[2] == outs[0], f"step {step}"
        assert gones[1] == gones[0] == gones[2], f"step {step}"
        live = {node.key for node in reference[0].iter_nodes()}
        assert not set(gones[0]) & live, f"step {step}: reported gone, but in the tree"
        batches += outs[0] is not None
        gone += len(gones[0])
    assert batches > 60 and gone > 5
    assert compiled[1].watched == reference[1].watched == mixed[1].watched
    for enc in (compiled[1], mixed[1]):
        assert enc.removed == dict(reference[1].removed)
    assert sum(reference[1].removed.values()) > 0


def test_a_named_chain_goes_out_under_the_engine_hashes() -> None:
    mgr = manager("native")
    enc = make_encoder(TPB, "CPU", native=True)
    assert isinstance(enc, NativeWireEncoder)
    tokens = list(range(3 * TPB))
    keys = [bytes([i]) * 32 for i in range(1, 4)]
    enc.name_chain(tokens, keys)
    mgr.release(mgr.open_sequence(tokens + [99]).seq_id)
    batch = enc.drain_batch(mgr.events, 1.0, 0)
    assert batch is not None
    payload, count = batch
    ts, events, rank = msgpack.unpackb(payload)
    assert events[0] == {"type": "AllBlocksCleared"}  # a new engine's first event
    events = events[1:]
    assert (ts, rank, count, len(events)) == (1.0, 0, 4, 3)
    hashes = [e["block_hashes"][0] for e in events]
    assert hashes == [int.from_bytes(k[-8:], "big") for k in keys]
    assert [e["parent_block_hash"] for e in events] == [None, *hashes[:2]]
    assert [e["token_ids"] for e in events] == [tokens[i * TPB : (i + 1) * TPB] for i in range(3)]


def test_a_chain_named_by_packed_tokens_goes_out_as_one_named_by_a_list() -> None:
    tokens = list(range(70_000, 70_000 + 3 * TPB))  # past 16 bits: the packing must be 4 B
    keys = [bytes([i]) * 32 for i in range(1, 4)]
    for native in (False, True):
        batches = []
        for given in (tokens, PackedTokens(pack_all(tokens) or b"")):
            mgr = manager("native" if native else "python")
            enc = make_encoder(TPB, "CPU", native=native)
            enc.name_chain(given, keys)
            mgr.release(mgr.open_sequence(tokens + [99]).seq_id)
            batches.append(enc.drain_batch(mgr.events, 1.0, 0))
        assert batches[0] is not None and batches[1] == batches[0]
        events = msgpack.unpackb(batches[0][0])[1][1:]
        assert [e["block_hashes"][0] for e in events] == [
            int.from_bytes(k[-8:], "big") for k in keys
        ]


def test_name_chain_refuses_tokens_that_are_not_whole_blocks() -> None:
    five = PackedTokens(pack_all(list(range(5))) or b"")
    for enc in (WireEncoder(TPB, "CPU"), NativeWireEncoder(TPB, "CPU")):
        for tokens in (list(range(5)), five):
            with pytest.raises(ValueError, match="name_chain: 5 tokens for 1 keys"):
                enc.name_chain(tokens, [b"k"])
    with pytest.raises(ValueError, match="5 bytes of packed tokens"):
        NativeWireEncoder(TPB, "CPU")._inner.name_chain(b"12345", [b"k"])


def test_a_live_block_costs_the_encoders_the_same_whatever_its_tokens() -> None:
    """The encoders remember each live block's hashes and medium, not its tokens (a tier move
    brings them): with 512-token blocks, each used to hold 2 to 4 KiB more per block than
    the engine's own records of it."""
    blocks, tpb = 2000, 512

    def events() -> Iterator[BlockStored]:  # made one at a time: none outlives its encoding
        for k in range(blocks):
            tokens = tuple(range(70_000 + k, 70_000 + k + tpb))  # ints Python does not share
            yield BlockStored(k + 1, k or None, tokens, "primary", 35)

    native = NativeWireEncoder(tpb, "GPU")
    for event in events():
        native.encode_batch([event], 1.0, 0)
    assert native._inner.live_blocks == blocks
    assert native._inner.memory_bytes() / blocks < 128
    python = WireEncoder(tpb, "GPU")
    tracemalloc.start()
    try:
        for event in events():
            python.encode(event)
        del event
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert held / blocks < 512

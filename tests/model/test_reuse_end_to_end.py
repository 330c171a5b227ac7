"""Reusing cached KV gives the logits of recomputing it: engine + kernels + a tiny Llama.

Every cached logit is compared with ``TinyLlama.dense_logits`` (no cache, plain attention),
so reuse, partial reuse, offload/onboard and sliding-window release are all checked against
a recomputation of the whole sequence.
"""

from __future__ import annotations

import pytest
import torch
from tiny_llama import CachedRunner, TinyLlama, TinyLlamaConfig

from kvpool_agent.cache import KVCacheManager
from kvpool_agent.config import FULL_ATTENTION, KvCacheConfig, ModelGeometry
from kvpool_kernels.flashinfer_backend import flashinfer_available

TPB = 4
MAX_SEQ = 128


def make_runner(
    cfg: TinyLlamaConfig,
    *,
    num_blocks: int = 64,
    primary_bytes: int | None = None,
    host_cache_size: int = 0,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    backend: str = "auto",
) -> CachedRunner:
    model = TinyLlama(cfg, seed=1).to(device=device, dtype=dtype)
    geometry = ModelGeometry(
        num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        dtype=str(dtype).removeprefix("torch."),
    )
    config = KvCacheConfig(
        tokens_per_block=TPB,
        max_attention_window=[MAX_SEQ if w >= FULL_ATTENTION else w for w in cfg.windows],
        host_cache_size=host_cache_size,
    )
    if primary_bytes is None:
        manager = KVCacheManager.with_capacity(
            geometry, config, num_blocks, device=device, max_seq_len=MAX_SEQ
        )
    else:
        manager = KVCacheManager(
            geometry, config, primary_bytes=primary_bytes, device=device, max_seq_len=MAX_SEQ
        )
    return CachedRunner(model, manager, backend=backend)


def prompt(seed: int, n: int, vocab: int = 128) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def generate(
    runner: CachedRunner, prompts: list[list[int]], steps: int, atol: float, salt: str | None = None
) -> tuple[list[int], list[list[int]]]:
    """Prefill then greedy-decode ``prompts`` as one batch, checking every logit against a
    dense recomputation. Returns the sequence ids and the full token lists."""
    model = runner.model
    handles, logits = runner.prefill(prompts, cache_salt=salt)
    seqs = [list(p) for p in prompts]
    for h, lg, toks in zip(handles, logits, seqs, strict=True):
        dense = model.dense_logits(toks)[h.num_reused_tokens :]
        torch.testing.assert_close(lg, dense, atol=atol, rtol=atol)
    nxt = [int(lg[-1].argmax()) for lg in logits]
    ids = [h.seq_id for h in handles]
    for _ in range(steps):
        for s, t in zip(seqs, nxt, strict=True):
            s.append(t)
        out = runner.decode(ids, nxt)
        for row, toks in zip(out, seqs, strict=True):
            torch.testing.assert_close(row, model.dense_logits(toks)[-1], atol=atol, rtol=atol)
        nxt = [int(r.argmax()) for r in out]
    return ids, seqs


CPU_CFG = TinyLlamaConfig()
ATOL = 1e-4


def test_layers_alternate_full_and_window_pools() -> None:
    runner = make_runner(CPU_CFG)
    windows = sorted(p.window for p in runner.pools)
    assert windows == [12, FULL_ATTENTION]
    window_of_layer = [runner.pools[p].window for p in runner.manager.plan.layer_pool]
    assert window_of_layer == [FULL_ATTENTION, 12, FULL_ATTENTION, 12]


def test_generation_through_the_cache_matches_recompute() -> None:
    runner = make_runner(CPU_CFG)
    generate(runner, [prompt(1, 30), prompt(2, 7), prompt(3, 13)], steps=12, atol=ATOL)
    assert runner.backends == {"torch"}


def test_reused_prefix_gives_the_same_logits() -> None:
    runner = make_runner(CPU_CFG)
    base = prompt(5, 26)
    ids, seqs = generate(runner, [base], steps=3, atol=ATOL)
    runner.manager.release(ids[0])
    # Full-block reuse of the shared prefix, plus a partial block (26 = 6 blocks + 2).
    handles, logits = runner.prefill([[*base, 9, 9, 9], seqs[0][:27]])
    assert handles[0].num_reused_tokens >= 24
    assert handles[1].num_reused_tokens >= 24
    for h, lg, toks in zip(handles, logits, [[*base, 9, 9, 9], seqs[0][:27]], strict=True):
        torch.testing.assert_close(lg, runner.model.dense_logits(toks)[h.num_reused_tokens :],
                                   atol=ATOL, rtol=ATOL)  # fmt: skip
    # Same prompt under another salt: nothing reused, logits recomputed and equal.
    (fresh,), (fresh_logits,) = runner.prefill([[*base, 9, 9, 9]], cache_salt="other")
    assert fresh.num_reused_tokens == 0
    torch.testing.assert_close(fresh_logits[-1], logits[0][-1], atol=ATOL, rtol=ATOL)


def push_out(runner: CachedRunner, atol: float) -> None:
    """Run other traffic until the primary tier has offloaded blocks to the host tier."""
    for seed in range(12):
        other, _ = generate(runner, [prompt(100 + seed, 40)], steps=0, atol=atol)
        runner.manager.release(other[0])
        if runner.manager.stats.offloads >= 20:
            return
    raise AssertionError(f"no offload happened: {runner.manager.stats}")


def test_reuse_after_offload_and_onboard() -> None:
    runner = make_runner(CPU_CFG, primary_bytes=100_000, host_cache_size=1 << 20)
    stats = runner.manager.stats
    base = prompt(8, 33)
    ids, _ = generate(runner, [base], steps=2, atol=ATOL)
    runner.manager.release(ids[0])
    push_out(runner, atol=ATOL)
    onboards = stats.onboards
    handles, logits = runner.prefill([[*base, 1, 2, 3, 4, 5]])
    assert stats.onboards > onboards
    assert handles[0].num_reused_tokens >= 32
    dense = runner.model.dense_logits([*base, 1, 2, 3, 4, 5])
    torch.testing.assert_close(logits[0], dense[handles[0].num_reused_tokens :],
                               atol=ATOL, rtol=ATOL)  # fmt: skip
    # Decoding on from the onboarded prefix stays exact too.
    seq = [*base, 1, 2, 3, 4, 5]
    nxt = int(logits[0][-1].argmax())
    for _ in range(5):
        seq.append(nxt)
        row = runner.decode([handles[0].seq_id], [nxt])[0]
        torch.testing.assert_close(row, runner.model.dense_logits(seq)[-1], atol=ATOL, rtol=ATOL)
        nxt = int(row.argmax())


def test_long_decode_slides_the_window_pool() -> None:
    """Window layers drop blocks as the sequence grows; logits stay those of recompute."""
    runner = make_runner(CPU_CFG)
    ids, seqs = generate(runner, [prompt(21, 10)], steps=30, atol=ATOL)
    handle = runner.manager.append_tokens(ids[0], [seqs[0][-1]])
    window_pool = next(i for i, p in enumerate(runner.pools) if p.window == 12)
    assert handle.first_token[window_pool] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not flashinfer_available(), reason="needs CUDA + flashinfer")
def test_reuse_end_to_end_on_gpu_with_flashinfer() -> None:
    cfg = TinyLlamaConfig(num_heads=8, num_kv_heads=2, head_dim=64, intermediate_size=512)
    runner = make_runner(
        cfg, primary_bytes=800_000, host_cache_size=8 << 20, device="cuda", dtype=torch.float16,
        backend="flashinfer",
    )  # fmt: skip
    atol = 2e-2
    base = prompt(8, 33)
    ids, _ = generate(runner, [base, prompt(9, 17)], steps=4, atol=atol)
    assert runner.backends == {"flashinfer"}
    for sid in ids:
        runner.manager.release(sid)
    push_out(runner, atol)
    generate(runner, [[*base, 1, 2, 3, 4, 5]], steps=4, atol=atol)
    assert runner.manager.stats.onboards > 0

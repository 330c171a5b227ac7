"""The real cache managers kvpool is measured against: vLLM's ``KVCacheManager`` and SGLang's
``RadixCache``, driven on CPU through the same lookup + allocate + release loop as
``bench/cache_ops.py`` drives the engine.

Neither is a dependency of kvpool: they import only in the bench virtualenv that
``hack/bench-venv.sh`` builds (``.venv-bench``); elsewhere ``available()`` names what is
missing and the benchmarks run without them. ``make`` builds one sized to a capacity in
blocks; its ``serve`` runs one prompt, so ``bench/cache_ops.py`` can time a loop of them and
``bench/policy_memory.py`` can measure what the manager holds afterwards.

What each loop does per sequence, as its engine's scheduler would:

- vLLM: a ``Request`` (its block hasher chains ``sha256`` over each full block, as vLLM's
  default ``prefix_caching_hash_algo`` does), ``get_computed_blocks``, ``allocate_slots`` for
  the tokens not cached, ``free``. Eviction is vLLM's: the free queue hands out the least
  recently freed block and drops its hash.
- SGLang: ``match_prefix``, ``inc_lock_ref``, ``evict`` when the new tokens do not fit,
  ``insert`` of the whole page-aligned key with its slot indices, ``dec_lock_ref``. The
  token-to-slot allocator is a free list of page-aligned slot ranges (SGLang's own needs a
  device pool); its cost is a slice of a list and one small tensor per prompt.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Protocol


class Baseline(Protocol):
    """One real manager sized to ``capacity`` blocks, serving whole prompts in turn."""

    def serve(self, i: int, tokens: list[int]) -> None:
        """Look up, allocate and release prompt ``i``."""


def available() -> dict[str, str | None]:
    """Baseline name -> None when it imports here, else why not."""
    out: dict[str, str | None] = {}
    for name, module in (("vllm", "vllm.v1.core.kv_cache_manager"), ("sglang", "sglang")):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        out[name] = None if found else f"{module} is not installed (run hack/bench-venv.sh)"
    return out


def make(name: str, tpb: int, capacity: int, max_len: int) -> Baseline:
    """A fresh ``name`` manager (``vllm`` or ``sglang``) of ``capacity`` blocks of ``tpb``."""
    if name == "vllm":
        return VllmManager(tpb, capacity, max_len)
    if name == "sglang":
        return SglangTree(tpb, capacity)
    raise ValueError(f"unknown baseline {name!r} (known: vllm, sglang)")


class VllmManager:
    """vLLM's scheduler-side ``KVCacheManager`` with one full-attention group."""

    def __init__(self, tpb: int, capacity: int, max_len: int) -> None:
        import torch
        from vllm import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
        )
        from vllm.v1.request import Request

        init_none_hash(sha256)
        self.request = Request
        self.hasher = get_request_block_hasher(tpb, sha256)
        self.params = SamplingParams(max_tokens=1)
        spec = FullAttentionSpec(block_size=tpb, num_kv_heads=1, head_size=8, dtype=torch.float16)
        config = KVCacheConfig(
            num_blocks=capacity + 1,  # vLLM keeps block 0 as its null block
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
        )
        self.manager = KVCacheManager(
            config,
            max_model_len=max_len,
            scheduler_block_size=tpb,
            hash_block_size=tpb,
            enable_caching=True,
        )

    def serve(self, i: int, tokens: list[int]) -> None:
        req = self.request(str(i), tokens, self.params, None, block_hasher=self.hasher)
        blocks, hit, _ = self.manager.get_computed_blocks(req)
        if self.manager.allocate_slots(req, len(tokens) - hit, hit, blocks) is None:
            raise RuntimeError(f"vLLM could not allocate prompt {i}")
        self.manager.free(req)


class _PageAllocator:
    """Slot indices for SGLang's tree, a page at a time (SGLang's own allocator needs a
    device KV pool): the free list holds page numbers."""

    def __init__(self, pages: int, page_size: int) -> None:
        import torch

        self.torch = torch
        self.device = torch.device("cpu")
        self.page_size = page_size
        self.offsets = torch.arange(page_size)
        self.free_pages = list(range(pages))

    def available_size(self) -> int:
        return len(self.free_pages) * self.page_size

    def alloc(self, num_tokens: int) -> Any:
        n = num_tokens // self.page_size
        if n > len(self.free_pages):
            return None
        pages = self.free_pages[len(self.free_pages) - n :]
        del self.free_pages[len(self.free_pages) - n :]
        starts = self.torch.tensor(pages, dtype=self.torch.int64) * self.page_size
        return (starts[:, None] + self.offsets).reshape(-1)

    def free(self, indices: Any) -> None:
        self.free_pages.extend((indices[:: self.page_size] // self.page_size).tolist())

    def free_segment(self, indices: Any, start_pos: int = 0) -> None:
        self.free(indices[start_pos:])


class SglangTree:
    """SGLang's ``RadixCache`` with pages of ``tpb`` tokens, driven as its scheduler does."""

    def __init__(self, tpb: int, capacity: int) -> None:
        import torch
        from sglang.srt.mem_cache import base_prefix_cache as base
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

        self.torch = torch
        self.base = base
        self.key = RadixKey
        self.alloc = _PageAllocator(capacity, tpb)
        self.tree = RadixCache(
            CacheInitParams(
                disable=False,
                req_to_token_pool=None,  # type: ignore[arg-type]
                token_to_kv_pool_allocator=self.alloc,  # type: ignore[arg-type]
                page_size=tpb,
            )
        )

    def serve(self, i: int, tokens: list[int]) -> None:
        tree, alloc, base = self.tree, self.alloc, self.base
        key = self.key(tokens)
        match = tree.match_prefix(base.MatchPrefixParams(key=key))
        node, hit = match.last_device_node, match.device_prefix_len
        tree.inc_lock_ref(node)
        new = len(tokens) - hit
        if new > alloc.available_size():
            tree.evict(base.EvictParams(num_tokens=new - alloc.available_size()))
        fresh = alloc.alloc(new)
        if fresh is None:
            raise RuntimeError(f"SGLang could not allocate prompt {i}")
        value = self.torch.cat([tree.path_device_indices(node), fresh]) if hit else fresh
        done = tree.insert(base.InsertParams(key=key, value=value))
        if done.prefix_len > hit:  # pages SGLang already held: free this prompt's copies
            alloc.free(fresh[: done.prefix_len - hit])
        tree.dec_lock_ref(node)

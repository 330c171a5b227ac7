"""flashinfer backend: batched prefill and decode over the paged cache on CUDA.

flashinfer is imported lazily, on the first use, so CPU-only installs never load it. Decode
batches (one query token per sequence) use ``BatchDecodeWithPagedKVCacheWrapper`` (tensor
cores for grouped queries); anything else uses ``BatchPrefillWithPagedKVCacheWrapper`` with a
causal mask aligned to the end of each sequence, which covers cached prefixes.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch

from .params import AttentionParams, AttentionPlan

__all__ = ["FlashinferBackend", "flashinfer_available", "flashinfer_unsupported"]

WORKSPACE_BYTES = 128 << 20
HEAD_DIMS = (64, 128, 256)
KV_DTYPES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn)
TENSOR_CORE_GROUP = 4
"""Query heads per KV head from which decode runs faster on tensor cores (flashinfer's advice)."""
BACKEND_ENV = "KVPOOL_FLASHINFER_BACKEND"
"""Environment variable naming flashinfer's implementation of the prefill (and tensor-core
decode) kernels: ``fa2`` (the default), ``auto`` (flashinfer's choice: FlashAttention-3 on
Hopper where it can) or ``fa3``. The GPU tests check both against the torch reference over
the engine's strided pool views (they passed on an H200 with ``fa2`` and with ``auto``); FA2
stays the default because only its speed has been measured. Each variant is compiled on first
use."""
BACKENDS = ("fa2", "auto", "fa3")
DEFAULT_BACKEND = "fa2"


def flashinfer_backend_choice() -> str:
    """``$KVPOOL_FLASHINFER_BACKEND`` (default ``fa2``); any other value is an error that
    names the allowed ones."""
    value = os.environ.get(BACKEND_ENV, DEFAULT_BACKEND)
    if value not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={value!r}: allowed values are {', '.join(BACKENDS)}")
    return value


def flashinfer_available() -> bool:
    """True when CUDA is usable and the flashinfer package is installed (not imported)."""
    return torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None


def flashinfer_unsupported(params: AttentionParams, sinks: bool = False) -> str | None:
    """Why flashinfer cannot run ``params`` here, or None when it can."""
    if params.q_dtype not in (torch.float16, torch.bfloat16):
        return f"q dtype {params.q_dtype} (flashinfer takes float16/bfloat16 queries)"
    if params.kv_dtype not in KV_DTYPES:
        return f"kv dtype {params.kv_dtype} (flashinfer reads float16/bfloat16/fp8 e4m3 caches)"
    if params.kv_dtype in (torch.float16, torch.bfloat16) and params.kv_dtype != params.q_dtype:
        return "a full-precision cache whose dtype differs from the queries'"
    if params.head_dim not in HEAD_DIMS:
        return f"head_dim {params.head_dim} (flashinfer compiles {HEAD_DIMS})"
    if params.sink_tokens:
        return "sink tokens (flashinfer has no StreamingLLM sink-token mask)"
    if sinks:
        return "per-head sink logits (flashinfer has them on Blackwell's trtllm-gen backend only)"
    if not params.causal:
        return "non-causal attention over a paged cache"
    return None


class FlashinferBackend:
    """Owns one workspace and the flashinfer wrappers planned on it, for one CUDA device.

    The cache may be a strided view (the engine's pools interleave pools of a group inside
    one arena, so the page stride exceeds one page): flashinfer reads the page, token and
    head strides from the tensor.
    """

    def __init__(self, device: torch.device) -> None:
        import flashinfer  # deferred: only CUDA machines with the gpu extra reach this

        self._fi: Any = flashinfer
        self.device = device
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._wrappers: dict[tuple[str, str, bool], Any] = {}
        self._active: Any = None
        self._plan: AttentionPlan | None = None
        self.implementation = flashinfer_backend_choice()

    def _wrapper(self, kind: str, layout: str, tensor_cores: bool) -> Any:
        key = (kind, layout, tensor_cores)
        if key not in self._wrappers:
            if kind == "decode":
                # Only the tensor-core decode runs the prefill kernels that the choice names.
                backend = self.implementation if tensor_cores else "auto"
                self._wrappers[key] = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                    self._workspace, layout, use_tensor_cores=tensor_cores, backend=backend
                )
            else:
                self._wrappers[key] = self._fi.BatchPrefillWithPagedKVCacheWrapper(
                    self._workspace, layout, backend=self.implementation
                )
        return self._wrappers[key]

    def plan(self, plan: AttentionPlan) -> None:
        """Plan flashinfer's kernels; page-table lengths are read on the host, indices moved."""
        p = plan.params
        reason = flashinfer_unsupported(p)
        if reason is not None:
            raise NotImplementedError(f"flashinfer backend: unsupported {reason}")
        table = plan.table
        indptr = table.kv_indptr.to("cpu", torch.int32)
        last = table.kv_last_page_len.to("cpu", torch.int32)
        indices = table.kv_indices.to(self.device, torch.int32)
        common: dict[str, Any] = {
            "window_left": p.window_left,
            "logits_soft_cap": p.logits_soft_cap or None,
            "sm_scale": p.sm_scale,
            "q_data_type": p.q_dtype,
            "kv_data_type": p.kv_dtype,
            "o_data_type": p.q_dtype,
        }
        if plan.is_decode:
            wrapper = self._wrapper("decode", p.layout, p.group_size >= TENSOR_CORE_GROUP)
            wrapper.plan(
                indptr, indices, last, p.num_qo_heads, p.num_kv_heads, p.head_dim,
                p.page_size, **common,
            )  # fmt: skip
        else:
            wrapper = self._wrapper("prefill", p.layout, False)
            wrapper.plan(
                plan.qo_indptr.to("cpu", torch.int32), indptr, indices, last,
                p.num_qo_heads, p.num_kv_heads, p.head_dim, p.page_size,
                causal=p.causal, **common,
            )  # fmt: skip
        self._active = wrapper
        self._plan = plan

    def run(
        self, q: torch.Tensor, kv_cache: torch.Tensor, k_scale: float, v_scale: float
    ) -> torch.Tensor:
        """Run the planned kernel; fp8 caches are dequantized in the kernel with the scales."""
        if self._active is None or self._plan is None:
            raise RuntimeError("flashinfer backend: run() before plan()")
        if kv_cache.stride(-1) != 1 or q.stride(-1) != 1:
            raise ValueError("kv_cache/q: flashinfer needs the head dim contiguous (stride 1)")
        if kv_cache.device != self.device or q.device != self.device:
            raise ValueError(f"q/kv_cache: must be on {self.device}, the device planned for")
        scales: dict[str, float] = {}
        if kv_cache.dtype == torch.float8_e4m3fn:
            scales = {"k_scale": float(k_scale), "v_scale": float(v_scale)}
        out: torch.Tensor = self._active.run(q, kv_cache, **scales)
        return out

"""``PagedAttention``: one plan()/run() API over the flashinfer and torch reference backends.

``backend="auto"`` picks flashinfer when the plan runs on CUDA, flashinfer is installed and it
supports the plan's features (see ``flashinfer_unsupported``); otherwise the torch reference.
The choice is made per ``plan()`` and reported by ``backend_in_use``.
"""

from __future__ import annotations

from typing import Literal

import torch

from .flashinfer_backend import FlashinferBackend, flashinfer_available, flashinfer_unsupported
from .layout import KvLayout, PagedKvTable, check_layout
from .params import AttentionParams, AttentionPlan
from .reference import reference_attention

__all__ = ["Backend", "PagedAttention"]

Backend = Literal["auto", "torch", "flashinfer"]


class PagedAttention:
    """Batched prefill/decode attention over one layer's paged cache at a time.

    Plan once per batch (the block tables and settings are shared by every layer with the same
    settings), then ``run`` per layer with that layer's cache tensor ``pool[layer]``.
    """

    def __init__(self, backend: Backend = "auto", layout: KvLayout = "NHD") -> None:
        if backend not in ("auto", "torch", "flashinfer"):
            raise ValueError(f"backend: must be auto, torch or flashinfer, got {backend!r}")
        self.backend: Backend = backend
        self.layout: KvLayout = check_layout(layout)
        self._flashinfer: dict[torch.device, FlashinferBackend] = {}
        self._plan: AttentionPlan | None = None
        self._use_flashinfer = False
        self._sinks: torch.Tensor | None = None
        self._device = torch.device("cpu")

    @property
    def backend_in_use(self) -> str:
        """``flashinfer`` or ``torch``: what the last ``plan()`` chose."""
        return "flashinfer" if self._use_flashinfer else "torch"

    @property
    def current_plan(self) -> AttentionPlan:
        if self._plan is None:
            raise RuntimeError("PagedAttention: run() before plan()")
        return self._plan

    def plan(
        self,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        *,
        causal: bool = True,
        window_left: int = -1,
        q_scaling: float = 1.0,
        logits_soft_cap: float = 0.0,
        sink_tokens: int = 0,
        sinks: torch.Tensor | None = None,
        q_dtype: torch.dtype = torch.float16,
        kv_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> AttentionPlan:
        """Validate the batch, choose the backend and prepare it (flashinfer's ``plan``).

        ``device`` (default: that of ``kv_indices``) is where ``run`` will get its tensors.
        ``sinks`` are per-head sink logits (float ``[num_qo_heads]``), torch backend only.
        """
        params = AttentionParams(
            num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            page_size=page_size,
            causal=causal,
            window_left=window_left,
            q_scaling=q_scaling,
            logits_soft_cap=logits_soft_cap,
            sink_tokens=sink_tokens,
            q_dtype=q_dtype,
            kv_dtype=kv_dtype if kv_dtype is not None else q_dtype,
            layout=self.layout,
        )
        if sinks is not None and tuple(sinks.shape) != (num_qo_heads,):
            raise ValueError(f"sinks: expected shape ({num_qo_heads},), got {tuple(sinks.shape)}")
        dev = _indexed(torch.device(device) if device is not None else kv_indices.device)
        table = PagedKvTable(kv_indptr, kv_indices, kv_last_page_len, page_size)
        plan = AttentionPlan(params, qo_indptr, table)
        self._use_flashinfer = self._choose_flashinfer(params, dev, sinks is not None)
        if self._use_flashinfer:
            if dev not in self._flashinfer:
                self._flashinfer[dev] = FlashinferBackend(dev)
            self._flashinfer[dev].plan(plan)
        self._plan, self._sinks, self._device = plan, sinks, dev
        return plan

    def _choose_flashinfer(self, params: AttentionParams, dev: torch.device, sinks: bool) -> bool:
        if self.backend == "torch":
            return False
        reason = flashinfer_unsupported(params, sinks)
        if dev.type != "cuda" and reason is None:
            reason = f"device {dev} (flashinfer runs on CUDA)"
        if reason is None and not flashinfer_available():
            reason = "flashinfer is not installed or CUDA is unavailable"
        if self.backend == "flashinfer" and reason is not None:
            raise NotImplementedError(f"backend flashinfer: cannot run {reason}")
        return reason is None

    def run(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        *,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """Attention output ``[tokens, qo_heads, head_dim]`` for packed ``q`` over one layer.

        ``kv_cache`` is ``pool[layer]``; ``k_scale``/``v_scale`` dequantize fp8/int8 caches.
        """
        plan = self.current_plan
        if kv_cache.dtype != plan.params.kv_dtype:
            raise ValueError(
                f"kv_cache: dtype {kv_cache.dtype} but the plan expects {plan.params.kv_dtype}"
            )
        if q.dtype != plan.params.q_dtype:
            raise ValueError(f"q: dtype {q.dtype} but the plan expects {plan.params.q_dtype}")
        if self._use_flashinfer:
            return self._flashinfer[self._device].run(q, kv_cache, k_scale, v_scale)
        return reference_attention(
            q, kv_cache, plan, k_scale=k_scale, v_scale=v_scale, sinks=self._sinks
        )


def _indexed(device: torch.device) -> torch.device:
    """``device`` with its index (``cuda`` means the current CUDA device, ``cuda:0`` say), so
    that it compares equal to the device of the tensors ``run`` is given."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device

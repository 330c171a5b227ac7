"""Per-tensor quantization of KV values for fp8 (e4m3) and int8 caches.

Follows TensorRT-LLM's convention: a cache holds ``stored = value * (1 / scale)`` and readers
compute ``value = stored * scale``, with one scale for all of K and one for all of V of a pool.
Full-precision caches (float16/bfloat16/float32) ignore the scale and store values as they are.
"""

from __future__ import annotations

import torch

__all__ = [
    "FULL_PRECISION",
    "QUANTIZED",
    "dequantize",
    "is_quantized",
    "quantize",
    "scale_for",
]

FULL_PRECISION: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32)
QUANTIZED: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.int8)
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
INT8_MAX = 127.0


def check_kv_dtype(dtype: torch.dtype) -> torch.dtype:
    """Return ``dtype`` if a cache may store it, else raise naming the allowed dtypes."""
    if dtype not in FULL_PRECISION + QUANTIZED:
        allowed = ", ".join(str(d) for d in FULL_PRECISION + QUANTIZED)
        raise ValueError(f"kv dtype: must be one of {allowed}, got {dtype}")
    return dtype


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QUANTIZED


def _check_scale(scale: float, name: str) -> float:
    scale = float(scale)
    if not scale > 0.0 or scale == float("inf"):
        raise ValueError(f"{name}: must be a positive finite number, got {scale}")
    return scale


def quantize(values: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Convert ``values`` to the cache dtype: ``values * (1 / scale)`` saturated to its range.

    fp8 rounds to nearest even (torch's cast) after clamping to +-448; int8 rounds to nearest and
    clamps to +-127 (symmetric, so that -x dequantizes to the negation of x).
    """
    check_kv_dtype(dtype)
    if not is_quantized(dtype):
        return values.to(dtype)
    inv = 1.0 / _check_scale(scale, "scale")
    scaled = values.float() * inv
    if dtype == torch.int8:
        return scaled.round().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return scaled.clamp_(-FP8_MAX, FP8_MAX).to(dtype)


def dequantize(
    stored: torch.Tensor, scale: float = 1.0, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Read cache values back as ``dtype``: ``stored * scale`` for fp8/int8, a cast otherwise."""
    if not is_quantized(stored.dtype):
        return stored.to(dtype)
    return (stored.float() * _check_scale(scale, "scale")).to(dtype)


def scale_for(values: torch.Tensor, dtype: torch.dtype, margin: float = 1.0) -> float:
    """A per-tensor scale that maps ``max |values|`` onto the top of ``dtype``'s range.

    A calibration helper for tests and benchmarks; serving uses the model's calibrated scales.
    """
    amax = float(values.detach().abs().max()) if values.numel() else 0.0
    top = INT8_MAX if dtype == torch.int8 else FP8_MAX if dtype == torch.float8_e4m3fn else 1.0
    return max(amax * margin / top, 1e-12) if is_quantized(dtype) else 1.0

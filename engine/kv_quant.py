"""What a KV cache of another dtype stores: the one place keys and values are converted to the cache's dtype.

A cache narrower than the model (`cache.dtype`) stores each key and value rounded to nearest in its dtype; an 8-bit
float cache (fp8_e4m3, fp8_e5m2) stores `x / scale` rounded, saturating at the format's largest finite value (e4m3
448, e5m2 57344) rather than storing NaN or inf, and reads back `stored * scale`. Each layer has one scale for its
keys and one for its values (MLA: one for its latent cache), as vLLM's `k_scale` / `v_scale`: calibrated from the
first prefill when `cache.calculate_kv_scales` asks, else the checkpoint's (engine.checkpoints.kv_scales), else 1.0.
Every rank holds the same scales, fixed once set, so the stored value is a function of the value alone, the same on
every rank, whatever the layout or the batch: DCP sharding, prefix caching and preemption never change what is
quantized. Attention reads the stored values in the model's dtype and computes in it; paged attention folds the
scales in (scores scaled by softmax scale x k_scale, the output by v_scale: the products of the dequantized values,
in another order).
"""

from __future__ import annotations

import torch

FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def dtype_name(dtype: torch.dtype) -> str:
    """The plan's name of a cache dtype (`cache.dtype`): fp8_e4m3 for torch.float8_e4m3fn, float32 for torch.float32."""
    return next((name for name, d in FP8_DTYPES.items() if d == dtype), str(dtype).removeprefix("torch."))


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether a cache of this dtype stores 8-bit floats."""
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def to_cache(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """`x` as the cache of `dtype` stores it: rounded to nearest; an fp8 cache stores `x / scale` (in fp32),
    saturating at its largest value."""
    if not is_fp8(dtype):
        return x.to(dtype)
    largest = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-largest, largest).to(dtype)


def dequantize(stored: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """What attention reads for a cache's `stored` values, in `dtype`: `stored * scale` (in fp32) for an fp8 cache."""
    if not is_fp8(stored.dtype):
        return stored.to(dtype)
    return (stored.float() * scale).to(dtype)


def as_stored(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """`x` in its own dtype, holding the values a cache of `dtype` gives back for it (what attention reads)."""
    return dequantize(to_cache(x, dtype, scale), x.dtype, scale)


def fp32(scale: float) -> float:
    """`scale` rounded to float32, the precision every backend stores and reads with."""
    return torch.tensor(scale, dtype=torch.float32).item()

"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels import cpu_kernels


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up] along the last dim (on CPU: one pass of the engine's kernel, same bits)."""
    kernel = x.is_cpu and x.dim() == 2 and x.stride(-1) == 1 and x.dtype in cpu_kernels.KERNEL_DTYPES
    if kernel and cpu_kernels.cpu_kernels_available():
        return cpu_kernels.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up

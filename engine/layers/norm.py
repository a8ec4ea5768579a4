"""RMSNorm (fp32 statistics, as HF computes it) with the residual add fused in."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.cpu_kernels import KERNEL_DTYPES, cpu_kernels_available
from engine.layers.linear import attach_loader, full_loader


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.eps = eps
        self.shape = (hidden,)
        self.weight = attach_loader(nn.Parameter(torch.ones(hidden), requires_grad=False), full_loader)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x), or with `residual`: (norm(x + residual), x + residual)."""
        if x.is_cpu and x.dtype in KERNEL_DTYPES and x.dtype == self.weight.dtype and cpu_kernels_available():
            out, summed = torch.ops.dcpctl.rms_norm(x, residual, self.weight, self.eps)
            return out if residual is None else (out, summed)
        if residual is None:
            return F.rms_norm(x, self.shape, self.weight, self.eps)
        x = x + residual
        return F.rms_norm(x, self.shape, self.weight, self.eps), x

"""CPU matmuls: the engine's GEMV for one or two rows, oneDNN with pre-packed weights for more.

On the CPUs we run on (AMD Zen 4 here), oneDNN with a weight reordered once at load time is
1.5-2x faster than the default BLAS path for both fp32 and bf16, at decode and prefill sizes; at
batch 1 and 2 the engine's row-streaming GEMV (cpu_kernels) reads the weights faster still
(benchmarks/RESULTS.md). The layers keep their plain weights for the GEMV, for loading and for views (MLA).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.cpu_kernels import cpu_kernels_available, gemv

_BATCH_HINT = 16  # the reorder picks a blocking for this many rows; any row count works
GEMV_MAX_ROWS = 2  # above this many rows oneDNN's packed GEMM is faster (benchmarks/gemv_roofline.py)


@functools.cache
def packing_available() -> bool:
    """True when this torch build has oneDNN's packed linear ops and they run."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        out = packed_linear(torch.ones(2, 4), pack_weight(torch.ones(4, 4)))
    except (RuntimeError, AttributeError):
        return False
    return bool(torch.equal(out, torch.full((2, 4), 4.0)))


def can_pack(weight: torch.Tensor) -> bool:
    """True for the weights oneDNN packing serves: CPU fp32/bf16 with the ops available."""
    return weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16) and packing_available()


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A copy of a [out, in] weight reordered for oneDNN (see `can_pack`)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _BATCH_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) for a 2-D x against a weight from `pack_weight`."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


class PackableLinear(nn.Module):
    """Base of the linear layers: `project` uses a packed copy of `weight` once `pack()` made one."""

    weight: nn.Parameter
    packed: torch.Tensor | None = None
    gemv_rows: int = 0  # inputs of up to this many rows take the engine's GEMV

    def pack(self) -> None:
        """Reorder the weight for oneDNN and enable the GEMV (CPU fp32/bf16 only; elsewhere a no-op)."""
        if can_pack(self.weight):
            self.packed = pack_weight(self.weight)
            if self.weight.is_contiguous() and cpu_kernels_available():
                self.gemv_rows = GEMV_MAX_ROWS

    def project(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.packed is not None and x.dim() == 2 and x.dtype == self.weight.dtype:
            if x.shape[0] <= self.gemv_rows:
                return gemv(x, self.weight, bias)
            return packed_linear(x, self.packed, bias)
        return F.linear(x, self.weight, bias)


def pack_linears(model: nn.Module) -> None:
    """Pack every linear layer of a loaded model."""
    for module in model.modules():
        if isinstance(module, PackableLinear):
            module.pack()

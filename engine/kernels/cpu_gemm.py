"""CPU matmuls: the engine's GEMV for one or two rows, a pre-packed GEMM for more (oneDNN's or the engine's).

Which GEMM a dtype takes on this CPU is `cpu_paths.gemm_choices` (from the ISA level): oneDNN with a weight
reordered once at load time is 1.5-2x faster than the default BLAS path for fp32 and, where its CPU check
allows, bf16; the engine's panel GEMM serves bf16 where oneDNN cannot. A layer whose weight a GEMM refuses
to pack (torch raises on a CPU it does not support) takes the next choice, so a wrong guess costs speed,
never a crash. At batch 1 and 2 the engine's row-streaming GEMV reads the plain weights faster than either
(docs/results/cpu-kernels.md), and prefill-sized inputs (`cpu_paths.PREFILL_MIN_ROWS` rows or more) take
`cpu_paths.prefill_gemm_choices`' first GEMM: each layer chooses per row bucket once, at `pack()`, and `project`
compares the row count with the bounds. The layers keep their plain weights for the GEMV, for loading and for
views (MLA).
"""

from __future__ import annotations

import collections
import functools
import logging
import sys

import torch
import torch.nn.functional as F
from torch import nn

from engine import kv_quant
from engine.kernels.cpu_isa import detect
from engine.kernels.cpu_kernels import (
    cpu_kernels_available,
    gemv,
    kernel_isa,
    loaded_build,
    pack_panels,
    panel_linear,
    prefill_bf16_products,
)
from engine.kernels.cpu_paths import (
    GEMM_NAMES,
    GEMV_MAX_ROWS,
    KERNEL_DTYPE_NAMES,
    PREFILL_MIN_ROWS,
    bf16_prefill_attention,
    decode_path,
    describe_paths,
    gemm_choices,
    gemm_name,
    prefill_gemm_choices,
    requested_bf16_gemm,
)

_BATCH_HINT = 16  # the reorder picks a blocking for this many rows; any row count works
_log = logging.getLogger(__name__)


@functools.cache
def packing_available() -> bool:
    """True when this torch build has oneDNN's packed linear ops and they run (fp32)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        out = packed_linear(torch.ones(2, 4), pack_weight(torch.ones(4, 4)))
    except (RuntimeError, AttributeError):
        return False
    return bool(torch.equal(out, torch.full((2, 4), 4.0)))


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A copy of a [out, in] weight reordered for oneDNN (raises where oneDNN cannot pack the dtype here)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _BATCH_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) for a 2-D x against a weight from `pack_weight`."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


@functools.cache
def _warn_refused(gemm: str, dtype: str, reason: str) -> None:
    _log.warning("%s refused to pack %s weights here (%s); the next choice is used", gemm, dtype, reason)


def _pack_for(gemm: str, weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` packed for `gemm`, or None when that GEMM cannot take it here."""
    if gemm == "onednn" and packing_available():
        try:
            return pack_weight(weight)
        except RuntimeError as exc:  # e.g. bf16 on a CPU without AVX-512: "... needs the cpu support ..."
            _warn_refused("oneDNN", str(weight.dtype).removeprefix("torch."), str(exc).strip().splitlines()[0])
    elif gemm == "panels":
        return pack_panels(weight)
    return None


class PackableLinear(nn.Module):
    """Base of the linear layers: `project` takes the GEMV or the GEMM that `pack()` chose for the row count."""

    weight: nn.Parameter
    packed: torch.Tensor | None = None
    gemm: str = "torch"  # what inputs of more than `gemv_rows` rows take: onednn, panels or torch (F.linear)
    gemv_rows: int = 0  # inputs of up to this many rows take the engine's GEMV
    prefill_rows: int = sys.maxsize  # inputs of at least this many rows take `prefill_gemm` (when it differs)
    prefill_gemm: str = "torch"
    prefill_packed: torch.Tensor | None = None

    def pack(self) -> None:
        """Pack the weight for this CPU's GEMMs and enable the GEMV (CPU fp32/bf16 only; elsewhere a no-op)."""
        weight = self.weight
        dtype = str(weight.dtype).removeprefix("torch.")
        if weight.device.type != "cpu" or dtype not in KERNEL_DTYPE_NAMES:
            return
        isa, kernels, bf16_gemm = detect(), cpu_kernels_available(), requested_bf16_gemm()
        tried: dict[str, torch.Tensor | None] = {}  # both buckets share a packing, and try a refusing GEMM once
        self.gemm, self.packed = _first_packed(gemm_choices(isa, dtype, kernels, bf16_gemm), weight, tried)
        choices = prefill_gemm_choices(isa, dtype, kernels, bf16_gemm)
        self.prefill_gemm, self.prefill_packed = _first_packed(choices, weight, tried)
        if self.prefill_gemm != self.gemm:
            self.prefill_rows = PREFILL_MIN_ROWS
        if weight.is_contiguous() and kernels:
            self.gemv_rows = GEMV_MAX_ROWS

    def project(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() == 2 and x.dtype == self.weight.dtype:
            rows = x.shape[0]
            if rows <= self.gemv_rows:
                return gemv(x, self.weight, bias)
            if rows >= self.prefill_rows:
                return _run(self.prefill_gemm, x, self.prefill_packed, self.weight, bias)
            return _run(self.gemm, x, self.packed, self.weight, bias)
        return F.linear(x, self.weight, bias)


def _first_packed(
    choices: tuple[str, ...], weight: torch.Tensor, tried: dict[str, torch.Tensor | None]
) -> tuple[str, torch.Tensor | None]:
    """The first of `choices` that takes `weight` here, with the weight packed for it; `tried` keeps each GEMM's
    packing (None: refused, or F.linear's plain weight) for the next call."""
    for gemm in choices:
        if gemm not in tried:
            tried[gemm] = None if gemm == "torch" else _pack_for(gemm, weight)
        if tried[gemm] is not None or gemm == "torch":
            return gemm, tried[gemm]
    return "torch", None


def _run(gemm: str, x: torch.Tensor, packed: torch.Tensor | None, weight: torch.Tensor, bias) -> torch.Tensor:
    """x @ weight.T (+ bias) on `gemm`, with `packed` the weight packed for it."""
    if gemm == "panels":
        return panel_linear(x, packed, weight.shape, bias)
    if gemm == "onednn":
        return packed_linear(x, packed, bias)
    return F.linear(x, weight, bias)


def pack_linears(model: nn.Module) -> dict[tuple[str, str], int]:
    """Pack every linear layer of a loaded model; how many layers took each (GEMM, prefill GEMM) pair."""
    taken: collections.Counter[tuple[str, str]] = collections.Counter()
    for module in model.modules():
        if isinstance(module, PackableLinear):
            module.pack()
            taken[module.gemm, module.prefill_gemm] += 1
    return dict(taken)


def _layer_counts(counts: collections.Counter[str], dtype: str) -> str:
    isa = kernel_isa() or detect()  # the panel GEMM is the loaded build's
    return ", ".join(f"{gemm_name(g, isa, dtype)} ({n} layers)" for g, n in sorted(counts.items()))


def cpu_paths_line(dtype: torch.dtype, gemms: dict[tuple[str, str], int], backend, cache_dtype: torch.dtype) -> str:
    """What a CPU rank actually runs, for the start-up log: the ISA level, the loaded kernel build, the GEMMs
    the linear layers took (from `pack_linears`), by row count, and the decode attention (on a `cache_dtype` cache)."""
    name = str(dtype).removeprefix("torch.")
    batched, prefill = collections.Counter(), collections.Counter()
    for (gemm, prefill_gemm), n in gemms.items():
        batched[gemm] += n
        if prefill_gemm != gemm:
            prefill[prefill_gemm] += n
    taken = _layer_counts(batched, name) or GEMM_NAMES["torch"]
    cache = kv_quant.dtype_name(cache_dtype)
    decode = decode_path(getattr(backend, "kernels", False), backend.name, {name, cache})
    build = loaded_build() or "unavailable, torch's kernels"
    kernels = cpu_kernels_available()
    gemv = kernels and name in KERNEL_DTYPE_NAMES
    products = prefill_bf16_products()[0] if kernels else "fp32"
    attention = bf16_prefill_attention(getattr(backend, "kernels", False), backend.name, name, products)
    return describe_paths(detect(), build, name, taken, gemv, decode, _layer_counts(prefill, name) or None, attention)

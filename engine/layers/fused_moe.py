"""Routed experts as two Triton grouped GEMMs over the tokens sorted by expert (the CUDA path of `Experts`).

Each (token, k) routing pair is one row. The rows are sorted by expert and each expert's run is padded to a
multiple of BLOCK_M, so that every M-tile of the sorted order belongs to one expert (vLLM's moe_align_block_size);
the padding is bounded by the shape alone, so the whole path has static sizes and no host sync (a CUDA graph can
hold it). Kernel 1 multiplies each tile by its expert's gate and up rows and writes silu(gate) * up; kernel 2
multiplies that by the expert's down weights and scales by the routing weight; the K rows of a token are then
summed. Each expert's weights are read once per tile of its rows: at decode, once per step for each routed expert.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import triton
import triton.language as tl

from engine.kernels.triton_modes import interpreted, jit_bodies


def _gate_up_kernel(
    X, W13, ROWS, TILE_EXPERT, OUT,
    num_rows, top_k, inter, hidden,
    stride_xt, stride_xh, stride_we, stride_wn, stride_wh, stride_or, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # program (M-tile of sorted rows, N-tile of the intermediate dim): OUT[row] = silu(x W_gate^T) * (x W_up^T)
    expert = tl.load(TILE_EXPERT + tl.program_id(0))
    if expert < 0:  # a tile past the padded rows
        return
    row = tl.load(ROWS + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = row < num_rows
    token = tl.where(row_ok, row // top_k, 0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < inter
    w = W13 + expert.to(tl.int64) * stride_we
    gate = tl.full([BLOCK_M, BLOCK_N], 0.0, dtype=tl.float32)
    up = tl.full([BLOCK_M, BLOCK_N], 0.0, dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < hidden
        a = tl.load(X + token[:, None] * stride_xt + k[None, :] * stride_xh, mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)  # fmt: skip
        w_mask = k_ok[:, None] & n_ok[None, :]
        wg = tl.load(w + n[None, :] * stride_wn + k[:, None] * stride_wh, mask=w_mask, other=0.0)
        wu = tl.load(w + (n + inter)[None, :] * stride_wn + k[:, None] * stride_wh, mask=w_mask, other=0.0)
        if DOT_F32:
            a, wg, wu = a.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        gate += tl.dot(a, wg, input_precision=PRECISION)
        up += tl.dot(a, wu, input_precision=PRECISION)
    out = gate / (1.0 + tl.exp(-gate)) * up
    o_ptr = OUT + row.to(tl.int64)[:, None] * stride_or + n[None, :] * stride_on
    tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def _down_kernel(
    H, W2, ROWS, TILE_EXPERT, WEIGHTS, OUT,
    num_rows, inter, hidden,
    stride_hr, stride_hk, stride_we, stride_wn, stride_wk, stride_or, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # program (M-tile of sorted rows, N-tile of the hidden dim): OUT[row] = weight[row] * (H[row] W_down^T)
    expert = tl.load(TILE_EXPERT + tl.program_id(0))
    if expert < 0:
        return
    row = tl.load(ROWS + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = row < num_rows
    r64 = tl.where(row_ok, row, 0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < hidden
    w = W2 + expert.to(tl.int64) * stride_we
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < inter
        a = tl.load(H + r64[:, None] * stride_hr + k[None, :] * stride_hk, mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)  # fmt: skip
        b = tl.load(w + n[None, :] * stride_wn + k[:, None] * stride_wk, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if DOT_F32:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc += tl.dot(a, b, input_precision=PRECISION)
    acc = acc * tl.load(WEIGHTS + r64, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    o_ptr = OUT + r64[:, None] * stride_or + n[None, :] * stride_on
    tl.store(o_ptr, acc.to(OUT.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


_BODIES = {"gate_up": _gate_up_kernel, "down": _down_kernel}


@functools.cache
def _kernels(interpret: bool) -> SimpleNamespace:
    return jit_bodies(_BODIES, interpret)


@dataclass(frozen=True)
class MoETiles:
    """Tiling: rows per tile (the padding unit of each expert's run), output and reduction columns, warps, stages."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


def default_tiles(rows: int, num_experts: int, interpret: bool) -> MoETiles:
    """Decode (few rows per expert): 16-row tiles, so padding wastes little; many rows per expert: 64."""
    if interpret:
        return MoETiles(16, 32, 32)
    if rows <= 4 * num_experts:
        return MoETiles(16, 64, 128, num_warps=4, num_stages=4)
    return MoETiles(64, 64, 64, num_warps=4, num_stages=3)


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted, padded row order of the routing pairs ids [T, K] (row t*K + k): `rows` [P] (padding: T*K) and the
    expert of each BLOCK_M-tile of it, `tile_expert` [P / block_m] (-1 past the last padded run).

    P = T*K + min(E, T*K) * (block_m - 1), rounded up to block_m: the most padding any routing can need, so the
    sizes depend on the shape only (no sync, graph-capturable).
    """
    flat = ids.flatten()
    n = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int64))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    run_start = counts.cumsum(0) - counts
    dest = (pad_end - padded)[expert_of] + torch.arange(n, device=ids.device) - run_start[expert_of]
    size = triton.cdiv(n + min(num_experts, n) * (block_m - 1), block_m) * block_m
    rows = torch.full((size,), n, dtype=torch.int64, device=ids.device).scatter_(0, dest, order)
    tile_start = torch.arange(0, size, block_m, device=ids.device)
    tile_expert = torch.searchsorted(pad_end, tile_start, right=True)
    return rows, torch.where(tile_expert < num_experts, tile_expert, -1)


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    tiles: MoETiles | None = None,
) -> torch.Tensor:
    """sum_k weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)) with e = ids[t, k], as `Experts` computes it.

    x [T, H]; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I]; weights [T, K] fp32; ids [T, K].
    Returns [T, H] in x's dtype (fp32 accumulation; the K rows of a token are summed in fp32).
    """
    tokens, hidden = x.shape
    top_k = ids.shape[1]
    num_experts, inter = w13.shape[0], w2.shape[2]
    if tokens == 0:
        return torch.zeros_like(x)
    interp = interpreted(x)
    t = tiles or default_tiles(tokens * top_k, num_experts, interp)
    rows, tile_expert = align_by_expert(ids, num_experts, t.block_m)
    n = tokens * top_k
    dot_f32 = interp or x.dtype == torch.float32
    precision = "ieee" if x.dtype == torch.float32 or interp else None
    extra = {} if interp else {"num_warps": t.num_warps, "num_stages": t.num_stages}
    kern = _kernels(interp)
    act = torch.empty(n, inter, dtype=x.dtype, device=x.device)
    grid = (tile_expert.numel(), triton.cdiv(inter, t.block_n))
    kern.gate_up[grid](
        x, w13, rows, tile_expert, act, n, top_k, inter, hidden,
        *x.stride(), *w13.stride(), *act.stride(),
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, DOT_F32=dot_f32, PRECISION=precision, **extra,
    )  # fmt: skip
    out = torch.empty(n, hidden, dtype=torch.float32, device=x.device)
    grid = (tile_expert.numel(), triton.cdiv(hidden, t.block_n))
    kern.down[grid](
        act, w2, rows, tile_expert, weights.reshape(-1), out, n, inter, hidden,
        *act.stride(), *w2.stride(), *out.stride(),
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, DOT_F32=dot_f32, PRECISION=precision, **extra,
    )  # fmt: skip
    return out.view(tokens, top_k, hidden).sum(dim=1).to(x.dtype)

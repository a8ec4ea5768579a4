"""Attention over a DCP-sharded KV cache: attend locally, then merge the partials by LSE into each rank's slice.

Every rank of a DCP group attends the queries of its group's A heads (gathered from its query group first when the
placement computes only its own heads) to its local KV shard: a partial output [T, A, Dv] and its log-sum-exp
[T, A]. The combine hands DCP rank j the merged columns [merge_starts[j], merge_starts[j] + W) of the flattened
[A * Dv] output (engine.placement), each column weighted by the LSEs of its head:
    lse = logsumexp_r(lse_r);  out = sum_r exp(lse_r - lse) * out_r
Two ways to move the partials (`parallel.dcp_comm_backend`, vLLM's and SGLang's names):
- ag_rs: all-gather the LSEs, weight the partials, reduce-scatter the columns (2 collectives);
- a2a: one all-to-all of each destination's columns with this rank's fp32 LSEs bit-packed behind them; each rank
  merges its own slice (1 collective).
A rank without tokens for a row has LSE -inf and contributes exactly 0 (even if its partial were NaN); a row empty
everywhere yields 0, never NaN.
"""

from __future__ import annotations

import torch

from engine.attention.backend import AttentionBackend, PagedKV
from engine.distributed import ParallelContext, all_gather_rows, all_to_all_rows, reduce_scatter_rows


def _finite(lse: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def merge_weights(lse_a: torch.Tensor, lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights exp(lse_x - lse) of two partial attentions over disjoint key sets, lse = logaddexp(lse_a, lse_b),
    [T, X] each: the softmax-exact merge is w_a * out_a + w_b * out_b (0, never NaN, for a row empty on both sides)."""
    base = _finite(torch.logaddexp(lse_a, lse_b))
    return torch.exp(lse_a - base), torch.exp(lse_b - base)


class CombineSpec:
    """What one rank of one attention layer gathers, attends and merges; built once, when the model is built."""

    def __init__(self, par: ParallelContext, device: torch.device | None = None):
        share = par.placement
        self.dcp_group, self.query_group = par.dcp_group, par.query_group
        self.size = len(share.merge_starts)
        self.backend = par.comm_backend
        self.heads, self.value_dim, self.width = len(share.attended), share.value_dim, share.merge_width
        self.gather = len(share.attended) // len(share.q_heads)  # query-group ranks whose heads are gathered
        width = torch.arange(self.width, device=device)
        starts = share.merge_starts
        # destination j's columns of the flattened [A * Dv] output; None when they are the j-th W columns (a view)
        consecutive = starts == tuple(j * self.width for j in range(self.size))
        whole = self.size * self.width == self.heads * self.value_dim
        self.columns = None if consecutive and whole else (torch.tensor(starts, device=device)[:, None] + width)
        self.head_of_col = (share.merge_start + width) // self.value_dim  # this rank's columns -> attended head

    def by_destination(self, flat: torch.Tensor) -> torch.Tensor:
        """[T, A * Dv] -> [D, T, W]: the columns each DCP rank merges (a view when they are consecutive)."""
        tokens = flat.shape[0]
        if self.columns is None:
            return flat.view(tokens, self.size, self.width).transpose(0, 1)
        return flat.index_select(1, self.columns.reshape(-1)).view(tokens, self.size, self.width).transpose(0, 1)


def combine(out: torch.Tensor, lse: torch.Tensor, spec: CombineSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge every DCP rank's partial out [T, A, Dv] / lse [T, A] into this rank's columns [T, W] (out's dtype);
    also returns the merged per-head LSE [T, A]. A collective over the DCP group: every member calls it."""
    return (_combine_a2a if spec.backend == "a2a" else _combine_ag_rs)(out, lse, spec)


def _combine_ag_rs(out: torch.Tensor, lse: torch.Tensor, spec: CombineSpec) -> tuple[torch.Tensor, torch.Tensor]:
    lse_all = all_gather_rows(lse.unsqueeze(0), spec.dcp_group)  # [D, T, A]
    lse_total = torch.logsumexp(lse_all, dim=0)
    w = torch.exp(lse - _finite(lse_total)).unsqueeze(-1)
    weighted = torch.where(w > 0, out.float() * w, 0.0)
    send = spec.by_destination(weighted.view(out.shape[0], -1))
    return reduce_scatter_rows(send.contiguous(), spec.dcp_group)[0].to(out.dtype), lse_total


def _combine_a2a(out: torch.Tensor, lse: torch.Tensor, spec: CombineSpec) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, width = out.shape[0], spec.width
    packed = lse.contiguous().view(out.dtype)  # the fp32 bits of the LSEs, as out.dtype elements
    send = out.new_empty(spec.size, tokens, width + packed.shape[1])
    send[..., :width] = spec.by_destination(out.reshape(tokens, -1))
    send[..., width:] = packed
    recv = all_to_all_rows(send, spec.dcp_group)  # [D, T, W + packed]: source r's partial of my columns
    lse_all = recv[..., width:].contiguous().view(torch.float32)  # [D, T, A]
    lse_total = torch.logsumexp(lse_all, dim=0)
    w = torch.exp(lse_all - _finite(lse_total)).index_select(2, spec.head_of_col)  # [D, T, W]
    merged = torch.where(w > 0, recv[..., :width].float() * w, 0.0).sum(0)
    return merged.to(out.dtype), lse_total


def attend_cache(
    backend: AttentionBackend,
    spec: CombineSpec,
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor | None,
    kv: PagedKV,
    scale: float,
    need_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of q [T, Hq, Dk] to the whole (DCP-sharded) cached context: this rank's merged columns [T, W] and,
    when `need_lse`, the LSE of each attended head [T, A] (`spec.head_of_col` maps the columns to those heads)."""
    tokens, heads, _ = q.shape
    if spec.gather > 1:  # [gather * T, Hq, Dk] -> [T, gather * Hq, Dk], heads of query-group rank i at slot i
        q = (
            all_gather_rows(q, spec.query_group)
            .view(spec.gather, tokens, heads, -1)
            .transpose(0, 1)
            .reshape(tokens, spec.gather * heads, -1)
        )
    out, lse = backend.paged(q, key_cache, value_cache, spec.value_dim, kv, scale)
    if spec.size == 1:
        return out.reshape(tokens, -1), lse if need_lse else None
    merged, lse_total = combine(out, lse, spec)
    return merged, lse_total if need_lse else None

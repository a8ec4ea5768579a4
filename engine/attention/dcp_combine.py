"""Attention over a sharded KV cache: gather queries across the DCP group, attend locally, merge by LSE.

With a DCP group of D ranks of which `q_span` hold distinct query heads (the rest are replicas):
every rank attends the group's queries to its local shard, the log-sum-exps are gathered,
`lse = logsumexp_r(lse_r)`, each partial is weighted by `exp(lse_r - lse)`, and the sums are
scattered back so each rank keeps its own heads. A rank without tokens for a row has lse -inf and
contributes exactly 0; a row empty everywhere yields 0, never NaN.
"""

from __future__ import annotations

import torch

from engine.attention.backend import AttentionBackend, PagedKV
from engine.distributed import ParallelContext, all_gather_rows, all_reduce, reduce_scatter_rows


def _finite(lse: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def merge_attention(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax-exact merge of two partial attentions over disjoint key sets. out [T, H, Dv], lse [T, H]."""
    lse = torch.logaddexp(lse_a, lse_b)
    base = _finite(lse)
    w_a = torch.exp(lse_a - base).unsqueeze(-1)
    w_b = torch.exp(lse_b - base).unsqueeze(-1)
    return (out_a.float() * w_a + out_b.float() * w_b).to(out_a.dtype), lse


def attend_cache(
    backend: AttentionBackend,
    par: ParallelContext,
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor | None,
    value_dim: int,
    kv: PagedKV,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [T, H, Dk] to the whole (DCP-sharded) cached context; returns (out, lse) for q's heads."""
    if par.dcp_size == 1:
        return backend.paged(q, key_cache, value_cache, value_dim, kv, scale)
    tokens, heads, _ = q.shape
    span = par.q_span
    if span > 1:  # [span * T, H, Dk] -> [T, span * H, Dk], heads of query-group rank i at slot i
        q = (
            all_gather_rows(q, par.query_group)
            .view(span, tokens, heads, -1)
            .transpose(0, 1)
            .reshape(tokens, span * heads, -1)
        )
    out, lse = backend.paged(q, key_cache, value_cache, value_dim, kv, scale)
    lse_all = all_gather_rows(lse.unsqueeze(0), par.dcp_group)  # [D, T, span * H]
    lse_total = torch.logsumexp(lse_all, dim=0)
    weighted = out.float() * torch.exp(lse - _finite(lse_total)).unsqueeze(-1)
    weighted = weighted.view(tokens, span, heads, -1).transpose(0, 1).contiguous()  # [span, T, H, Dv]
    if span == par.dcp_size:
        mine = reduce_scatter_rows(weighted, par.dcp_group)[0]
    else:
        mine = all_reduce(weighted, par.dcp_group)[par.q_rank]
    lse_mine = lse_total.view(tokens, span, heads)[:, par.q_rank]
    return mine.to(q.dtype), lse_mine

"""The paged, DCP-aware attention layer: write this rank's tokens to the cache, then attend.

Prefill chunks attend causally to their own new tokens (all in hand) and, when they have cached
context, to that context through the DCP path; the two parts merge by LSE. Decoding tokens are
already in the cache (written first) and attend to it through the DCP path.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention.backend import current_metadata
from engine.attention.dcp_combine import attend_cache, merge_attention
from engine.distributed import get_parallel


class PagedAttention(nn.Module):
    """Attention of this rank's query heads. q [N, H, Dk], k [N, Hkv, Dk], v [N, Hkv, Dv] (MLA: v = k[..., :Dv])."""

    def __init__(
        self, num_heads: int, num_kv_heads: int, key_dim: int, value_dim: int, scale: float, value_in_key: bool = False
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.key_dim, self.value_dim = key_dim, value_dim
        self.scale = scale
        self.value_in_key = value_in_key
        self.key_cache: torch.Tensor | None = None
        self.value_cache: torch.Tensor | None = None  # None for MLA: values live inside the key cache

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        md = current_metadata()
        backend, par = md.backend, get_parallel()
        backend.write_cache(k, None if self.value_in_key else v, self.key_cache, self.value_cache, md)
        prefill_tokens = md.num_prefill_tokens
        decoded = None
        if md.decode is not None:
            decoded, _ = attend_cache(
                backend,
                par,
                q[prefill_tokens:],
                self.key_cache,
                self.value_cache,
                self.value_dim,
                md.decode,
                self.scale,
            )
        if md.prefill is None:  # a decode-only step: no copy into a joint output
            return decoded
        out = q.new_empty(q.shape[0], self.num_heads, self.value_dim)
        qp = q[:prefill_tokens]
        o, lse = backend.prefill_new(
            qp, k[:prefill_tokens], v[:prefill_tokens], md.prefill, self.scale, need_lse=md.prefill_context is not None
        )
        if md.prefill_context is not None:
            oc, lse_c = attend_cache(
                backend, par, qp, self.key_cache, self.value_cache, self.value_dim, md.prefill_context, self.scale
            )
            o, _ = merge_attention(o, lse, oc, lse_c)
        out[:prefill_tokens] = o
        if decoded is not None:
            out[prefill_tokens:] = decoded
        return out

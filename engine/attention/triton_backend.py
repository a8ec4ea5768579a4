"""The Triton backend: KV store, split-KV paged attention and varlen causal prefill as Triton kernels.

CUDA tensors run compiled kernels; CPU tensors run them in the Triton interpreter (tests, CPU plans: slow),
chosen per launch by the tensors' device, whatever was imported before.
"""

from __future__ import annotations

import torch

from engine import kv_quant
from engine.attention import triton_kernels as kernels
from engine.attention.backend import AttentionBackend, AttentionMetadata, PagedKV, PrefillNew


class TritonBackend(AttentionBackend):
    name = "triton"

    def prepare(self, metadata: AttentionMetadata) -> None:
        """Host-side facts the launchers need, once per step: rows per sequence (grid size) without a sync."""
        for kv in (metadata.prefill_context, metadata.decode):
            if kv is not None:
                kv.extra["max_queries"] = max(kv.query_counts, default=0)

    def write_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor | None,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor | None,
        metadata: AttentionMetadata,
        scales: tuple[float, float] = (1.0, 1.0),
    ) -> None:
        if kv_quant.is_fp8(key_cache.dtype):  # torch's scaling, rounding and saturation; the kernel copies the bytes
            key = kv_quant.to_cache(key, key_cache.dtype, scales[0])
            value = None if value is None else kv_quant.to_cache(value, key_cache.dtype, scales[1])
        kernels.store_kv(key, value, key_cache, value_cache, metadata.slot_mapping)

    def prefill_new(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefill: PrefillNew, scale: float, need_lse: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        out, lse = kernels.prefill_attention(q, k, v, prefill.cu_seqlens, prefill.max_len, scale)
        return out, lse if need_lse else None

    def paged(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor | None,
        value_dim: int,
        kv: PagedKV,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        max_queries = kv.extra.get("max_queries")
        if max_queries is None:
            max_queries = max(kv.query_counts, default=0)
        return kernels.paged_attention(
            q,
            key_cache,
            value_cache,
            value_dim,
            kv.block_tables,
            kv.lens,
            kv.query_start,
            max_queries,
            kv.max_len,
            scale,
        )

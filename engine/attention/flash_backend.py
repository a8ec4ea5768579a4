"""The flash-attn backend (CUDA, optional extra): flash-attn 2 kernels for GQA models, Triton for the rest.

Prefill of new tokens uses `flash_attn_varlen_func` (causal, with its log-sum-exp); decode uses
`flash_attn_with_kvcache` on the paged cache (block table, cache_seqlens = the DCP local lengths,
`return_softmax_lse`), and cached-context rows of prefill chunks use `flash_attn_varlen_func` with a block
table. MLA layers (values inside the latent key cache, key dim 576 > flash-attn's 256) and the KV store use
the Triton kernels. flash-attn's paged KV needs a block size that is a multiple of 256, and fp16/bf16.
The layers' cache views are block-major across layers (`kv_cache`): flash-attn takes the paged cache's block
stride from `stride(0)` and needs only the last dimension contiguous, as vLLM's cross-layer KV layout relies on.
"""

from __future__ import annotations

import importlib.util

import torch

from engine.attention.backend import AttentionMetadata, PagedKV, PrefillNew
from engine.attention.triton_backend import TritonBackend
from engine.errors import UserError

FLASH_BLOCK_MULTIPLE = 256  # flash-attn 2: "page_block_size must be a multiple of 256"
FLASH_MAX_HEAD_DIM = 256
FLASH_DTYPES = (torch.float16, torch.bfloat16)


def _import_flash():
    if not torch.cuda.is_available():
        raise UserError("attention.backend=flash_attn needs CUDA (no GPU is visible); use torch or triton")
    if importlib.util.find_spec("flash_attn") is None:
        raise UserError(
            "attention.backend=flash_attn needs the flash-attn package (pip install 'dcpctl[gpu]'); or use triton"
        )
    try:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
    except ImportError as exc:  # a wheel built for another torch / CUDA fails here, not at find_spec
        raise UserError(f"attention.backend=flash_attn: flash-attn does not import ({exc}); or use triton") from None
    return flash_attn_varlen_func, flash_attn_with_kvcache


class FlashAttnBackend(TritonBackend):
    name = "flash_attn"

    def __init__(self) -> None:
        self._varlen, self._with_kvcache = _import_flash()

    def prepare(self, metadata: AttentionMetadata) -> None:
        """int32 copies of the tables, lengths and offsets flash-attn takes, made once per step."""
        super().prepare(metadata)
        for kv in (metadata.prefill_context, metadata.decode):
            if kv is None:
                continue
            kv.extra["flash_tables"] = kv.block_tables.to(torch.int32)
            kv.extra["flash_lens"] = kv.lens.to(torch.int32)
            empty = kv.lens == 0
            if kv.one_query_each:
                kv.extra["flash_rows_empty"] = empty
            else:
                cu_k = torch.zeros(kv.lens.numel() + 1, dtype=torch.int32, device=kv.lens.device)
                torch.cumsum(kv.lens, 0, out=cu_k[1:])
                kv.extra["flash_cu_q"] = kv.query_start.to(torch.int32)
                kv.extra["flash_cu_k"] = cu_k
                counts = torch.tensor(kv.query_counts, device=empty.device)
                kv.extra["flash_rows_empty"] = torch.repeat_interleave(empty, counts)

    @staticmethod
    def _uses_flash(q: torch.Tensor, value_dim: int, values_in_key: bool) -> bool:
        """GQA layers go to flash-attn (a UserError if their dtype cannot); MLA and head dims > 256 to Triton."""
        if values_in_key or q.shape[-1] != value_dim or value_dim > FLASH_MAX_HEAD_DIM:
            return False
        if q.dtype not in FLASH_DTYPES:
            raise UserError(
                f"attention.backend=flash_attn needs model.dtype bfloat16 or float16 (got {str(q.dtype)[6:]}); "
                "or use triton"
            )
        return True

    @staticmethod
    def _check_block_size(key_cache: torch.Tensor) -> None:
        block_size = key_cache.shape[1]
        if block_size % FLASH_BLOCK_MULTIPLE:
            raise UserError(
                f"attention.backend=flash_attn needs cache.block_size to be a multiple of {FLASH_BLOCK_MULTIPLE} "
                f"for flash-attn's paged KV (got {block_size}); set cache.block_size=256 or use triton"
            )

    def prefill_new(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefill: PrefillNew, scale: float, need_lse: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self._uses_flash(q, v.shape[-1], values_in_key=False):
            return super().prefill_new(q, k, v, prefill, scale, need_lse)
        cu = prefill.cu_seqlens.to(torch.int32)
        out, lse, _ = self._varlen(
            q, k, v, cu, cu, prefill.max_len, prefill.max_len, softmax_scale=scale, causal=True, return_attn_probs=True
        )
        return out, lse.transpose(0, 1).float() if need_lse else None  # flash-attn: lse [H, T]

    def paged(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor | None,
        value_dim: int,
        kv: PagedKV,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._uses_flash(q, value_dim, values_in_key=value_cache is None):
            return super().paged(q, key_cache, value_cache, value_dim, kv, scale)
        self._check_block_size(key_cache)
        if key_cache.dtype != q.dtype:
            raise UserError(
                "attention.backend=flash_attn needs cache.dtype equal to model.dtype "
                f"(cache {str(key_cache.dtype)[6:]}, model {str(q.dtype)[6:]}); or use triton"
            )
        if "flash_tables" not in kv.extra:
            raise RuntimeError("FlashAttnBackend.paged ran on metadata that its prepare() did not see")
        tables, lens, rows_empty = kv.extra["flash_tables"], kv.extra["flash_lens"], kv.extra["flash_rows_empty"]
        if kv.one_query_each:
            out, lse = self._with_kvcache(
                q.unsqueeze(1),
                key_cache,
                value_cache,
                cache_seqlens=lens,
                block_table=tables,
                softmax_scale=scale,
                causal=False,
                return_softmax_lse=True,
            )
            out, lse = out[:, 0], lse[:, :, 0]  # [S, 1, H, D] / [S, H, 1]
        else:
            out, lse, _ = self._varlen(
                q,
                key_cache,
                value_cache,
                kv.extra["flash_cu_q"],
                kv.extra["flash_cu_k"],
                kv.extra["max_queries"],
                max(kv.max_len, 1),
                softmax_scale=scale,
                causal=False,
                return_attn_probs=True,
                block_table=tables,
            )
            lse = lse.transpose(0, 1)  # flash-attn varlen: lse [H, T]
        # flash-attn reports a row without keys as lse +inf (and output 0); the DCP merge needs -inf and 0
        lse = torch.where(rows_empty.unsqueeze(1), float("-inf"), lse.float())
        out = torch.where(rows_empty.view(-1, 1, 1), 0.0, out).to(q.dtype)
        return out, lse

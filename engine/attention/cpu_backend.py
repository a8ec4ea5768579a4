"""The CPU backend: the torch reference, with the per-token work of decode in the engine's C++ kernels.

The KV store and single-query decode attention (`cpu_kernels.store_kv` / `paged_decode`) work on the
layers' cache views in place: no gathered copy of each sequence's keys and values per layer, and one
op instead of a dozen. A layer that hands over its unrotated q, k and v heads gets rotary and the KV store
in one op (`cpu_kernels.rotary_store_kv`). A prefill's attention among its new tokens is one op per layer for all
its prompts (`cpu_kernels.prefill_causal`: GQA without repeating keys, any head sizes, MLA's latent values included)
instead of a CPU flash call per prompt. In bfloat16 on a CPU with AMX its two products per key block are oneDNN
brgemm calls (AMX tiles), faster than torch's CPU flash attention at every prompt length measured on a Sapphire
Rapids Xeon, 2 threads (benchmarks/cpu_prefill_attention.py, per layer, torch's flash / the kernel: 1.95 / 1.16 ms
at 16x128 tokens, 2.64 / 2.03 at 8x256, 3.87 / 2.45 at 4x512, 2.53 / 2.27 at 1x1024, 10.9 / 9.0 at 4x1000); fp32,
and bf16 on CPUs without AMX, run its vector path (fp32 on that Xeon: faster than torch's flash at every shape).
Without DCP, a chunk that continues a cached prompt (chunked prefill, prefix cache) attends to its cached context and
to its new tokens in the same kernel call (`prefill_in_context`: the context's keys and values read from the paged
cache as the kernel packs them), instead of a torch flash call over a gathered copy of the context and a merge of the
two by LSE; with DCP the context is sharded and goes through the DCP path. Other multi-query context attention stays
on the torch backend's path, as does everything when the kernels cannot be built
here (`cpu_kernels_available`) or the model or cache dtype is one they do not take (float16: `KERNEL_DTYPES`,
`KERNEL_CACHE_DTYPES`). An fp8 cache (cache.dtype fp8_e4m3 / fp8_e5m2) takes the kernels: they store the bytes
`kv_quant.to_cache` stores (value / scale, in fp32) and read them back exactly; the layer folds the scales into the
decode kernel's softmax scale and output.
"""

from __future__ import annotations

import torch

from engine.attention.torch_backend import TorchBackend
from engine.kernels.cpu_kernels import (
    KERNEL_CACHE_DTYPES,
    KERNEL_DTYPES,
    PrefillContext,
    cpu_kernels_available,
    paged_decode,
    prefill_causal,
    rotary_store_kv,
    store_kv,
)


def _kernel_dtypes(new: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether the engine's kernels take this model dtype and this cache dtype."""
    return new.dtype in KERNEL_DTYPES and cache.dtype in KERNEL_CACHE_DTYPES


class CpuBackend(TorchBackend):
    name = "cpu"

    def __init__(self) -> None:
        self.kernels = cpu_kernels_available()

    def write_cache(self, key, value, key_cache, value_cache, metadata, scales=(1.0, 1.0)) -> None:
        if not self.kernels or key.device.type != "cpu" or not _kernel_dtypes(key, key_cache):
            return super().write_cache(key, value, key_cache, value_cache, metadata, scales)
        for new, cache, scale in ((key, key_cache, scales[0]), (value, value_cache, scales[1])):
            if cache is not None:
                store_kv(new, cache, metadata.slot_mapping, scale)

    def rotate_and_write(self, qkv, rope, cos, sin, key_cache, value_cache, metadata, scales=(1.0, 1.0)):
        fused = self.kernels and qkv.is_cpu and value_cache is not None and _kernel_dtypes(qkv, key_cache)
        if fused and qkv.stride(-1) == 1:
            slots = metadata.slot_mapping
            return rotary_store_kv(qkv, cos, sin, rope.interleaved, key_cache, value_cache, slots, scales)
        return super().rotate_and_write(qkv, rope, cos, sin, key_cache, value_cache, metadata, scales)

    def prefill_new(self, q, k, v, prefill, scale, need_lse):
        same = q.dtype in KERNEL_DTYPES and k.dtype == q.dtype and v.dtype == q.dtype
        if not self.kernels or not q.is_cpu or not same or any(t.stride(-1) != 1 for t in (q, k, v)):
            return super().prefill_new(q, k, v, prefill, scale, need_lse)
        out, lse = prefill_causal(q, k, v, prefill.cu_seqlens, scale)
        return out, lse if need_lse else None

    def prefill_in_context(self, q, k, v, prefill, key_cache, value_cache, scale):
        tensors = (q, k, v, key_cache, value_cache)
        if not self.kernels or not q.is_cpu or q.dtype not in KERNEL_DTYPES or any(t.dtype != q.dtype for t in tensors):
            return None
        if any(t.stride(-1) != 1 for t in tensors):
            return None
        context = PrefillContext(prefill.context_lens, prefill.block_tables, key_cache, value_cache)
        return prefill_causal(q, k, v, prefill.cu_seqlens, scale, context)[0]

    def paged(self, q, key_cache, value_cache, value_dim, kv, scale):
        if not self.kernels or not kv.one_query_each or q.device.type != "cpu" or not _kernel_dtypes(q, key_cache):
            return super().paged(q, key_cache, value_cache, value_dim, kv, scale)
        out, lse = paged_decode(q, key_cache, value_cache, kv.block_tables, kv.lens, scale, value_dim)
        return out, lse if kv.need_lse else None

"""The CPU backend: the torch reference, with the per-token work of decode in the engine's C++ kernels.

The KV store and single-query decode attention (`cpu_kernels.store_kv` / `paged_decode`) work on the
layers' cache views in place: no gathered copy of each sequence's keys and values per layer, and one
op instead of a dozen. A layer that hands over its unrotated q, k and v heads gets rotary and the KV store
in one op (`cpu_kernels.rotary_store_kv`). Prefill and multi-query context attention stay on the torch
backend's paths, as does everything when the kernels cannot be built here (`cpu_kernels_available`).
"""

from __future__ import annotations

from engine.attention.torch_backend import TorchBackend
from engine.kernels.cpu_kernels import KERNEL_DTYPES, cpu_kernels_available, paged_decode, rotary_store_kv, store_kv


class CpuBackend(TorchBackend):
    name = "cpu"

    def __init__(self) -> None:
        self.kernels = cpu_kernels_available()

    def write_cache(self, key, value, key_cache, value_cache, metadata) -> None:
        if not self.kernels or key.device.type != "cpu":
            return super().write_cache(key, value, key_cache, value_cache, metadata)
        for new, cache in ((key, key_cache), (value, value_cache)):
            if cache is not None:
                store_kv(new, cache, metadata.slot_mapping)

    def rotate_and_write(self, qkv, rope, cos, sin, key_cache, value_cache, metadata):
        if self.kernels and qkv.is_cpu and qkv.dtype in KERNEL_DTYPES and qkv.stride(-1) == 1:
            return rotary_store_kv(qkv, cos, sin, rope.interleaved, key_cache, value_cache, metadata.slot_mapping)
        return super().rotate_and_write(qkv, rope, cos, sin, key_cache, value_cache, metadata)

    def paged(self, q, key_cache, value_cache, value_dim, kv, scale):
        if not self.kernels or not kv.one_query_each or q.device.type != "cpu":
            return super().paged(q, key_cache, value_cache, value_dim, kv, scale)
        out, lse = paged_decode(q, key_cache, value_cache, kv.block_tables, kv.lens, scale, value_dim)
        return out, lse if kv.need_lse else None

"""The fp8 KV cache (cache.dtype fp8_e4m3 / fp8_e5m2): what is stored, and attention on it in every backend.

Stored values (value / scale) round to nearest within the format's bound and saturate at its largest value; every
backend stores the same bytes with the same scales; attention on the fp8 cache with the scales folded in equals
attention on a float cache holding the dequantized values (stored x scale) within fp32 summation-order tolerance: the
torch backend, the cpu backend's C++ kernels (this CPU's build; tests/test_cpu_isa.py runs this file again on the AVX2
build, tests/test_cpu_portable.py on the portable one) and the Triton interpreter.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from engine import dcp, kv_quant
from engine.attention import kv_cache
from engine.attention.backend import AttentionMetadata, PagedKV
from engine.attention.registry import create_backend
from engine.layers.rotary import RotaryEmbedding
from engine.runtime.model_runner import TORCH_DTYPES

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# (mantissa bits, smallest normal, largest finite) of each format
FORMATS = {E4M3: (3, 2.0**-6, 448.0), E5M2: (2, 2.0**-14, 57344.0)}


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16])
def test_round_trip_is_within_half_a_step_and_saturates(dtype, source):
    mantissa, smallest_normal, largest = FORMATS[dtype]
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(20000, generator=g) * torch.logspace(-8, 6, 20000)).to(source)  # subnormal to saturated
    back = kv_quant.as_stored(x, dtype)
    assert back.dtype == source and torch.isfinite(back).all()
    xf, bf = x.float(), back.float()
    in_range = xf.abs() <= largest
    # round to nearest: at most half a step, 2^-(m+1) relative for normals, half the subnormal step below
    bound = torch.where(
        xf.abs() >= smallest_normal,
        xf.abs() * 2.0 ** -(mantissa + 1),
        torch.tensor(smallest_normal * 2.0**-mantissa / 2),
    )
    assert ((bf - xf).abs() <= bound)[in_range].all()
    assert (bf[~in_range] == largest * xf[~in_range].sign()).all() and (~in_range).any()
    assert kv_quant.to_cache(x, dtype).dtype == dtype
    # a value stores the same bytes whatever tensor it arrives in (no per-tensor scale: rank-independent)
    part = kv_quant.to_cache(x[5000:6000], dtype).view(torch.uint8)
    assert torch.equal(part, kv_quant.to_cache(x, dtype)[5000:6000].view(torch.uint8))


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("scale", [0.0123, 37.5])
def test_a_scaled_round_trip_is_within_half_a_step_of_value_over_scale(dtype, scale):
    """With a scale the cache stores x / scale (fp32) and reads back stored x scale: the same bound as scale 1 on
    x / scale, times the scale (and the two fp32 roundings); saturation at largest x scale."""
    mantissa, smallest_normal, largest = FORMATS[dtype]
    scale = kv_quant.fp32(scale)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(20000, generator=g) * torch.logspace(-8, 6, 20000) * scale
    back = kv_quant.as_stored(x, dtype, scale)
    assert torch.isfinite(back).all()
    unscaled = x / scale
    bound = (
        torch.where(
            unscaled.abs() >= smallest_normal,
            unscaled.abs() * 2.0 ** -(mantissa + 1),
            torch.tensor(smallest_normal * 2.0**-mantissa / 2),
        )
        * scale
        * (1 + 2.0**-20)
    )
    in_range = unscaled.abs() <= largest
    assert ((back - x).abs() <= bound)[in_range].all()
    assert torch.equal(back[~in_range], (largest * scale * unscaled[~in_range].sign()).float())
    assert (~in_range).any() and (unscaled.abs() < smallest_normal).any()
    # the stored bytes are those of x / scale at scale 1, and not those of x itself
    stored = kv_quant.to_cache(x, dtype, scale).view(torch.uint8)
    assert torch.equal(stored, kv_quant.to_cache(x / scale, dtype).view(torch.uint8))
    assert not torch.equal(stored, kv_quant.to_cache(x, dtype).view(torch.uint8))


def test_plan_names_map_to_torch_dtypes():
    assert TORCH_DTYPES["fp8_e4m3"] is E4M3 and TORCH_DTYPES["fp8_e5m2"] is E5M2
    assert kv_quant.to_cache(torch.tensor([0.3]), torch.bfloat16).dtype == torch.bfloat16  # narrower, not fp8


# --------------------------------------------------------------------------------------------------------------
# backends
# --------------------------------------------------------------------------------------------------------------

HEADS, KV_HEADS, DIM, BLOCK = 6, 2, 32, 4
MLA_DIM, MLA_VALUE_DIM = 40, 32


def _caches(dtype: torch.dtype, blocks: int, mla: bool, dim: int = DIM):
    heads, dim = (1, MLA_DIM) if mla else (KV_HEADS, dim)
    _, layers = kv_cache.allocate(2, blocks, BLOCK, heads, dim, mla, dtype, torch.device("cpu"), True)
    return layers[1]


def _step(backend, lens: list[int], rank: int, dcp_size: int, interleave: int):
    """Metadata of one decode-sized write of every position of each sequence on one DCP rank, and the paged view
    of the rank's shard."""
    per_seq = -(-max(lens) // (BLOCK * dcp_size))
    tables = torch.arange(len(lens) * per_seq).view(len(lens), per_seq)
    slots = torch.cat(
        [dcp.slot(torch.arange(n), rank, tables[s], BLOCK, interleave, dcp_size) for s, n in enumerate(lens)]
    )
    local = [dcp.local_len(n, rank, interleave, dcp_size) for n in lens]
    kv = PagedKV(
        block_tables=tables,
        lens=torch.tensor(local),
        query_start=torch.arange(len(lens) + 1),
        query_counts=[1] * len(lens),
        local_lens=local,
        max_len=max(local),
        block_size=BLOCK,
    )
    md = AttentionMetadata(backend, slots, num_prefill_tokens=len(slots), num_decode_tokens=0, decode=kv)
    backend.prepare(md)
    return md, kv, tables.numel()


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize(
    ("mla", "dim"),
    [(False, DIM), (False, 64), (False, 128), (True, MLA_DIM)],
    ids=["gqa32", "gqa64", "gqa128", "mla"],  # 64 and 128: the C++ decode kernel's vector paths (AVX-512, AVX2)
)
@pytest.mark.parametrize("name", ["torch", "cpu", "triton"])
def test_backend_stores_the_rounded_values_and_attends_to_them(dtype, mla, dim, name):
    """Each backend's store writes `to_cache`'s bytes with the layer's scales (skipping other ranks' tokens) and its
    paged attention, with the scales folded in as the layer folds them (scores x k_scale, output x v_scale), equals
    the torch reference's on a float32 cache holding the dequantized values (stored x scale)."""
    if name == "triton" and dim > DIM:
        pytest.skip("the Triton interpreter costs milliseconds per program: one head size is enough")
    lens, rank, dcp_size, interleave = [7, 13], 1, 2, 2
    g = torch.Generator().manual_seed(3)
    backend = create_backend(name)
    md, kv, blocks = _step(backend, lens, rank, dcp_size, interleave)
    tokens = sum(lens)
    key = torch.randn(tokens, 1 if mla else KV_HEADS, dim, generator=g) * 3  # some beyond e4m3's 448 x k_scale
    value = None if mla else torch.randn(tokens, KV_HEADS, dim, generator=g)
    k_scale = kv_quant.fp32(0.1)
    v_scale = k_scale if mla else kv_quant.fp32(0.0123)
    kc, vc = _caches(dtype, blocks, mla, dim)
    backend.write_cache(key, value, kc, vc, md, (k_scale, v_scale))

    owned = md.slot_mapping >= 0
    slots = md.slot_mapping[owned]
    flat_k = kc.reshape(-1, *kc.shape[2:])  # [blocks * B, heads, dim] in slot order
    want_k = kv_quant.to_cache(key[owned], dtype, k_scale)
    assert torch.equal(flat_k[slots].view(torch.uint8), want_k.view(torch.uint8))
    if not mla:
        flat_v = vc.reshape(-1, *vc.shape[2:])
        want_v = kv_quant.to_cache(value[owned], dtype, v_scale)
        assert torch.equal(flat_v[slots].view(torch.uint8), want_v.view(torch.uint8))

    q = torch.randn(len(lens), 16 if mla else HEADS, dim, generator=g)
    value_dim = MLA_VALUE_DIM if mla else dim
    out, lse = backend.paged(q, kc, vc, value_dim, kv, 0.2 * k_scale)
    out = out * v_scale
    ref_k, ref_v = _caches(torch.float32, blocks, mla, dim)
    ref_k.copy_(kv_quant.dequantize(kc, torch.float32, k_scale))
    if not mla:
        ref_v.copy_(kv_quant.dequantize(vc, torch.float32, v_scale))
    reference = create_backend("torch")
    reference.prepare(md)
    want_out, want_lse = reference.paged(q, ref_k, ref_v, value_dim, kv, 0.2)
    # fp32 in another order (the scales folded in; the C++ and Triton kernels also sum in another order), on keys
    # (MLA: values) up to 448 x k_scale
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["torch", "cpu"])
def test_rotate_and_write_stores_the_rotated_keys_rounded(name):
    """The fused rotary + store (the cpu backend's C++ kernel) on an fp8 cache stores the rotated keys and the values
    as `to_cache` rounds them, and returns torch's rotated heads."""
    g = torch.Generator().manual_seed(5)
    lens = [9]
    backend = create_backend(name)
    md, _, blocks = _step(backend, lens, 0, 1, 1)
    cfg = LlamaConfig(hidden_size=HEADS * DIM, num_attention_heads=HEADS)
    rope = RotaryEmbedding(cfg, DIM, 64, False, torch.device("cpu"))
    cos, sin = rope.lookup(torch.arange(9))
    qkv = torch.randn(9, HEADS + 2 * KV_HEADS, DIM, generator=g)
    kc, vc = _caches(E4M3, blocks, False)
    scales = (kv_quant.fp32(0.0037), kv_quant.fp32(0.21))
    q, k = backend.rotate_and_write(qkv, rope, cos, sin, kc, vc, md, scales)
    want = rope.apply_torch(qkv[:, : HEADS + KV_HEADS], cos, sin)
    assert torch.equal(torch.cat([q, k], 1), want)
    flat_k, flat_v = kc.reshape(-1, KV_HEADS, DIM), vc.reshape(-1, KV_HEADS, DIM)
    want_k = kv_quant.to_cache(want[:, HEADS:], E4M3, scales[0])
    assert torch.equal(flat_k[:9].view(torch.uint8), want_k.view(torch.uint8))
    want_v = kv_quant.to_cache(qkv[:, HEADS + KV_HEADS :], E4M3, scales[1])
    assert torch.equal(flat_v[:9].view(torch.uint8), want_v.view(torch.uint8))

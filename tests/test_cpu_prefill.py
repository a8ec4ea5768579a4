"""`cpu_kernels.prefill_causal`, the CPU backend's prefill attention of the new tokens, against fp64 causal attention.

The kernel sums in its own order (a tile of keys in registers, an online softmax over blocks of 64 keys), so its bits
differ from torch's CPU flash op: both are compared with an fp64 reference of the same (bf16: already rounded) inputs,
fp32 outputs to 2e-5 absolute + 1e-4 relative, bf16 outputs to their rounding (1e-2), the fp32 log-sum-exp to 5e-5.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.attention.backend import PrefillNew
from engine.attention.cpu_backend import CpuBackend
from engine.attention.torch_backend import TorchBackend
from engine.kernels import cpu_kernels

NEEDS_KERNELS = pytest.mark.skipif(not cpu_kernels.cpu_kernels_available(), reason="the CPU kernels did not build here")
LENGTHS = [1, 2, 7, 16, 33, 128, 300]
# (dtype, products): float32 on the vector path; bfloat16 on each path a CPU may run (AMX tiles, AVX512-BF16 dot
# products, the vector path on widened values), each where this build and CPU run it
PATHS = pytest.mark.parametrize(
    ("dtype", "products"),
    [(torch.float32, "fp32"), (torch.bfloat16, "amx"), (torch.bfloat16, "avx512_bf16"), (torch.bfloat16, "fp32")],
)


def runs_here(dtype: torch.dtype, products: str) -> None:
    """Skip, saying why, where this build and CPU do not run `products` for `dtype`."""
    if dtype == torch.bfloat16 and products not in cpu_kernels.prefill_bf16_products():
        pytest.skip(f"bf16 products {products!r} do not run here ({', '.join(cpu_kernels.prefill_bf16_products())} do)")


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention within each prompt in fp64, K/V repeated for GQA: out [T, H, Dv], lse [T, H]."""
    group = q.shape[1] // k.shape[1]
    outs, lses, start = [], [], 0
    for n in lengths:
        qs, ks, vs = (t[start : start + n].double() for t in (q, k, v))
        ks, vs = ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1)
        scores = torch.einsum("thd,shd->hts", qs, ks) * scale
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        lse = torch.logsumexp(scores, -1)
        outs.append(torch.einsum("hts,shd->thd", torch.exp(scores - lse[..., None]), vs))
        lses.append(lse.T)
        start += n
    return torch.cat(outs), torch.cat(lses)


def layer_inputs(
    lengths: list[int], heads: int, kv_heads: int, dk: int, dv: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as strided views of one projection's output (as a layer hands them over), and cu_seqlens."""
    g = torch.Generator().manual_seed(seed)
    tokens = sum(lengths)
    qk = torch.randn(tokens, heads + kv_heads + 1, dk, generator=g).to(dtype)  # one spare head: strides not packed
    v = torch.randn(tokens, kv_heads + 1, dv + 3, generator=g).to(dtype)[:, 1:, 3:]
    cu = torch.tensor([0, *lengths]).cumsum(0)
    return qk[:, :heads], qk[:, heads : heads + kv_heads], v, cu


def check(out, lse, want_o, want_l, dtype) -> None:
    tol = {"atol": 2e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    assert out.dtype == dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), want_o, **tol)
    torch.testing.assert_close(lse.double(), want_l, atol=5e-5, rtol=1e-5)


@NEEDS_KERNELS
@PATHS
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dk", "dv"),
    [
        (9, 3, 64, 64),  # SmolLM2: a group of 3
        (8, 2, 128, 128),  # a group of 4, 128 dims
        (4, 4, 64, 64),  # no GQA
        (12, 3, 128, 128),
        (5, 1, 40, 24),  # odd head sizes (padded to whole vectors), a group of 5
        (6, 2, 96, 80),  # values padded to 96 dims: with AVX-512 a tile of 4 vectors of dims and one of 2
    ],
)
def test_prefill_causal_matches_fp64_attention(dtype, products, heads, kv_heads, dk, dv):
    """Prompts of 1 .. 300 tokens in one call (key blocks of 64 cut mid-prompt, items of 32 query tokens cut mid-
    block), strided q, k and v; 1 and 2 threads give the same bits (the work split never changes an item's sums)."""
    runs_here(dtype, products)
    q, k, v, cu = layer_inputs(LENGTHS, heads, kv_heads, dk, dv, dtype)
    scale = dk**-0.5
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_kernels.prefill_causal(q, k, v, cu, scale, products=products)
        torch.set_num_threads(2)
        out, lse = cpu_kernels.prefill_causal(q, k, v, cu, scale, products=products)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(out, one[0]) and torch.equal(lse, one[1])
    check(out, lse, *reference(q, k, v, LENGTHS, scale), dtype)


@NEEDS_KERNELS
@PATHS
def test_prefill_causal_stays_finite_where_scores_spread_by_1e15(dtype, products):
    """Scores ~1e15 apart: every key but a row's largest is e^(-1e15) = 0, where an exp that let such an x reach its
    polynomial gave inf or NaN for the whole row; the attention picks each row's top key, as fp64 does."""
    runs_here(dtype, products)
    lengths = [1, 70, 130]
    q, k, v, cu = layer_inputs(lengths, 9, 3, 64, 64, dtype, seed=5)
    q, k = q * 1e8, k * 1e8
    out, lse = cpu_kernels.prefill_causal(q, k, v, cu, 0.125, products=products)
    assert out.isfinite().all() and lse.isfinite().all()
    check(out, lse, *reference(q, k, v, lengths, 0.125), dtype)


@NEEDS_KERNELS
@PATHS
def test_prefill_causal_takes_mla_values_inside_the_keys(dtype, products):
    """MLA (DeepSeek-V2): one latent KV head for all 16 query heads (items of 6 query tokens: 96 rows), the values
    the first Dv dims of the keys."""
    runs_here(dtype, products)
    lengths = [5, 70, 1]
    q, k, _, cu = layer_inputs(lengths, 16, 1, 40, 32, dtype, seed=3)
    v = k[..., :32]
    out, lse = cpu_kernels.prefill_causal(q, k, v, cu, 0.3, products=products)
    check(out, lse, *reference(q, k, v, lengths, 0.3), dtype)


def paged_context(
    k: torch.Tensor, v: torch.Tensor, full: list[int], cached: list[int], block_size: int = 16, seed: int = 0
) -> tuple[cpu_kernels.PrefillContext, torch.Tensor, torch.Tensor]:
    """Each sequence's first cached[p] of its full[p] tokens (rows of k / v, sequences back to back) stored in the
    second layer of a two-layer paged cache (block-major storage: strided views, as the engine allocates), at
    shuffled blocks; and the remaining rows of k and v (the chunk's new tokens)."""
    from engine.attention import kv_cache

    tables_len = max(-(-n // block_size) for n in full)
    blocks = torch.randperm(len(full) * tables_len + 3, generator=torch.Generator().manual_seed(seed))
    tables = blocks[: len(full) * tables_len].view(len(full), tables_len).contiguous()
    kv_heads, dim = k.shape[1], max(k.shape[2], v.shape[2])
    _, layers = kv_cache.allocate(2, len(blocks), block_size, kv_heads, dim, False, k.dtype, torch.device("cpu"), False)
    key_cache, value_cache = layers[1][0][..., : k.shape[2]], layers[1][1][..., : v.shape[2]]
    new, start = [], 0
    for p, (n, c) in enumerate(zip(full, cached, strict=True)):
        for j in range(c):
            block, offset = tables[p, j // block_size], j % block_size
            key_cache[block, offset], value_cache[block, offset] = k[start + j], v[start + j]
        new.append(torch.arange(start + c, start + n))
        start += n
    rows = torch.cat(new)
    context = cpu_kernels.PrefillContext(torch.tensor(cached), tables, key_cache, value_cache)
    return context, k[rows], v[rows]


@NEEDS_KERNELS
@PATHS
@pytest.mark.parametrize(("heads", "kv_heads", "dk", "dv"), [(9, 3, 64, 64), (5, 1, 40, 24)])
def test_prefill_causal_attends_cached_context_in_the_same_pass(dtype, products, heads, kv_heads, dk, dv):
    """Chunks continuing prompts whose first tokens are in the paged cache (0, 1, 63, 64, 200 and 700 cached tokens,
    blocks of 16 at shuffled places): each new token sees every cached token and the new ones up to itself, so the
    rows equal those of causal attention over the whole prompt in fp64, LSEs included; 1 and 2 threads give the
    same bits, and a step with no cached token gives the bits of the plain call."""
    runs_here(dtype, products)
    full, cached = [5, 9, 100, 64, 230, 701], [0, 1, 63, 64, 200, 700]
    q, k, v, _ = layer_inputs(full, heads, kv_heads, dk, dv, dtype, seed=21)
    context, k_new, v_new = paged_context(k, v, full, cached)
    starts = torch.tensor([0, *full]).cumsum(0)
    new_rows = torch.cat([torch.arange(s + c, s + n) for s, n, c in zip(starts.tolist(), full, cached, strict=False)])
    cu = torch.tensor([0, *(n - c for n, c in zip(full, cached, strict=True))]).cumsum(0)
    scale = dk**-0.5
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_kernels.prefill_causal(q[new_rows], k_new, v_new, cu, scale, context, products)
        torch.set_num_threads(2)
        out, lse = cpu_kernels.prefill_causal(q[new_rows], k_new, v_new, cu, scale, context, products)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(out, one[0]) and torch.equal(lse, one[1])
    want_o, want_l = reference(q, k, v, full, scale)
    check(out, lse, want_o[new_rows], want_l[new_rows], dtype)
    fresh = dataclasses.replace(context, lens=torch.zeros(len(full), dtype=torch.long))
    plain = cpu_kernels.prefill_causal(q, k, v, starts, scale, products=products)
    with_none = cpu_kernels.prefill_causal(q, k, v, starts, scale, fresh, products)
    assert torch.equal(plain[0], with_none[0]) and torch.equal(plain[1], with_none[1])


@NEEDS_KERNELS
def test_prefill_causal_edges_and_errors():
    """An empty prompt among others and an empty step; mixed dtypes and a strided last dim are refused."""
    lengths = [3, 0, 17]
    q, k, v, cu = layer_inputs(lengths, 6, 2, 64, 64, torch.float32, seed=5)
    out, lse = cpu_kernels.prefill_causal(q, k, v, cu, 0.125)
    check(out, lse, *reference(q, k, v, lengths, 0.125), torch.float32)
    empty = cpu_kernels.prefill_causal(q[:0], k[:0], v[:0], torch.zeros(1, dtype=torch.long), 0.125)
    assert empty[0].shape == (0, 6, 64) and empty[1].shape == (0, 6)
    with pytest.raises(RuntimeError, match="one dtype"):
        cpu_kernels.prefill_causal(q, k.bfloat16(), v, cu, 0.125)
    with pytest.raises(RuntimeError, match="contiguous last dim"):
        cpu_kernels.prefill_causal(q.transpose(1, 2), k, v, cu, 0.125)
    with pytest.raises(RuntimeError, match="cu_seqlens"):
        cpu_kernels.prefill_causal(q, k, v, cu[:-1], 0.125)
    refused = r"products 'avx512_bf16' do not run for Float in this build on this CPU \(fp32\)"
    with pytest.raises(RuntimeError, match=refused):
        cpu_kernels.prefill_causal(q, k, v, cu, 0.125, products="avx512_bf16")
    with pytest.raises(RuntimeError, match="products 'tiles' do not run for BFloat16"):
        cpu_kernels.prefill_causal(q.bfloat16(), k.bfloat16(), v.bfloat16(), cu, 0.125, products="tiles")


@NEEDS_KERNELS
@pytest.mark.parametrize("need_lse", [True, False])
def test_cpu_backend_prefill_uses_the_kernel_and_falls_back(need_lse):
    """The CPU backend's prefill_new is the kernel (close to the torch backend's flash path); float16, which the
    kernels do not take, runs the torch backend's path with the same results."""
    lengths = [9, 40]
    cpu, torch_backend = CpuBackend(), TorchBackend()
    for dtype in (torch.float32, torch.float16):
        q, k, v, cu = layer_inputs(lengths, 9, 3, 64, 64, dtype, seed=9)
        prefill = PrefillNew(cu, lengths, max(lengths))
        out, lse = cpu.prefill_new(q, k, v, prefill, 0.125, need_lse)
        want_o, want_l = torch_backend.prefill_new(q, k, v, prefill, 0.125, need_lse)
        if dtype == torch.float16:
            assert torch.equal(out, want_o)
        else:
            torch.testing.assert_close(out, want_o, atol=2e-5, rtol=1e-4)
        assert (lse is None) == (not need_lse)
        if need_lse:
            torch.testing.assert_close(lse, want_l, atol=5e-5, rtol=1e-5)
    # keys whose last dim is not contiguous (q and v are): the torch backend's path, not the kernel's error
    q, k, v, cu = layer_inputs(lengths, 9, 3, 64, 64, torch.float32, seed=9)
    k_strided = torch.stack([k, k], dim=-1)[..., 0]
    prefill = PrefillNew(cu, lengths, max(lengths))
    out, _ = cpu.prefill_new(q, k_strided, v, prefill, 0.125, need_lse)
    assert torch.equal(out, torch_backend.prefill_new(q, k_strided, v, prefill, 0.125, need_lse)[0])


@NEEDS_KERNELS
def test_bf16_prefill_runs_on_the_best_products_the_cpu_has():
    """bf16 prefill attention runs on AMX tiles (brgemm) where the AVX512-BF16 build meets AMX, as vdpbf16ps dot
    products where the build has AVX512-BF16 without AMX (Zen 4), else (a forced AVX2 build included) on the vector
    path; the CPU backend takes the kernel's default at every prompt length, short and long, not torch's flash op
    (whose bits differ)."""
    from engine.kernels.cpu_isa import detect

    kernel_isa = cpu_kernels.kernel_isa()
    dot = kernel_isa is not None and kernel_isa.bf16_dot
    want = (["amx"] if dot and detect().amx_bf16 else []) + (["avx512_bf16"] if dot else []) + ["fp32"]
    assert cpu_kernels.prefill_bf16_products() == want
    cpu, torch_backend = CpuBackend(), TorchBackend()
    for lengths in ([3, 40], [300, 1030]):
        q, k, v, cu = layer_inputs(lengths, 9, 3, 64, 64, torch.bfloat16, seed=11)
        prefill = PrefillNew(cu, lengths, max(lengths))
        out, lse = cpu.prefill_new(q, k, v, prefill, 0.125, True)
        kernel = cpu_kernels.prefill_causal(q, k, v, cu, 0.125)
        assert torch.equal(out, kernel[0]) and torch.equal(lse, kernel[1])
        assert not torch.equal(out, torch_backend.prefill_new(q, k, v, prefill, 0.125, True)[0])
        check(out, lse, *reference(q, k, v, lengths, 0.125), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_flash_takes_gqa_keys_as_they_are(dtype):
    """The torch backend hands torch's CPU flash op fewer key/value heads than query heads (no repeated copies): the
    bits of the same op on repeated keys, and fp64 attention's values (bf16: the outputs to their rounding; the op's
    bf16 log-sum-exp is within 1e-4 of fp64's, not the kernel's 5e-5)."""
    from engine.attention.torch_backend import _causal_cpu

    lengths = [7, 300]
    q, k, v, cu = layer_inputs(lengths, 9, 3, 64, 64, dtype, seed=5)
    out, lse = TorchBackend().prefill_new(q, k, v, PrefillNew(cu, lengths, max(lengths)), 0.125, True)
    start = 0
    for n in lengths:
        qs, ks, vs = q[start : start + n], k[start : start + n], v[start : start + n]
        repeated = _causal_cpu(qs, ks.repeat_interleave(3, 1), vs.repeat_interleave(3, 1), 0.125)
        assert torch.equal(out[start : start + n], repeated[0]) and torch.equal(lse[start : start + n], repeated[1])
        start += n
    want_o, want_l = reference(q, k, v, lengths, 0.125)
    check(out, lse, want_o, want_l if dtype == torch.float32 else lse.double(), dtype)
    torch.testing.assert_close(lse.double(), want_l, atol=1e-4, rtol=0)

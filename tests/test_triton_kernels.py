"""The Triton kernels against the torch reference backend, on CPU in the Triton interpreter and, marked gpu, on CUDA.

CPU tensors run the kernels in the Triton interpreter (no TRITON_INTERPRET needed: the launchers pick the mode by
device). The interpreter costs milliseconds per program, so CPU shapes stay tiny.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from engine import dcp
from engine.attention import triton_kernels as tk
from engine.attention.backend import AttentionMetadata, PagedKV, PrefillNew
from engine.attention.torch_backend import TorchBackend

HAS_CUDA = torch.cuda.is_available()
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]),
]
ATOL = 2e-5  # fp32 inputs, fp32 accumulation: only the summation order differs


def close(a: torch.Tensor, b: torch.Tensor, atol: float = ATOL) -> None:
    """Equal within atol, with -inf (and only -inf) in the same places and no NaN anywhere."""
    a, b = a.float().cpu(), b.float().cpu()
    assert not a.isnan().any() and not b.isnan().any()
    assert torch.equal(torch.isneginf(a), torch.isneginf(b))
    finite = torch.isfinite(b)
    torch.testing.assert_close(a[finite], b[finite], atol=atol, rtol=1e-4)


def random_tables(seqs: int, max_blocks: int, num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    """Distinct physical blocks per sequence, shuffled, so a wrong table lookup reads the wrong keys."""
    return torch.randperm(num_blocks, generator=gen)[: seqs * max_blocks].view(seqs, max_blocks)


def make_paged(lens: list[int], query_counts: list[int], block_size: int, device: str, gen) -> PagedKV:
    max_blocks = max(1, max(-(-n // block_size) for n in lens))
    tables = random_tables(len(lens), max_blocks, len(lens) * max_blocks + 3, gen)
    start = torch.zeros(len(lens) + 1, dtype=torch.int64)
    start[1:] = torch.cumsum(torch.tensor(query_counts), 0)
    return PagedKV(
        block_tables=tables.to(device),
        lens=torch.tensor(lens, dtype=torch.int64, device=device),
        query_start=start.to(device),
        query_counts=query_counts,
        local_lens=list(lens),
        max_len=max(lens),
        block_size=block_size,
    )


def head_major(cache: torch.Tensor | None) -> torch.Tensor | None:
    """The same logical cache in the torch backend's head-major storage."""
    return None if cache is None else cache.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)


def reference_paged(q, key_cache, value_cache, value_dim, kv: PagedKV, scale):
    md = AttentionMetadata(
        backend=None,
        slot_mapping=torch.zeros(0, dtype=torch.int64, device=q.device),
        num_prefill_tokens=0,
        num_decode_tokens=q.shape[0],
        decode=kv,
    )
    ref = TorchBackend()
    ref.prepare(md)
    return ref.paged(q, head_major(key_cache), head_major(value_cache), value_dim, kv, scale)


def run_paged(q, key_cache, value_cache, value_dim, kv: PagedKV, scale, **kw):
    return tk.paged_attention(
        q, key_cache, value_cache, value_dim, kv.block_tables, kv.lens, kv.query_start,
        max(kv.query_counts), kv.max_len, scale, **kw,
    )  # fmt: skip


def dcp_lens(lengths: list[int], rank: int, interleave: int, dcp_size: int) -> list[int]:
    """Local lengths of global sequence lengths on one DCP rank (from the engine's DCP math)."""
    return [dcp.local_len(n, rank, interleave, dcp_size) for n in lengths]


def caches(num_blocks, block_size, hkv, dk, dv, dtype, device, gen, mla=False):
    kc = torch.randn(num_blocks, block_size, hkv, dk, generator=gen).to(device=device, dtype=dtype)
    vc = None if mla else torch.randn(num_blocks, block_size, hkv, dv, generator=gen).to(device=device, dtype=dtype)
    return kc, vc


# --------------------------------------------------------------------------------------------------------------
# KV store
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mla", [False, True], ids=["gqa", "mla"])
def test_store_writes_owned_slots_and_skips_minus_one(device, mla):
    gen = torch.Generator().manual_seed(0)
    n, hkv, dk, dv, block_size, blocks = 11, 1 if mla else 2, 40 if mla else 16, 32 if mla else 16, 4, 6
    # a DCP rank's slots: positions 0..10 of one sequence, rank 1 of 2 with interleave 2 (-1 for rank 0's tokens)
    table = torch.tensor([4, 1, 5])
    slots = dcp.slot(torch.arange(n), 1, table, block_size, 2, 2).to(device)
    assert (slots == -1).sum() > 0
    wide = torch.randn(n, hkv, dk + 8, generator=gen).to(device)
    key = wide[..., :dk]  # a strided view, as the layers pass it
    value = None if mla else torch.randn(n, hkv, dv, generator=gen).to(device)
    kc, vc = caches(blocks, block_size, hkv, dk, dv, torch.float32, device, gen, mla)
    ref_kc, ref_vc = head_major(kc), head_major(vc)

    md = AttentionMetadata(backend=None, slot_mapping=slots, num_prefill_tokens=n, num_decode_tokens=0)
    ref = TorchBackend()
    ref.prepare(md)
    ref.write_cache(key, value, ref_kc, ref_vc, md)
    tk.store_kv(key, value, kc, vc, slots)
    assert torch.equal(kc, ref_kc)
    if not mla:
        assert torch.equal(vc, ref_vc)


@pytest.mark.parametrize("device", DEVICES)
def test_store_casts_to_the_cache_dtype(device):
    gen = torch.Generator().manual_seed(1)
    key, value = torch.randn(5, 2, 16, generator=gen).to(device), torch.randn(5, 2, 16, generator=gen).to(device)
    kc = torch.zeros(2, 4, 2, 16, dtype=torch.bfloat16, device=device)
    vc = torch.zeros_like(kc)
    slots = torch.tensor([0, -1, 3, 5, -1], device=device)
    tk.store_kv(key, value, kc, vc, slots)
    flat_k, flat_v = kc.view(-1, 2, 16), vc.view(-1, 2, 16)
    # CUDA rounds to nearest like torch; the interpreter's float conversion truncates (within one bf16 step)
    tol = {"atol": 0, "rtol": 0} if device == "cuda" else {"atol": 0, "rtol": 2**-7}
    torch.testing.assert_close(flat_k[[0, 3, 5]], key[[0, 2, 3]].bfloat16(), **tol)
    torch.testing.assert_close(flat_v[[0, 3, 5]], value[[0, 2, 3]].bfloat16(), **tol)
    assert flat_k[[1, 2, 4, 6, 7]].abs().sum() == 0


# --------------------------------------------------------------------------------------------------------------
# Paged attention (decode and cached context)
# --------------------------------------------------------------------------------------------------------------

GLOBAL_LENGTHS = [1, 6, 23, 41]  # on dcp 2: rank 1 holds nothing of the first sequence for every interleave


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("group", "block_size", "interleave", "rank"),
    [(1, 4, 1, 0), (2, 4, 4, 1), (4, 16, 1, 1), (2, 16, 16, 1), (4, 4, 2, 0)],
)
def test_paged_decode_gqa_matches_reference(device, group, block_size, interleave, rank):
    gen = torch.Generator().manual_seed(group * 100 + block_size + rank)
    hkv, d = 2, 16
    lens = dcp_lens(GLOBAL_LENGTHS, rank, interleave, 2)
    if rank == 1:
        assert 0 in lens
    kv = make_paged(lens, [1] * len(lens), block_size, device, gen)
    kc, vc = caches(int(kv.block_tables.max()) + 1, block_size, hkv, d, d, torch.float32, device, gen)
    q = torch.randn(len(lens), hkv * group, d, generator=gen).to(device)
    out, lse = run_paged(q, kc, vc, d, kv, 0.25)
    ref_out, ref_lse = reference_paged(q, kc, vc, d, kv, 0.25)
    close(out, ref_out)
    close(lse, ref_lse)
    empty = torch.tensor(lens, device=device) == 0
    assert (out[empty] == 0).all() and torch.isneginf(lse[empty]).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("block_size", "dk", "dv"), [(4, 40, 32), (16, 40, 32), (4, 48, 40)])
def test_paged_decode_mla_latent_dims(device, block_size, dk, dv):
    """MLA: one cache head, key = latent + rope (40 = 32 + 8), value = the first 32 key dims (no value cache).
    48/40: the values do not fit the key's power-of-two part (32), so they are loaded from the key cache."""
    gen = torch.Generator().manual_seed(block_size + dk)
    lens = dcp_lens(GLOBAL_LENGTHS, 1, 2, 2)
    kv = make_paged(lens, [1] * len(lens), block_size, device, gen)
    kc, _ = caches(int(kv.block_tables.max()) + 1, block_size, 1, dk, dv, torch.float32, device, gen, mla=True)
    q = torch.randn(len(lens), 4, dk, generator=gen).to(device)
    out, lse = run_paged(q, kc, None, dv, kv, 0.2)
    ref_out, ref_lse = reference_paged(q, kc, None, dv, kv, 0.2)
    assert out.shape == (len(lens), 4, dv)
    close(out, ref_out)
    close(lse, ref_lse)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mla", [False, True], ids=["gqa", "mla"])
def test_paged_multi_query_rows_attend_to_whole_shard(device, mla):
    """Prefill-context rows: several query rows per sequence, all attend to every local cached token, unmasked."""
    gen = torch.Generator().manual_seed(7)
    lens, counts = [9, 0, 14], [3, 2, 5]  # the middle sequence has no context on this rank
    hkv, group, dk, dv = (1, 4, 40, 32) if mla else (2, 2, 16, 16)
    kv = make_paged(lens, counts, 4, device, gen)
    kc, vc = caches(int(kv.block_tables.max()) + 1, 4, hkv, dk, dv, torch.float32, device, gen, mla)
    q = torch.randn(sum(counts), hkv * group, dk, generator=gen).to(device)
    out, lse = run_paged(q, kc, vc, dv, kv, 0.3)
    ref_out, ref_lse = reference_paged(q, kc, vc, dv, kv, 0.3)
    close(out, ref_out)
    close(lse, ref_lse)
    assert torch.isneginf(lse[3:5]).all() and (out[3:5] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_split_kv_merge_equals_one_split(device):
    """Forced splits (some past a short sequence's end, one sequence empty) merge to the single-split result."""
    gen = torch.Generator().manual_seed(3)
    lens = [0, 5, 60]
    kv = make_paged(lens, [1, 1, 1], 4, device, gen)
    kc, vc = caches(int(kv.block_tables.max()) + 1, 4, 1, 16, 16, torch.float32, device, gen)
    q = torch.randn(3, 2, 16, generator=gen).to(device)
    one = run_paged(q, kc, vc, 16, kv, 0.3, num_splits=1, config=tk.PagedConfig(16, 16))
    four = run_paged(q, kc, vc, 16, kv, 0.3, num_splits=4, config=tk.PagedConfig(16, 16))
    ref = reference_paged(q, kc, vc, 16, kv, 0.3)
    for got in (one, four):
        close(got[0], ref[0])
        close(got[1], ref[1])


def test_paged_tiles_below_16_are_refused():
    """tl.dot compiles for a GPU only with tiles of at least 16: a smaller config fails here too, not first on a GPU."""
    with pytest.raises(ValueError, match="at least 16"):
        tk.PagedConfig(16, 8)


@pytest.mark.parametrize("device", DEVICES)
def test_merge_partials_follows_the_dcp_rules(device):
    """A part with lse -inf weighs exactly 0 (even if its output is garbage); a row empty everywhere gives 0, -inf."""
    gen = torch.Generator().manual_seed(5)
    parts, tokens, heads, dv = 3, 4, 2, 24
    part_o = torch.randn(parts, tokens, heads, dv, generator=gen).to(device)
    part_l = torch.randn(parts, tokens, heads, generator=gen).to(device)
    part_l[0, 0] = float("-inf")
    part_o[0, 0] = 1e30  # garbage behind an lse of -inf must not leak into the merge
    part_l[:, 1, 0] = float("-inf")
    part_l[1:, 2, 1] = float("-inf")
    out, lse = tk.merge_partials(part_o, part_l)
    total = torch.logsumexp(part_l, dim=0)
    weights = torch.exp(part_l - torch.where(torch.isinf(total), 0.0, total)).unsqueeze(-1)
    expected = (part_o * weights).sum(0)
    close(lse, total)
    close(out, expected, atol=1e-5)
    assert (out[1, 0] == 0).all()
    close(out[2, 1], part_o[0, 2, 1])


@pytest.mark.parametrize("device", DEVICES)
def test_paged_bf16_inputs(device):
    """bf16 cache and queries (fp32 dots in the interpreter, bf16 tensor-core dots on CUDA), fp32 accumulation."""
    gen = torch.Generator().manual_seed(11)
    lens = [7, 19]
    kv = make_paged(lens, [1, 1], 4, device, gen)
    kc, vc = caches(int(kv.block_tables.max()) + 1, 4, 2, 16, 16, torch.bfloat16, device, gen)
    q = torch.randn(2, 4, 16, generator=gen).to(device=device, dtype=torch.bfloat16)
    out, lse = run_paged(q, kc, vc, 16, kv, 0.25)
    ref_out, ref_lse = reference_paged(q, kc, vc, 16, kv, 0.25)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    close(out, ref_out, atol=2e-2)
    close(lse, ref_lse, atol=1e-2)


# --------------------------------------------------------------------------------------------------------------
# Prefill (causal over new tokens)
# --------------------------------------------------------------------------------------------------------------


def reference_prefill(q, k, v, seq_lens, scale):
    cu = torch.zeros(len(seq_lens) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(torch.tensor(seq_lens), 0)
    return TorchBackend().prefill_new(q, k, v, PrefillNew(cu, seq_lens, max(seq_lens)), scale, need_lse=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("heads", "hkv", "dk", "dv"), [(2, 2, 16, 16), (4, 2, 16, 16), (4, 1, 40, 32)],
                         ids=["mha", "gqa2", "mla"])  # fmt: skip
def test_prefill_causal_varlen_matches_reference(device, heads, hkv, dk, dv):
    gen = torch.Generator().manual_seed(heads + dk)
    seq_lens = [1, 5, 37]  # 37 spans two query tiles and two key blocks of the interpreter's 32
    n = sum(seq_lens)
    q = torch.randn(n, heads, dk, generator=gen).to(device)
    k = torch.randn(n, hkv, dk, generator=gen).to(device)
    v = k[..., :dv] if dk != dv else torch.randn(n, hkv, dv, generator=gen).to(device)  # MLA: a view of the key
    cu = torch.zeros(len(seq_lens) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(torch.tensor(seq_lens), 0)
    out, lse = tk.prefill_attention(q, k, v, cu.to(device), max(seq_lens), 0.3)
    ref_out, ref_lse = reference_prefill(q, k, v, seq_lens, 0.3)
    close(out, ref_out)
    close(lse, ref_lse)


# --------------------------------------------------------------------------------------------------------------
# CUDA only: realistic shapes, dtypes and automatic splits
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize(
    ("heads", "hkv", "dk", "dv", "block_size", "dtype", "queries"),
    [
        (32, 4, 128, 128, 16, torch.bfloat16, 1),
        (32, 4, 128, 128, 256, torch.float16, 1),
        (32, 4, 128, 128, 16, torch.float32, 1),
        (32, 4, 128, 128, 16, torch.bfloat16, 7),
        (16, 1, 576, 512, 64, torch.bfloat16, 1),
        (16, 1, 576, 512, 64, torch.float32, 1),
        (128, 1, 576, 512, 16, torch.bfloat16, 1),
        (16, 1, 576, 512, 64, torch.bfloat16, 7),
    ],
    ids=["gqa8-b16-bf16", "gqa8-b256-fp16", "gqa8-b16-fp32", "gqa8-ctx7", "mla16-b64-bf16", "mla16-fp32",
         "mla128-b16", "mla16-ctx7"],
)  # fmt: skip
def test_gpu_paged_realistic(dtype, heads, hkv, dk, dv, block_size, queries):
    gen = torch.Generator().manual_seed(0)
    lens = [0, 1, 300, 5000, 2049]
    counts = [queries] * len(lens)
    mla = dv != dk
    kv = make_paged(lens, counts, block_size, "cuda", gen)
    kc, vc = caches(int(kv.block_tables.max()) + 1, block_size, hkv, dk, dv, dtype, "cuda", gen, mla)
    q = torch.randn(sum(counts), heads, dk, generator=gen).to(device="cuda", dtype=dtype)
    out, lse = run_paged(q, kc, vc, dv, kv, dk**-0.5)
    ref_out, ref_lse = reference_paged(q, kc, vc, dv, kv, dk**-0.5)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    close(out, ref_out, atol=tol)
    close(lse, ref_lse, atol=tol)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("heads", "hkv", "dk", "dv"), [(32, 4, 128, 128), (16, 1, 576, 512)], ids=["gqa8", "mla"])
def test_gpu_prefill_realistic(dtype, heads, hkv, dk, dv):
    gen = torch.Generator().manual_seed(0)
    seq_lens = [1, 100, 1000, 257]
    n = sum(seq_lens)
    q = torch.randn(n, heads, dk, generator=gen).to(device="cuda", dtype=dtype)
    k = torch.randn(n, hkv, dk, generator=gen).to(device="cuda", dtype=dtype)
    v = k[..., :dv] if dk != dv else torch.randn(n, hkv, dv, generator=gen).to(device="cuda", dtype=dtype)
    cu = torch.zeros(len(seq_lens) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(torch.tensor(seq_lens), 0)
    out, lse = tk.prefill_attention(q, k, v, cu.cuda(), max(seq_lens), dk**-0.5)
    ref_out, ref_lse = reference_prefill(q, k, v, seq_lens, dk**-0.5)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    close(out, ref_out, atol=tol)
    close(lse, ref_lse, atol=tol)


def test_interpreter_works_after_triton_was_imported_normally():
    """torch._dynamo (pulled in by transformers) imports triton first: CPU launches must still interpret, and
    TRITON_INTERPRET must not leak into the environment."""
    code = (
        "import os, sys, torch, triton  # as torch._dynamo does, before any kernel is defined\n"
        "assert 'triton' in sys.modules and 'TRITON_INTERPRET' not in os.environ\n"
        "from engine.attention import triton_kernels as tk\n"
        "kc = torch.randn(2, 4, 1, 16); q = torch.randn(1, 2, 16)\n"
        "out, lse = tk.paged_attention(q, kc, kc, 16, torch.tensor([[1, 0]]), torch.tensor([6]),\n"
        "                              torch.tensor([0, 1]), 1, 6, 0.25)\n"
        "keys = kc.view(-1, 1, 16)[[4, 5, 6, 7, 0, 1], 0]\n"
        "p = torch.softmax(q[0] @ keys.T * 0.25, -1)\n"
        "assert torch.allclose(out[0], p @ keys, atol=1e-5), (out, p @ keys)\n"
        "assert 'TRITON_INTERPRET' not in os.environ\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kernel", "dtype", "consts", "warps", "stages"),
    [
        ("paged", "bf16", dict(G=8, BLOCK_SIZE=16, DK=128, DA=128, DB=0, DV=128, BLOCK_DV=128, VALUE_IN_KEY=False,
                               BLOCK_M=16, BLOCK_N=64, DOT_F32=False, PRECISION=None), 4, 3),
        ("paged", "bf16", dict(G=16, BLOCK_SIZE=64, DK=576, DA=512, DB=64, DV=512, BLOCK_DV=512, VALUE_IN_KEY=True,
                               BLOCK_M=16, BLOCK_N=32, DOT_F32=False, PRECISION=None), 8, 2),
        ("prefill", "fp32", dict(G=8, DK=128, DA=128, DB=0, DV=128, BLOCK_DV=128, BLOCK_M=64, BLOCK_N=64,
                                 DOT_F32=False, PRECISION="ieee"), 4, 2),
    ],
    ids=["paged-gqa8-bf16", "paged-mla-bf16", "prefill-fp32"],
)  # fmt: skip
def test_kernels_compile_for_hopper_without_a_gpu(kernel, dtype, consts, warps, stages):
    """The compiled (not interpreted) path, which CPU CI otherwise never runs: lower to sm90 code offline and fit
    the 227 KiB of shared memory an H100/H200 block may use."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(tk._kernels(False), kernel)
    names = list(inspect.signature(fn.fn).parameters)
    pointers = {"TABLES", "LENS", "QSTART", "CU"}
    sig = {}
    for n in names:
        if n in consts:
            sig[n] = "constexpr"
        elif n.isupper():
            sig[n] = "*i64" if n in pointers else ("*fp32" if n == "LSE" else f"*{dtype}")
        else:
            sig[n] = "fp32" if n == "scale_log2" else "i32"
    try:
        src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in consts.items()})
    except TypeError as exc:
        pytest.skip(f"this triton's ASTSource differs: {exc}")
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    assert "ptx" in compiled.asm and compiled.metadata.shared <= 227 * 1024


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize(
    ("q_dtype", "cache_dtype"),
    [
        (torch.bfloat16, torch.float16),
        (torch.bfloat16, torch.float32),
        (torch.bfloat16, torch.float8_e4m3fn),  # cache.dtype fp8_e4m3 / fp8_e5m2: widened to fp32 in the kernel
        (torch.bfloat16, torch.float8_e5m2),
    ],
)
def test_gpu_paged_cache_dtype_differs_from_queries(q_dtype, cache_dtype):
    gen = torch.Generator().manual_seed(2)
    kv = make_paged([0, 300, 77], [1, 1, 1], 16, "cuda", gen)
    kc, vc = caches(int(kv.block_tables.max()) + 1, 16, 4, 128, 128, cache_dtype, "cuda", gen)
    q = torch.randn(3, 32, 128, generator=gen).to(device="cuda", dtype=q_dtype)
    out, lse = run_paged(q, kc, vc, 128, kv, 128**-0.5)
    ref_out, ref_lse = reference_paged(q, kc, vc, 128, kv, 128**-0.5)
    assert out.dtype == q_dtype
    close(out, ref_out, atol=2e-2)
    close(lse, ref_lse, atol=1e-2)

"""The fused MoE path (two Triton grouped GEMMs over the tokens sorted by expert) against the per-expert loop.

CPU tensors run the kernels in the Triton interpreter (fp32 dots): tiny shapes only. The `gpu` test runs the compiled
kernels in bf16 on CUDA; the sm90 compile test lowers them offline without a GPU.
"""

from __future__ import annotations

import pytest
import torch

from engine.layers.fused_moe import MoETiles, align_by_expert, fused_experts
from engine.layers.moe import experts_loop

HAS_CUDA = torch.cuda.is_available()


def routed(tokens: int, experts: int, top_k: int, hidden: int, inter: int, gen: torch.Generator, skew: bool = False):
    """Random x, expert weights and a top-k routing (distinct experts per token, weights as the router gives)."""
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    scores = torch.randn(tokens, experts, generator=gen)
    if skew:  # most tokens pick expert 0 and 1: one expert's run spans several tiles, others are empty
        scores[:, :2] += 10.0
    weights, ids = scores.softmax(-1).topk(top_k, dim=-1)
    return x, w13, w2, weights, ids


def test_align_pads_each_expert_run_to_whole_tiles():
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]])  # rows 0..5; expert 1 gets none
    rows, tile_expert = align_by_expert(ids, 4, block_m=4)
    assert rows.numel() == 20  # T*K + min(E, T*K) * (M - 1) = 6 + 4 * 3, rounded up to whole tiles
    pad = 6
    assert rows[:12].tolist() == [1, 4, pad, pad, 0, 2, 5, pad, 3, pad, pad, pad]
    assert tile_expert.tolist() == [0, 2, 3, -1, -1]


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "hidden", "inter", "skew"),
    [(1, 8, 2, 32, 48, False), (7, 4, 2, 40, 24, False), (20, 6, 3, 32, 32, True)],
    ids=["decode-one-token", "ragged-dims", "skewed-routing"],
)
def test_fused_equals_the_expert_loop_in_the_interpreter(tokens, experts, top_k, hidden, inter, skew):
    gen = torch.Generator().manual_seed(tokens)
    x, w13, w2, weights, ids = routed(tokens, experts, top_k, hidden, inter, gen, skew)
    out = fused_experts(x, w13, w2, weights, ids)
    torch.testing.assert_close(out, experts_loop(x, w13, w2, weights, ids), atol=2e-5, rtol=1e-4)


def test_fused_of_no_tokens_is_empty():
    x, w13, w2, weights, ids = routed(0, 4, 2, 32, 32, torch.Generator().manual_seed(0))
    assert fused_experts(x, w13, w2, weights, ids).shape == (0, 32)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 8, 64, 300])
def test_gpu_fused_bf16_matches_the_loop(tokens):
    """DeepSeek-V2-Lite's expert shapes (64 experts, top 6, hidden 2048, 1408 per expert) in bf16 on CUDA."""
    gen = torch.Generator().manual_seed(1)
    x, w13, w2, weights, ids = routed(tokens, 64, 6, 2048, 1408, gen)
    x, w13, w2 = (t.to("cuda", torch.bfloat16) for t in (x, w13, w2))
    weights, ids = weights.cuda(), ids.cuda()
    out = fused_experts(x, w13, w2, weights, ids)
    ref = experts_loop(x.float(), w13.float(), w2.float(), weights, ids)
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("kernel", ["gate_up", "down"])
@pytest.mark.parametrize("tiles", [MoETiles(16, 64, 128, 4, 4), MoETiles(64, 64, 64, 4, 3)], ids=["decode", "batch"])
def test_kernels_compile_for_hopper_without_a_gpu(kernel, tiles):
    """The compiled path's tiles lower to sm90 code offline and fit an H100/H200 block's 227 KiB shared memory."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from engine.layers.fused_moe import _kernels

    fn = getattr(_kernels(False), kernel)
    names = list(inspect.signature(fn.fn).parameters)
    consts = {"BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n, "BLOCK_K": tiles.block_k, "DOT_F32": False,
              "PRECISION": None}  # fmt: skip
    pointers = {"ROWS": "*i64", "TILE_EXPERT": "*i64", "WEIGHTS": "*fp32", "OUT": "*bf16" if kernel == "gate_up"
                else "*fp32"}  # fmt: skip
    sig = {n: "constexpr" if n in consts else pointers.get(n, "*bf16") if n.isupper() else "i32" for n in names}
    try:
        src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in consts.items()})
    except TypeError as exc:
        pytest.skip(f"this triton's ASTSource differs: {exc}")
    options = {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages}
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    assert "ptx" in compiled.asm and compiled.metadata.shared <= 227 * 1024

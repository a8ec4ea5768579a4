"""Layer pieces against HF's (or torch's) own functions: rotary embeddings, packed matmuls, the KV cache, the
engine's SiLU-and-mul and argmax kernels."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.deepseek_v2.modeling_deepseek_v2 import apply_rotary_emb
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from engine.attention import kv_cache
from engine.checkpoints.tiny import make_tiny_checkpoint
from engine.core.sampler import greedy
from engine.kernels import cpu_kernels
from engine.kernels.cpu_gemm import PackableLinear, pack_weight, packed_linear, packing_available
from engine.kernels.cpu_isa import detect
from engine.layers.activation import silu_and_mul
from engine.layers.rotary import RotaryEmbedding

HEAD_DIM = 64
NEEDS_KERNELS = pytest.mark.skipif(not cpu_kernels.cpu_kernels_available(), reason="the CPU kernels did not build here")
# the ATen kernels torch runs at each level, whose vector exp the SiLU kernel shares (cpu_isa caps torch alike)
ATEN_CAPABILITY = {"avx512": "AVX512", "avx2": "AVX2", "baseline": "DEFAULT"}


def _config() -> LlamaConfig:
    return LlamaConfig(hidden_size=4 * HEAD_DIM, num_attention_heads=4, max_position_embeddings=4096)


def test_neox_rope_is_bitwise_hf():
    cfg = _config()
    positions = torch.tensor([0, 1, 7, 100, 2047, 4095])
    x = torch.randn(len(positions), 3, HEAD_DIM, generator=torch.Generator().manual_seed(0))
    rope = RotaryEmbedding(cfg, HEAD_DIM, 4096, interleaved=False, device=torch.device("cpu"))
    ours = rope.apply(x, *rope.lookup(positions))
    cos, sin = LlamaRotaryEmbedding(cfg)(x, positions[None])
    theirs, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos, sin)
    assert torch.equal(ours, theirs[0].transpose(0, 1))


def test_interleaved_rope_matches_hf_deepseek():
    cfg = _config()
    positions = torch.tensor([0, 3, 511, 4095])
    x = torch.randn(len(positions), 2, HEAD_DIM, generator=torch.Generator().manual_seed(1))
    rope = RotaryEmbedding(cfg, HEAD_DIM, 4096, interleaved=True, device=torch.device("cpu"))
    ours = rope.apply(x, *rope.lookup(positions))
    inv_freq = 1.0 / (cfg.rope_parameters["rope_theta"] ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    freqs_cis = torch.polar(torch.ones(len(positions), HEAD_DIM // 2), torch.outer(positions.float(), inv_freq))
    theirs, _ = apply_rotary_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], freqs_cis[None])
    torch.testing.assert_close(ours, theirs[0].transpose(0, 1), rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_cache_is_zero_and_writable(dtype):
    storage, views = kv_cache.allocate(3, 5, 16, 2, 8, False, dtype, torch.device("cpu"), head_major=True)
    assert storage.shape == (5, 3, 2, 2, 16, 8) and storage.dtype == dtype  # block-major across layers
    assert not storage.any()
    keys, values = views[1]
    assert keys.shape == (5, 16, 2, 8) and keys.stride(0) == 3 * 2 * 2 * 16 * 8
    keys[4, 15, 1] = 1.0
    values[0, 0, 0] = 2.0
    assert storage.sum().item() == 8 * 1.0 + 8 * 2.0
    assert storage[4, 1, 0, 1, 15].eq(1.0).all() and storage[0, 1, 1, 0, 0].eq(2.0).all()


def _onednn_packs(dtype: torch.dtype) -> bool:
    """oneDNN packs fp32 wherever its ops exist, bf16 only where the ISA level allows it (AVX-512, AVX-NE-CONVERT)."""
    return packing_available() and (dtype == torch.float32 or detect().onednn_bf16)


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("rows", [1, 17])
def test_packed_linear_matches_f_linear(dtype, atol, rows):
    if not _onednn_packs(dtype):
        pytest.skip(f"oneDNN does not pack {dtype} at ISA level {detect().describe()} (the layers take another GEMM)")
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 40, generator=g).to(dtype), torch.randn(96, generator=g).to(dtype)
    x = torch.randn(rows, 40, generator=g).to(dtype)
    out = packed_linear(x, pack_weight(weight), bias)
    assert out.dtype == dtype and out.shape == (rows, 96)
    torch.testing.assert_close(out.float(), torch.nn.functional.linear(x, weight, bias).float(), atol=atol, rtol=1e-2)


def test_half_weights_are_not_packed():
    layer = PackableLinear()
    layer.weight = torch.nn.Parameter(torch.ones(4, 4, dtype=torch.float16), requires_grad=False)
    layer.pack()
    assert layer.packed is None and layer.gemm == "torch" and layer.gemv_rows == 0


def test_streamlined_attributes_are_the_modules_own_and_follow_reassignment():
    from torch import nn

    from engine.models.base import streamline_modules

    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    streamline_modules(model)
    first = model[0]
    assert first.__dict__["weight"] is first._parameters["weight"] and model.__dict__["0"] is first
    replacement = nn.Parameter(torch.zeros(4, 3))
    first.weight = replacement  # nn.Module.__setattr__ must win over the inlined entry
    assert first.weight is replacement and first._parameters["weight"] is replacement
    assert torch.equal(first(torch.ones(1, 3)), first.bias.detach().view(1, 4))


def test_streamlined_calls_go_straight_to_forward_and_refuse_hooks():
    """nn.Module.__call__ (where hooks run) is skipped: a global forward hook sees no call; per-module hooks are refused
    with an error instead of being skipped silently; the class keeps its name and isinstance."""
    from torch import nn
    from torch.nn.modules.module import register_module_forward_hook

    from engine.models.base import streamline_modules

    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU())
    expected = model(torch.ones(2, 3))
    streamline_modules(model)
    seen = []
    handle = register_module_forward_hook(lambda module, args, out: seen.append(type(module).__name__))
    try:
        assert torch.equal(model(torch.ones(2, 3)), expected)
    finally:
        handle.remove()
    assert seen == []
    assert isinstance(model[0], nn.Linear) and type(model[0]).__name__ == "Linear"
    with pytest.raises(RuntimeError, match="Linear: the engine's modules call forward directly and run no hooks"):
        model[0].register_forward_hook(lambda *a: None)
    streamline_modules(model)  # twice: the same classes, not subclasses of subclasses
    assert type(model[0]).__mro__[1] is nn.Linear


@pytest.mark.parametrize("arch", ["llama", "deepseek_v2"])
def test_rope_tables_build_under_another_default_device(arch, tmp_path):
    """The model is built under `with torch.device(cuda)`; the yarn path's frequencies come from HF on CPU, so every
    table must be built on one explicit device (this failed on an H200 for DeepSeek-V2 only). `meta` stands in."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(make_tiny_checkpoint(tmp_path / arch, arch))
    dim = getattr(cfg, "qk_rope_head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    expected = RotaryEmbedding(cfg, dim, 64, interleaved=arch != "llama", device=torch.device("cpu"))
    with torch.device("meta"):
        rope = RotaryEmbedding(cfg, dim, 64, interleaved=arch != "llama", device=torch.device("cpu"))
    assert torch.equal(rope.cos, expected.cos) and torch.equal(rope.sin, expected.sin)


@NEEDS_KERNELS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "width"), [(16, 1536), (3, 37), (5, 100), (1, 7)])  # widths off the vector runs
def test_silu_and_mul_kernel_gives_torchs_bits(dtype, rows, width):
    g = torch.Generator().manual_seed(width)
    x = (torch.randn(rows, 3 * width, generator=g) * 6).to(dtype)[:, : 2 * width]  # rows strided, as a view can be
    x[0, :3] = torch.tensor([float("inf"), -float("inf"), 0.0]).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    out = cpu_kernels.silu_and_mul(x)
    want = torch.nn.functional.silu(gate) * up
    assert out.dtype == dtype and out.shape == (rows, width)
    torch.testing.assert_close(silu_and_mul(x), out, rtol=0, atol=0, equal_nan=True)
    if torch.backends.cpu.get_cpu_capability() == ATEN_CAPABILITY[detect().level]:
        # the same bits: the same exp (ATen's vector one, Sleef's on x86) in the same runs (NaN where -inf * 0)
        torch.testing.assert_close(out, want, rtol=0, atol=0, equal_nan=True)
    else:  # torch dispatches to another ISA's kernels than this build's (another exp): within rounding
        torch.testing.assert_close(out, want, rtol=1e-6 if dtype == torch.float32 else 8e-3, atol=0, equal_nan=True)


@NEEDS_KERNELS
def test_argmax_kernel_picks_what_torch_picks():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(9, 49_157, generator=g)  # a width off every vector size
    logits[1, [10, 400, 49_000]] = 50.0  # ties: the first
    logits[2, [3, 77]] = float("nan")  # NaN counts as the largest: the first NaN
    logits[3] = float("-inf")  # nothing finite: index 0
    logits[4, [5, 6]] = torch.tensor([0.0, -0.0]) + 1e9  # equal maxima of either sign
    logits[5, -1] = float("inf")
    logits[6, 0] = float("nan")
    want = logits.argmax(dim=-1)
    assert torch.equal(cpu_kernels.argmax_rows(logits), want)
    assert torch.equal(greedy(logits), want)
    assert torch.equal(greedy(logits[:, :1000]), logits[:, :1000].argmax(dim=-1))  # strided rows
    assert torch.equal(greedy(logits.T.contiguous().T), want)  # a last dim that is not contiguous: torch's argmax
    assert greedy(torch.empty(0, 10)).shape == (0,)

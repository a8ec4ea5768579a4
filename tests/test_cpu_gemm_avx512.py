"""The AVX-512 panel GEMM (16 lanes; bf16 by AVX512-BF16 dot products, vdpbf16ps) checked on any CPU.

On a CPU with AVX512-BF16 the engine's own kernel build is that code, and these tests run it (`torch.ops.dcpctl`).
Elsewhere they build csrc/cpu_gemm.cpp once more with DCPCTL_EMULATE_AVX512_BF16: the same source, SIMDe's portable
intrinsics (the header-only `libsimde-dev`) standing in for AVX-512F and vdpbf16ps, its ops under
`torch.ops.dcpctl_avx512_emulated`. Without SIMDe's headers they skip, saying so. Emulation checks the code's logic
(layout, padding, row blocks, partial panels); the instructions' speed, and their flushing of bf16 subnormals to
zero, show only on the real CPU.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import cpu_gemm, cpu_isa, cpu_kernels
from engine.kernels.cpu_paths import BF16_GEMM_ENV
from tests.oracle import engine_bf16_tokens

pytestmark = pytest.mark.slow  # the emulated build compiles for ~15 s on 2 cores

GEMM_SOURCE = Path(cpu_kernels.__file__).with_name("csrc") / "cpu_gemm.cpp"
SIMDE_HEADER = Path("simde", "x86", "avx512", "dpbf16.h")
EMULATED = "dcpctl_avx512_emulated"  # the ops namespace of the emulated build (cpu_gemm.cpp)
PANEL = 32  # output columns per panel with 16 lanes


def simde_found() -> bool:
    """Whether the compiler finds SIMDe's AVX512-BF16 header in the usual include directories (or CPATH)."""
    dirs = [*os.environ.get("CPATH", "").split(os.pathsep), "/usr/local/include", "/usr/include"]
    return any((Path(d) / SIMDE_HEADER).is_file() for d in dirs if d)


@pytest.fixture(scope="module")
def avx512_ops():
    """The ops of an AVX-512 + AVX512-BF16 panel GEMM: this CPU's own build where it has those, else the emulation."""
    isa = cpu_isa.detect()
    if isa.bf16_dot:
        if not cpu_kernels.cpu_kernels_available():
            pytest.skip("the CPU kernels did not build here")
        return torch.ops.dcpctl
    if not simde_found():
        pytest.skip(f"no AVX512-BF16 here, and no SIMDe ({SIMDE_HEADER}) to emulate it: apt-get install libsimde-dev")
    flags = [*cpu_kernels.build_flags(isa), "-DDCPCTL_EMULATE_AVX512_BF16"]
    problem = cpu_kernels.build_kernels((GEMM_SOURCE,), cpu_kernels.build_name(isa, EMULATED), flags)
    assert problem is None, problem
    return getattr(torch.ops, EMULATED)


def _bf16_within_one_step(out: torch.Tensor, want: torch.Tensor, magnitude: torch.Tensor, k: int) -> None:
    """bf16 outputs of an fp32-accumulated product, rounded once: at most one bf16 step from the exact value, plus
    what k fp32 roundings of sums up to `magnitude` (sum of |x * w|) can add where the terms cancel."""
    step = torch.finfo(torch.bfloat16).eps * want.abs().clamp_min(torch.finfo(torch.float32).tiny)
    assert ((out.double() - want).abs() <= step + k * torch.finfo(torch.float32).eps * magnitude).all()


def _case(rows: int, n: int, k: int, dtype: torch.dtype, with_bias: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype) if with_bias else None
    return torch.randn(rows, k, generator=g).to(dtype), weight, bias


def _check(ops, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """panel_linear against the exact (fp64) product and, in bf16, against F.linear's bf16 result."""
    n, k = weight.shape
    out = ops.panel_linear(x, ops.pack_panels(weight), n, k, bias)
    want = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert out.dtype == x.dtype and out.shape == (x.shape[0], n)
    if x.dtype == torch.float32:
        torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    else:
        magnitude = F.linear(x.double().abs(), weight.double().abs(), None if bias is None else bias.double().abs())
        _bf16_within_one_step(out, want, magnitude, x.shape[1] + 1)
        torch.testing.assert_close(out.float(), F.linear(x, weight, bias).float(), atol=0.05, rtol=2e-2)


@pytest.mark.parametrize(("dtype", "k"), [(torch.float32, 77), (torch.bfloat16, 77), (torch.bfloat16, 1)])
def test_the_build_packs_16_lane_panels_and_bf16_pairs(avx512_ops, dtype, k):
    """What runs is the AVX-512 code: panels of 32 columns; bf16 ones in pairs of k values (an odd k padded with 0)."""
    weight = torch.arange(1, 40 * k + 1, dtype=torch.float32).reshape(40, k).to(dtype)
    panels = avx512_ops.pack_panels(weight)
    if dtype == torch.float32:
        assert panels.shape == (2, k, PANEL)
        assert torch.equal(panels[0, :, 3], weight[3]) and torch.equal(panels[1, :, 7], weight[PANEL + 7])
        return
    steps = (k + 1) // 2
    assert panels.shape == (2, steps, 2 * PANEL)
    pairs = panels.reshape(2, steps, PANEL, 2)  # [panel, k pair, column, k within the pair]
    assert torch.equal(pairs[1, :, 5].flatten()[:k], weight[PANEL + 5])
    assert (pairs[1, :, 40 - PANEL :] == 0).all()  # columns past n
    if k % 2:
        assert (pairs[:, -1, :, 1] == 0).all()  # the padding k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", range(1, 41))
@pytest.mark.parametrize("with_bias", [False, True])
def test_panel_gemm_matches_exact_products(avx512_ops, dtype, rows, with_bias):
    """Every row count up to 40 (each register block size, one to four blocks), odd n and k: a partial last panel,
    an unpaired last k."""
    _check(avx512_ops, *_case(rows, 333, 77, dtype, with_bias, seed=rows))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 2, 3, 64, 131])
@pytest.mark.parametrize("n", [1, 31, 33, 96])
def test_panel_gemm_takes_any_k_and_n(avx512_ops, dtype, k, n):
    for rows in (1, 16, 29):
        _check(avx512_ops, *_case(rows, n, k, dtype, with_bias=True, seed=k * n + rows))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_panel_gemm_propagates_nan_and_inf_as_f_linear(avx512_ops, dtype):
    """A NaN or inf in x reaches exactly the outputs of its row, as in F.linear: also from the unpaired last k."""
    x, weight, bias = _case(16, 70, 77, dtype, with_bias=True, seed=5)
    x[2, 3] = float("nan")
    x[5, 76] = float("nan")  # the last k, paired with the padding
    x[9, 10] = float("inf")
    x[11, 76] = float("-inf")
    weight[7, 0] = float("inf")  # column 7: x[:, 0] * inf
    out = avx512_ops.panel_linear(x, avx512_ops.pack_panels(weight), 70, 77, bias)
    want = F.linear(x.double(), weight.double(), bias.double())
    assert torch.equal(out.isnan(), want.isnan()) and out[[2, 5]].isnan().all()
    infinite = want.isinf()
    assert torch.equal(out.isinf(), infinite) and torch.equal(out.double()[infinite].sign(), want[infinite].sign())
    finite = want.isfinite()
    torch.testing.assert_close(out.double()[finite], want[finite], atol=0.05, rtol=2e-2)


@pytest.mark.parametrize("k", [1, 31, 32, 33, 77, 576])
@pytest.mark.parametrize("n", [1, 3, 4, 9])
def test_bf16_gemv_by_dot_products_takes_any_k_and_n(avx512_ops, k, n):
    """The bf16 GEMV (vdpbf16ps on 32 k values a register, 4 weight rows at a time): a zero-padded last piece of k, a
    short last group of rows, 1 and 2 rows of x, against the exact product."""
    for rows in (1, 2):
        x, weight, bias = _case(rows, n, k, torch.bfloat16, with_bias=rows == 2, seed=k * n + rows)
        out = avx512_ops.gemv(x, weight, bias)
        want = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
        magnitude = F.linear(x.double().abs(), weight.double().abs(), None if bias is None else bias.double().abs())
        assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
        _bf16_within_one_step(out, want, magnitude, k + 1)


def test_bf16_gemv_propagates_nan_and_inf_as_f_linear(avx512_ops):
    x, weight, _ = _case(2, 9, 77, torch.bfloat16, with_bias=False, seed=3)
    x[0, 76] = float("nan")  # in the zero-padded last piece of k
    weight[5, 3] = float("inf")
    out, want = avx512_ops.gemv(x, weight), F.linear(x.double(), weight.double())
    assert torch.equal(out.isnan(), want.isnan()) and out[0].isnan().all()
    assert torch.equal(out.isinf(), want.isinf()) and torch.equal(
        out[want.isinf()].sign(), want[want.isinf()].sign().bfloat16()
    )


def test_panels_of_another_dtype_or_shape_are_refused(avx512_ops):
    weight = torch.randn(40, 77)
    x = torch.randn(3, 77).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="share a dtype"):
        avx512_ops.panel_linear(x, avx512_ops.pack_panels(weight), 40, 77)
    with pytest.raises(RuntimeError, match="panels from pack_panels"):
        avx512_ops.panel_linear(x[:, :64], avx512_ops.pack_panels(weight.to(torch.bfloat16)), 40, 64)
    # an odd k's pairs have the shape of k + 1's: x's width is checked against the weight's k, not the panels
    with pytest.raises(RuntimeError, match=r"x \[m, k\] expected"):
        avx512_ops.panel_linear(
            torch.randn(3, 78).to(torch.bfloat16), avx512_ops.pack_panels(weight.to(torch.bfloat16)), 40, 77
        )


def test_engine_bf16_tokens_through_this_gemm_are_hf_bf16s(avx512_ops, tmp_path, tiny_models, monkeypatch):
    """A tiny Llama in bf16 with every linear layer of more than 2 rows on this panel GEMM (the emulation, where the
    CPU lacks AVX512-BF16): greedy tokens are HF bf16's by the rule of tests/oracle.py."""
    calls = []

    def panel_linear(x, panels, shape, bias=None):
        calls.append(x.shape[0])
        return avx512_ops.panel_linear(x, panels, *shape, bias)

    monkeypatch.setenv(BF16_GEMM_ENV, "panels")
    monkeypatch.setattr(cpu_gemm, "pack_panels", lambda weight: avx512_ops.pack_panels(weight.detach().contiguous()))
    monkeypatch.setattr(cpu_gemm, "panel_linear", panel_linear)
    engine_bf16_tokens(tmp_path, tiny_models("llama"))
    assert max(calls) >= 130 and calls.count(4) > 20  # the prompts' prefill and the 4-row decode steps

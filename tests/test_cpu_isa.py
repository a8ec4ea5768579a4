"""The CPU's ISA level and every kernel path chosen from it: detection, DCPCTL_CPU_ISA, the kernel build per level,
the GEMM per dtype (oneDNN where it packs, the engine's panel GEMM elsewhere) and the fallback when a GEMM refuses.

The last tests run the engine's equivalence tests again in a process forced to the AVX2 view (DCPCTL_CPU_ISA=avx2,
which also caps oneDNN and ATen at AVX2), so a machine with AVX-512 covers what AVX2-only CPUs run.
"""

from __future__ import annotations

import logging
import os
import platform
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from engine.errors import UserError
from engine.kernels import cpu_gemm, cpu_isa, cpu_kernels
from engine.kernels.cpu_paths import (
    BF16_GEMM_ENV,
    PREFILL_MIN_ROWS,
    PREFILL_PRODUCT_NAMES,
    CpuPaths,
    bf16_dot_leads,
    gemm_choices,
    prefill_gemm_choices,
    requested_bf16_gemm,
)
from tests.oracle import engine_bf16_tokens, hf_bf16_disagreements

REPO = Path(__file__).resolve().parents[1]
ZEN4 = cpu_isa._names(
    "fpu sse2 ssse3 sse4_1 sse4_2 cx16 lahf_lm popcnt movbe xsave avx f16c fma abm bmi1 bmi2 avx2 avx512f avx512dq "
    "avx512cd avx512bw avx512vl avx512_bf16 avx512_vnni"
)
EPYC_AVX2 = frozenset(f for f in ZEN4 if not f.startswith("avx512"))  # the machine: fma avx f16c avx2
NEEDS_KERNELS = pytest.mark.skipif(not cpu_kernels.cpu_kernels_available(), reason="the CPU kernels did not build here")


@pytest.fixture
def isa_view(monkeypatch):
    """Set DCPCTL_CPU_ISA for this test only (detection is cached per process)."""

    def _set(level: str | None) -> cpu_isa.CpuIsa:
        if level is None:
            monkeypatch.delenv(cpu_isa.ENV, raising=False)
        else:
            monkeypatch.setenv(cpu_isa.ENV, level)
        cpu_isa.detect.cache_clear()
        return cpu_isa.detect()

    yield _set
    monkeypatch.undo()
    cpu_isa.detect.cache_clear()


@pytest.mark.parametrize(
    ("flags", "machine", "level"),
    [
        (ZEN4, "x86_64", "avx512"),
        (EPYC_AVX2, "x86_64", "avx2"),
        (EPYC_AVX2 - {"movbe"}, "x86_64", "baseline"),  # x86-64-v3 needs every one of its flags
        (ZEN4 - {"avx512vl"}, "x86_64", "avx2"),
        (ZEN4, "aarch64", "baseline"),
        (frozenset(), "x86_64", "baseline"),
    ],
)
def test_level_of_cpu_flags(flags, machine, level):
    assert cpu_isa.level_of(flags, machine) == level


def test_forcing_a_lower_level_hides_the_flags_above_it(isa_view):
    native = isa_view(None)
    if native.level != "avx512":
        pytest.skip(f"needs an AVX-512 CPU to force below it (this one: {native.describe()})")
    forced = isa_view("avx2")
    assert forced.level == "avx2" and forced.detected == "avx512" and forced.forced
    assert not any(f.startswith("avx512") for f in forced.flags) and "avx2" in forced.flags
    assert not forced.onednn_bf16 and forced.march == "x86-64-v3"
    assert forced.describe() == "avx2, forced by DCPCTL_CPU_ISA (the CPU has avx512)"
    assert cpu_isa.torch_isa_env(forced) == {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    assert cpu_isa.torch_isa_env(native) == {}
    assert isa_view("baseline").march is None


def test_forcing_never_raises_the_level_and_typos_are_named(isa_view):
    native = isa_view(None)
    highest = isa_view("avx512")
    assert highest.level == native.level and not highest.forced
    with pytest.raises(UserError, match=r"DCPCTL_CPU_ISA='avx3' is not one of auto, baseline, avx2, avx512"):
        isa_view("avx3")


def test_each_level_has_its_own_portable_build(isa_view):
    """Each level's instruction sets (never native), and the level in the cache key: a shared home never loads a
    build the CPU cannot run, and levels do not rebuild over each other."""
    levels = {
        level: cpu_isa.CpuIsa(level, "avx512", frozenset())
        for level in ("baseline", "avx2", "avx512")  # what a CPU of each level would build
    }
    flags = {level: cpu_kernels.build_flags(isa) for level, isa in levels.items()}
    assert {"-mavx512f", "-mavx512vl", "-mavx2", "-mfma"} <= set(flags["avx512"])
    assert {"-mavx2", "-mfma", "-mf16c", "-mbmi2"} <= set(flags["avx2"]) and "-mavx512f" not in flags["avx2"]
    assert flags["baseline"] == cpu_kernels.BASE_CFLAGS
    assert not any("native" in f or f.startswith("-march") for fs in flags.values() for f in fs)
    names = {level: cpu_kernels.build_name(isa) for level, isa in levels.items()}
    assert len(set(names.values())) == 3
    assert "x86_64_v4" in names["avx512"] and "x86_64_v3" in names["avx2"] and "portable" in names["baseline"]


@pytest.mark.parametrize("level", ["avx2", "avx512"])
def test_target_flags_are_what_the_psabi_level_turns_on(level):
    """The spelled-out flags (which GCC < 11 also knows) define exactly the ISA macros `-march=x86-64-vN` does."""
    isa = cpu_isa.CpuIsa(level, level, frozenset())
    compiler = cpu_kernels.compiler()

    def macros(flags: list[str]) -> set[str]:
        cmd = [compiler, "-x", "c++", "-dM", "-E", *flags, "-"]
        run = subprocess.run(cmd, input="", capture_output=True, text=True)
        if run.returncode:
            return set()
        return {line for line in run.stdout.splitlines() if line.startswith("#define __")}

    by_level = macros([f"-march={isa.march}"])
    if not by_level:
        pytest.skip(f"{compiler} does not know -march={isa.march} (GCC < 11): nothing to compare with")
    assert macros(isa.target_flags) == by_level


def test_a_compiler_that_cannot_build_a_level_falls_back_to_the_next():
    """The builds tried, best first: an AVX512-BF16 CPU's own, plain AVX-512, AVX2, portable; a lower level never
    tries a higher one."""
    zen4 = cpu_isa.CpuIsa("avx512", "avx512", ZEN4)
    variants = [isa.build_variant for isa in zen4.kernel_builds()]
    assert variants == ["x86-64-v4-avx512bf16", "x86-64-v4", "x86-64-v3", "portable"]
    assert not any(isa.bf16_dot for isa in zen4.kernel_builds()[1:])
    avx2 = cpu_isa.CpuIsa("avx2", "avx2", EPYC_AVX2)
    assert [isa.build_variant for isa in avx2.kernel_builds()] == ["x86-64-v3", "portable"]
    forced = cpu_isa.CpuIsa("avx2", "avx512", cpu_isa._visible_flags(ZEN4, "avx2"))
    assert [isa.build_variant for isa in forced.kernel_builds()] == ["x86-64-v3", "portable"]
    baseline = cpu_isa.CpuIsa("baseline", "baseline", frozenset())
    assert [isa.build_variant for isa in baseline.kernel_builds()] == ["portable"]


def test_avx512_bf16_cpus_get_a_build_of_their_own():
    """x86-64-v4 lacks AVX512-BF16: a CPU with it builds with -mavx512bf16 under another name; one without it,
    or the same CPU forced to AVX2, never gets that build."""
    zen4 = cpu_isa.CpuIsa("avx512", "avx512", ZEN4)
    no_bf16 = cpu_isa.CpuIsa("avx512", "avx512", ZEN4 - {"avx512_bf16"})
    forced = cpu_isa.CpuIsa("avx2", "avx512", cpu_isa._visible_flags(ZEN4, "avx2"))
    assert zen4.bf16_dot and not no_bf16.bf16_dot and not forced.bf16_dot
    assert cpu_kernels.build_flags(zen4)[-2:] == ["-mavx512vl", "-mavx512bf16"]
    assert "-mavx512bf16" not in cpu_kernels.build_flags(no_bf16) + cpu_kernels.build_flags(forced)
    assert cpu_kernels.build_name(zen4).startswith("dcpctl_cpu_kernels_x86_64_v4_avx512bf16_")
    assert cpu_kernels.build_name(no_bf16).startswith("dcpctl_cpu_kernels_x86_64_v4_")
    assert cpu_kernels.build_name(no_bf16) != cpu_kernels.build_name(zen4)
    assert cpu_kernels.build_name(forced).startswith("dcpctl_cpu_kernels_x86_64_v3_")


def test_gemm_choices_per_level_and_dtype():
    """bf16 batches: oneDNN where it runs on AMX tiles or the CPU has no AVX512-BF16, the panel GEMM's dot-product
    kernel on AVX512-BF16 without AMX (Zen 4) and with AVX2 (where oneDNN refuses bf16); fp32: the panel GEMM."""
    avx512 = cpu_isa.CpuIsa("avx512", "avx512", ZEN4)
    avx2 = cpu_isa.CpuIsa("avx2", "avx2", EPYC_AVX2)
    amx = cpu_isa.CpuIsa("avx512", "avx512", ZEN4 | {"amx_bf16", "amx_tile"})
    no_bf16 = cpu_isa.CpuIsa("avx512", "avx512", ZEN4 - {"avx512_bf16"})
    assert gemm_choices(avx512, "bfloat16", True) == ("panels", "onednn", "torch")
    assert gemm_choices(avx512, "bfloat16", False) == ("onednn", "torch")
    for isa in (amx, no_bf16):
        assert gemm_choices(isa, "bfloat16", True) == ("onednn", "panels", "torch")
    assert gemm_choices(avx2, "bfloat16", True) == ("panels", "onednn", "torch")
    assert gemm_choices(avx2, "bfloat16", False) == ("onednn", "torch")
    assert gemm_choices(avx512, "float32", True) == gemm_choices(avx2, "float32", True) == ("panels", "onednn", "torch")
    assert gemm_choices(avx2, "float16", True) == ("torch",)
    line = CpuPaths(avx2, "bfloat16", True, "cpu").describe()
    assert line == (
        "CPU ISA avx2; C++ kernels: x86-64-v3 build; bfloat16 linear layers: GEMV for 1-2 rows, engine panel GEMM "
        "for more; decode attention: engine paged decode kernel; prefill attention: vector path in fp32"
    )


def test_the_bf16_gemm_switch_puts_its_choice_first(monkeypatch):
    """DCPCTL_BF16_GEMM=panels runs the bf16 dot-product panel GEMM where oneDNN is the default (and says so);
    `onednn` asks for oneDNN first everywhere (a CPU that refuses it falls back at packing); float32 ignores it."""
    avx512 = cpu_isa.CpuIsa("avx512", "avx512", ZEN4)
    avx2 = cpu_isa.CpuIsa("avx2", "avx2", EPYC_AVX2)
    assert gemm_choices(avx512, "bfloat16", True, "panels") == ("panels", "onednn", "torch")
    assert prefill_gemm_choices(avx512, "bfloat16", True, "panels") == ("panels", "onednn", "torch")
    assert gemm_choices(avx2, "bfloat16", True, "onednn") == ("onednn", "panels", "torch")
    assert gemm_choices(avx512, "bfloat16", False, "panels") == ("onednn", "torch")
    assert gemm_choices(avx512, "float32", True, "onednn") == ("panels", "onednn", "torch")
    line = CpuPaths(avx512, "bfloat16", True, "cpu", "panels").describe()
    assert (
        "CPU ISA avx512 + avx512_bf16; C++ kernels: x86-64-v4-avx512bf16 build; bfloat16 linear layers: GEMV for 1-2 "
        "rows, engine panel GEMM (AVX512-BF16 dot products) for more;"
    ) in line
    amx = cpu_isa.CpuIsa("avx512", "avx512", ZEN4 | {"amx_bf16", "amx_tile"})
    assert "oneDNN packed for more;" in CpuPaths(amx, "bfloat16", True, "cpu").describe()
    assert "oneDNN packed from" not in CpuPaths(amx, "bfloat16", True, "cpu").describe()
    assert "engine panel GEMM (AVX512-BF16 dot products) for more, oneDNN packed from 512 rows;" in (
        CpuPaths(avx512, "bfloat16", True, "cpu").describe()
    )
    monkeypatch.setenv(BF16_GEMM_ENV, " Panels ")
    assert requested_bf16_gemm() == "panels"
    monkeypatch.setenv(BF16_GEMM_ENV, "mkl")
    with pytest.raises(UserError, match=r"DCPCTL_BF16_GEMM='mkl' is not one of auto, onednn, panels"):
        requested_bf16_gemm()


def test_plan_checks_name_the_bf16_prefill_attention_path():
    """bf16 on the cpu backend's kernel: AMX tiles with AMX, AVX512-BF16 dot products on Zen 4, the fp32 vector path
    without AVX512-BF16 (AVX2, or AVX-512 without it); nothing for fp32 (always the vector path), other backends, or
    without the kernels."""
    zen4 = cpu_isa.CpuIsa("avx512", "avx512", ZEN4)
    amx = cpu_isa.CpuIsa("avx512", "avx512", ZEN4 | {"amx_bf16", "amx_tile"})
    no_bf16 = cpu_isa.CpuIsa("avx512", "avx512", ZEN4 - {"avx512_bf16"})
    forced = cpu_isa.CpuIsa("avx2", "avx512", cpu_isa._visible_flags(ZEN4 | {"amx_bf16"}, "avx2"))
    for isa, name in (
        (amx, "AMX tiles (oneDNN brgemm)"),
        (zen4, "AVX512-BF16 dot products"),
        (no_bf16, "vector path in fp32"),
        (forced, "vector path in fp32"),
    ):
        assert CpuPaths(isa, "bfloat16", True, "cpu").describe().endswith(f"; prefill attention: {name}")
    for paths in (CpuPaths(zen4, "float32", True, "cpu"), CpuPaths(zen4, "bfloat16", True, "torch")):
        assert "prefill attention" not in paths.describe()
    assert "prefill attention" not in CpuPaths(zen4, "bfloat16", False, "cpu").describe()


def test_the_start_up_line_names_the_bf16_dot_product_kernel(monkeypatch):
    """What a rank prints: bf16 layers on the panel GEMM of an AVX512-BF16 build are named as its dot-product kernel;
    where the compiler could not make that build and the plain AVX-512 one loaded instead, they are not."""
    zen4 = cpu_isa.CpuIsa("avx512", "avx512", ZEN4)
    monkeypatch.setattr(cpu_gemm, "detect", lambda: zen4)
    monkeypatch.setattr(cpu_gemm, "kernel_isa", lambda: zen4)
    backend = types.SimpleNamespace(kernels=True, name="cpu")
    bf16 = cpu_gemm.cpu_paths_line(torch.bfloat16, {("panels", "panels"): 211}, backend, torch.bfloat16)
    assert "bfloat16 linear layers: " in bf16 and "engine panel GEMM (AVX512-BF16 dot products) (211 layers)" in bf16
    if cpu_kernels.cpu_kernels_available():  # the loaded build's bf16 prefill products, not the ISA's guess
        assert bf16.endswith(f"; prefill attention: {PREFILL_PRODUCT_NAMES[cpu_kernels.prefill_bf16_products()[0]]}")
    monkeypatch.setattr(cpu_gemm, "kernel_isa", lambda: zen4.kernel_builds()[1])
    fallback = cpu_gemm.cpu_paths_line(torch.bfloat16, {("panels", "panels"): 211}, backend, torch.bfloat16)
    assert "bfloat16 linear layers: GEMV for 1-2 rows, engine panel GEMM (211 layers)" in fallback
    fp32 = cpu_gemm.cpu_paths_line(torch.float32, {("panels", "panels"): 211}, backend, torch.float32)
    assert "engine panel GEMM (211 layers)" in fp32 and fp32.endswith("decode attention: engine paged decode kernel")
    fp16_cache = cpu_gemm.cpu_paths_line(torch.float32, {("panels", "panels"): 211}, backend, torch.float16)
    assert fp16_cache.endswith("decode attention: torch backend's paths (the kernels take float32 / bfloat16)")


def test_prefill_gemm_choices_per_level_and_dtype():
    """Prefill-sized fp32 and bf16 inputs take oneDNN with AVX-512; everything else takes what batched decode takes."""
    avx512 = cpu_isa.CpuIsa("avx512", "avx512", ZEN4)
    avx2 = cpu_isa.CpuIsa("avx2", "avx2", EPYC_AVX2)
    amx = cpu_isa.CpuIsa("avx512", "avx512", ZEN4 | {"amx_bf16", "amx_tile"})
    assert prefill_gemm_choices(avx512, "float32", True) == ("onednn", "panels", "torch")
    assert prefill_gemm_choices(avx512, "float32", False) == ("onednn", "torch")
    assert prefill_gemm_choices(avx512, "bfloat16", True) == ("onednn", "panels", "torch")
    for isa, dtype in ((avx2, "float32"), (amx, "bfloat16"), (avx2, "bfloat16"), (avx2, "float16")):
        assert prefill_gemm_choices(isa, dtype, True) == gemm_choices(isa, dtype, True)
    line = CpuPaths(avx512, "float32", True, "cpu").describe()
    assert f"GEMV for 1-2 rows, engine panel GEMM for more, oneDNN packed from {PREFILL_MIN_ROWS} rows;" in line
    assert f"from {PREFILL_MIN_ROWS} rows" not in CpuPaths(avx2, "float32", True, "cpu").describe()


@pytest.mark.parametrize(("dtype", "cache_dtype"), [("float32", "float16"), ("float16", None)])
def test_plan_checks_say_float16_decode_runs_on_the_torch_paths(dtype, cache_dtype):
    """The kernels take fp32 and bf16 only: the cpu backend decodes an fp16 model or cache on the torch paths."""
    avx2 = cpu_isa.CpuIsa("avx2", "avx2", EPYC_AVX2)
    line = CpuPaths(avx2, dtype, True, "cpu", cache_dtype=cache_dtype).describe()
    assert line.endswith("decode attention: torch backend's paths (the kernels take float32 / bfloat16)")
    assert (
        CpuPaths(avx2, "float32", True, "cpu", cache_dtype="bfloat16")
        .describe()
        .endswith("decode attention: engine paged decode kernel")
    )


def _layer(weight: torch.Tensor) -> cpu_gemm.PackableLinear:
    layer = cpu_gemm.PackableLinear()
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    layer.pack()
    return layer


def _bf16_within_one_step(out: torch.Tensor, want: torch.Tensor) -> None:
    """bf16 outputs of an fp32-accumulated product, rounded once: at most one bf16 step from the exact value."""
    step = torch.finfo(torch.bfloat16).eps * want.abs().clamp_min(torch.finfo(torch.float32).tiny)
    assert ((out.double() - want).abs() <= step).all()


@NEEDS_KERNELS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [0, 1, 3, 7, 16, 29, 77])
@pytest.mark.parametrize("with_bias", [False, True])
def test_panel_gemm_matches_exact_products(dtype, rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(333, 70, generator=g).to(dtype)  # odd sizes: a partial last panel, no vector-width k
    bias = torch.randn(333, generator=g).to(dtype) if with_bias else None
    x = torch.randn(rows, 70, generator=g).to(dtype)
    out = cpu_kernels.panel_linear(x, cpu_kernels.pack_panels(weight), weight.shape, bias)
    want = torch.nn.functional.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert out.dtype == dtype and out.shape == (rows, 333)
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    else:
        _bf16_within_one_step(out, want)


@NEEDS_KERNELS
def test_panel_gemm_keeps_nan_and_takes_strided_weights():
    weight = torch.randn(70, 40).t()  # a [40, 70] view with strides (1, 40)
    x = torch.randn(5, 70).to(torch.bfloat16)
    x[2, 3] = float("nan")
    out = cpu_kernels.panel_linear(x, cpu_kernels.pack_panels(weight.to(torch.bfloat16)), weight.shape)
    assert out[2].isnan().all() and not out[[0, 1, 3, 4]].isnan().any()
    torch.testing.assert_close(
        cpu_kernels.panel_linear(x.float()[:2], cpu_kernels.pack_panels(weight), weight.shape), x.float()[:2] @ weight.T
    )


@NEEDS_KERNELS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layers_take_the_gemm_the_isa_level_allows(dtype):
    """bf16 takes oneDNN where oneDNN packs it (AVX-512 / AVX-NE-CONVERT) unless the panel GEMM's dot-product kernel
    leads (AVX512-BF16 without AMX), else the panel GEMM (DCPCTL_BF16_GEMM chooses otherwise); fp32 the panels."""
    g = torch.Generator().manual_seed(1)
    weight, x = torch.randn(96, 64, generator=g).to(dtype), torch.randn(17, 64, generator=g).to(dtype)
    if not cpu_gemm.packing_available():
        pytest.skip("this torch build has no oneDNN packed linear")
    layer = _layer(weight)
    isa, requested = cpu_isa.detect(), requested_bf16_gemm()
    wanted = requested == "onednn" or (requested == "auto" and not bf16_dot_leads(isa))
    onednn = isa.onednn_bf16 and wanted  # a refused oneDNN falls back
    assert layer.gemm == ("onednn" if dtype == torch.bfloat16 and onednn else "panels")
    torch.testing.assert_close(layer.project(x).float(), (x.float() @ weight.float().T), atol=0.1, rtol=2e-2)


@NEEDS_KERNELS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_rows_on_each_side_of_the_prefill_bound_take_their_gemm(dtype, with_bias):
    """Below PREFILL_MIN_ROWS rows a layer runs its batched-decode GEMM, from it on its prefill GEMM (the same bits
    as calling each directly), and both give F.linear's product within the dtype's rounding."""
    if not cpu_gemm.packing_available():
        pytest.skip("this torch build has no oneDNN packed linear")
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(200, 72, generator=g).to(dtype)
    bias = torch.randn(200, generator=g).to(dtype) if with_bias else None
    layer = _layer(weight)
    isa = cpu_isa.detect()
    onednn = isa.level == "avx512" if dtype == torch.float32 else isa.onednn_bf16 and requested_bf16_gemm() != "panels"
    want_prefill = "onednn" if onednn else "panels"
    assert layer.prefill_gemm == want_prefill
    assert layer.prefill_rows == (PREFILL_MIN_ROWS if want_prefill != layer.gemm else sys.maxsize)
    for rows, gemm, packed in (
        (PREFILL_MIN_ROWS - 1, layer.gemm, layer.packed),
        (PREFILL_MIN_ROWS, layer.prefill_gemm, layer.prefill_packed),
        (3 * PREFILL_MIN_ROWS + 5, layer.prefill_gemm, layer.prefill_packed),
    ):
        x = torch.randn(rows, 72, generator=g).to(dtype)
        out = layer.project(x, bias)
        direct = (
            cpu_gemm.packed_linear(x, packed, bias)
            if gemm == "onednn"
            else cpu_kernels.panel_linear(x, packed, (200, 72), bias)
        )
        assert torch.equal(out, direct), f"{rows} rows did not take {gemm}"
        want = torch.nn.functional.linear(x, weight, bias)
        tolerance = {"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.1, "rtol": 2e-2}
        torch.testing.assert_close(out.float(), want.float(), **tolerance)


@NEEDS_KERNELS
def test_a_layer_packs_a_weight_once_per_gemm_and_tries_a_refusing_one_once(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_gemm, "_pack_for", lambda gemm, weight: calls.append(gemm) or None)
    monkeypatch.setattr(cpu_gemm, "gemm_choices", lambda *_: ("onednn", "panels", "torch"))
    monkeypatch.setattr(cpu_gemm, "prefill_gemm_choices", lambda *_: ("onednn", "torch"))
    layer = _layer(torch.randn(40, 24))
    assert calls == ["onednn", "panels"] and layer.gemm == layer.prefill_gemm == "torch"
    assert layer.prefill_rows == sys.maxsize


@NEEDS_KERNELS
def test_an_avx2_view_takes_the_panel_gemm_for_bf16(isa_view):
    isa_view("avx2")
    bf16 = _layer(torch.randn(64, 32).to(torch.bfloat16))
    assert bf16.gemm == bf16.prefill_gemm == "panels"
    assert _layer(torch.randn(64, 32)).gemm == "panels"


@NEEDS_KERNELS
def test_a_refused_packing_falls_back_instead_of_crashing(monkeypatch, caplog):
    """torch raises for oneDNN bf16 packing on CPUs it does not support: the layer takes the next GEMM."""

    def refuse(weight):
        raise RuntimeError(
            "mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl "
            "and avx512dq"
        )

    monkeypatch.setattr(cpu_gemm, "pack_weight", refuse)
    monkeypatch.setattr(cpu_gemm, "gemm_choices", lambda *_: ("onednn", "panels", "torch"))
    cpu_gemm._warn_refused.cache_clear()
    weight, x = torch.randn(40, 24).to(torch.bfloat16), torch.randn(9, 24).to(torch.bfloat16)
    with caplog.at_level(logging.WARNING):
        layer = _layer(weight)
    assert layer.gemm == "panels"
    assert "oneDNN refused to pack bfloat16 weights here (mkldnn_reorder_linear_weight" in caplog.text
    _bf16_within_one_step(layer.project(x), x.double() @ weight.double().T)

    monkeypatch.setattr(cpu_gemm, "gemm_choices", lambda *_: ("onednn", "torch"))
    layer = _layer(weight)  # no engine kernels either: torch's F.linear
    assert layer.gemm == "torch" and layer.packed is None
    assert torch.equal(layer.project(x), torch.nn.functional.linear(x, weight))


SMOLLM2_HEADS = {"head_dim": 64, "num_heads": 6, "num_kv_heads": 2, "hidden_size": 96}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sizes", "settings"),
    [
        ({}, {}),
        (SMOLLM2_HEADS, {}),
        (SMOLLM2_HEADS, {"scheduler.max_num_batched_tokens": 48}),
    ],
    ids=["small-heads", "smollm2-heads", "smollm2-heads-chunked"],
)
def test_engine_bf16_tokens_are_hf_bf16s(tmp_path, tiny_models, sizes, settings):
    """bf16 greedy tokens against HF bf16 by the rule in tests/oracle.py (`hf_bf16_disagreements`), on the
    path this process's ISA level chooses; the forced-AVX2 run below repeats it on the AVX2 path. Heads of 64 dims
    in groups of 3 (SmolLM2's) take the decode kernel's vector paths (AVX512-BF16 key dots where the CPU has them);
    a budget of 48 tokens chunks the 130-token prompt, whose later chunks attend to their cached context and to
    themselves in one pass of the prefill kernel (brgemm on AMX)."""
    folder = tiny_models("llama", **sizes)
    prompts, outputs = engine_bf16_tokens(tmp_path, folder, settings)
    shifted = [(t + 1) % 500 for t in outputs[-1]]  # the rule does reject tokens HF would not pick
    assert len(hf_bf16_disagreements(folder, prompts[-1], shifted)) > len(shifted) // 2


def _suite_passes(suite: list[str], env: dict[str, str], tmp_path: Path, timeout: int) -> None:
    """Run pytest on `suite` in a process with `env`: every test passes (none fails or errors)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp", str(tmp_path), *suite]
    result = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else result.stderr[-2000:]
    assert result.returncode == 0, result.stdout[-4000:]
    assert " passed" in summary and "failed" not in summary and "error" not in summary, summary


def _forced_avx2_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")}
    return dict(env, **{cpu_isa.ENV: "avx2"})


FORCED_PROBE = """
import engine, torch
from engine.kernels import cpu_isa
from engine.kernels import cpu_gemm, cpu_kernels
isa = cpu_isa.detect()
w = torch.randn(64, 32).to(torch.bfloat16)
try:
    cpu_gemm.pack_weight(w)
    onednn_bf16 = "packs"
except RuntimeError:
    onednn_bf16 = "refuses"
layer = cpu_gemm.PackableLinear()
layer.weight = torch.nn.Parameter(w, requires_grad=False)
layer.pack()
print(isa.level, cpu_kernels.loaded_build(), torch.backends.cpu.get_cpu_capability(), onednn_bf16, layer.gemm)
"""


@pytest.mark.slow
def test_forced_avx2_process_runs_what_an_avx2_cpu_runs():
    """DCPCTL_CPU_ISA=avx2: the x86-64-v3 kernel build, torch dispatching AVX2 kernels, oneDNN refusing bf16 as on
    an AVX2-only CPU (so the emulation is real), and bf16 layers on the panel GEMM."""
    if cpu_isa.level_of(cpu_isa._cpu_flags(), platform.machine()) == "baseline":
        pytest.skip("this CPU has no AVX2")
    result = subprocess.run(
        [sys.executable, "-c", FORCED_PROBE], env=_forced_avx2_env(), cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    level, build, capability, onednn_bf16, gemm = result.stdout.split()
    assert (level, capability, onednn_bf16, gemm) == ("avx2", "AVX2", "refuses", "panels")
    assert build.startswith("dcpctl_cpu_kernels_x86_64_v3_")


FORCED_SUITE = [
    "tests/test_engine_equivalence.py::test_greedy_matches_hf",
    "tests/test_engine_equivalence.py::test_chunked_prefill_mixed_batches_and_preemption",  # context in one pass
    "tests/test_cpu_backend.py",
    "tests/test_layers.py",
    "tests/test_cpu_prefill.py",  # the vector prefill attention (bf16 too: no AMX path in the x86-64-v3 build)
    "tests/test_kv_quant.py",  # the x86-64-v3 build's fp8 cache store and decode
    "tests/test_kv_scales.py",  # its stores and rotary stores with fp8 scales
    "tests/test_cpu_isa.py::test_panel_gemm_matches_exact_products",  # the x86-64-v3 build's panels
    "tests/test_cpu_isa.py::test_panel_gemm_keeps_nan_and_takes_strided_weights",
    "tests/test_cpu_isa.py::test_layers_take_the_gemm_the_isa_level_allows",
    "tests/test_cpu_isa.py::test_rows_on_each_side_of_the_prefill_bound_take_their_gemm",
    "tests/test_cpu_isa.py::test_engine_bf16_tokens_are_hf_bf16s",
    # DCP ranks over the x86-64-v3 shared-memory collectives: the Helix placement with the a2a combine, GQA and MLA
    "tests/test_dcp_equivalence.py::test_layout_matches_hf_and_shards_cache[gqa2-tp1-dcp2-i4-sharded-a2a-chunked]",
    "tests/test_dcp_equivalence.py::test_layout_matches_hf_and_shards_cache[mla-tp1-dcp2-i2-sharded-a2a-chunked-cpu-backend]",
]


@pytest.mark.slow
@pytest.mark.multiproc
def test_equivalence_suite_on_the_forced_avx2_path(tmp_path):
    """The HF-equivalence and kernel tests again, in a pytest process forced to the AVX2 view: CI on an AVX-512
    machine covers what AVX2 users run (DCPCTL_CPU_ISA=avx2 also caps oneDNN and ATen there)."""
    running = cpu_isa.detect()
    if running.level == "baseline":
        pytest.skip("this CPU has no AVX2")
    if running.level == "avx2" and not running.onednn_bf16:
        pytest.skip("this process already runs the AVX2 path (an AVX2-only CPU): the suite itself covers it")
    _suite_passes(FORCED_SUITE, _forced_avx2_env(), tmp_path, timeout=1500)


SWITCH_SUITE = [
    "tests/test_layers.py",
    "tests/test_cpu_isa.py::test_layers_take_the_gemm_the_isa_level_allows",
    "tests/test_cpu_isa.py::test_engine_bf16_tokens_are_hf_bf16s",
    "tests/test_cpu_gemm_avx512.py",  # this CPU's own build, where it has AVX512-BF16
]


@pytest.mark.slow
@pytest.mark.multiproc
def test_bf16_on_the_gemm_the_switch_selects(tmp_path):
    """DCPCTL_BF16_GEMM on a CPU where oneDNN packs bf16: the layer and HF-token tests again on the batched-decode
    GEMM that is not this CPU's default (oneDNN's where the panel GEMM's dot-product kernel leads, the panel GEMM
    where oneDNN does), the path the switch selects."""
    isa = cpu_isa.detect()
    if not isa.onednn_bf16:
        pytest.skip("oneDNN refuses bf16 here: the panel GEMM is the only bf16 GEMM, the suite itself covers it")
    other = "onednn" if bf16_dot_leads(isa) else "panels"
    _suite_passes(SWITCH_SUITE, dict(os.environ, **{BF16_GEMM_ENV: other}), tmp_path, timeout=900)


def test_amx_is_seen_only_at_the_avx512_level_of_a_cpu_that_has_it():
    """A Sapphire Rapids-class CPU (amx_bf16) takes torch's AMX flash attention for long bf16 prompts; Zen 4 (no AMX)
    and the same CPU forced to AVX2 (which hides AVX-512 and AMX from torch too) do not."""
    sapphire_rapids = ZEN4 | {"amx_bf16", "amx_tile"}
    assert cpu_isa.CpuIsa("avx512", "avx512", sapphire_rapids).amx_bf16
    assert not cpu_isa.CpuIsa("avx512", "avx512", ZEN4).amx_bf16
    assert not cpu_isa.CpuIsa("avx2", "avx512", cpu_isa._visible_flags(sapphire_rapids, "avx2")).amx_bf16

"""Which kernel each part of a CPU step runs: chosen once from the ISA level (`engine.kernels.cpu_isa`) and the dtype.

The one place these choices are made: `cpu_gemm` packs the linear layers by it, and `plan validate` /
`plan show` and the engine's start-up line print it. No torch import (plan checks use it).

Linear layers, per dtype and row count, in three buckets: 1-2 rows (batch-1/2 decode) take the engine's GEMV on
the plain weight; more rows a pre-packed GEMM: the engine's panel GEMM (csrc/cpu_gemm.cpp), except bfloat16 on
CPUs where oneDNN packs bf16 on AMX tiles or without AVX512-BF16 dot products, which take oneDNN's; and from
PREFILL_MIN_ROWS rows on (prefill), float32 and bfloat16 on AVX-512 take oneDNN's (`prefill_gemm_choices`), from a
second packed copy of the weight where batched decode runs the panel GEMM. Measured at SmolLM2's shapes
(benchmarks/gemm_crossover.py, docs/results/cpu-kernels.md): the panel GEMM runs decode-sized fp32 batches faster
than oneDNN, and so does its bf16 dot-product kernel (vdpbf16ps) on an AVX512-BF16 CPU without AMX (Zen 4: 10-50%
at 4-64 rows, the LM head 1.5x at 16 rows); oneDNN is as fast or faster on every shape from 512 rows on with
AVX-512 (fp32: 12-30% on the down projection; a 16 x 128-token SmolLM2 prefill 11% faster on two threads, worth the
second copy; bf16 on Zen 4: level to 10%), and never with AVX2. On AMX, oneDNN's bf16 runs on the tiles at every
row count. Without the engine's kernels: oneDNN, else F.linear.

`DCPCTL_BF16_GEMM=panels` (or `onednn`) puts that GEMM first for bfloat16 at every row count whatever the CPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from engine.errors import UserError
from engine.kernels.cpu_isa import CpuIsa

GEMV_MAX_ROWS = 2  # above this many rows a packed GEMM is faster than the GEMV (benchmarks/gemv_roofline.py)
PREFILL_MIN_ROWS = 512  # from this many rows on oneDNN's fp32 beats the panel GEMM with AVX-512 (gemm_crossover.py)
GEMM_NAMES = {"onednn": "oneDNN packed", "panels": "engine panel GEMM", "torch": "torch F.linear"}
KERNEL_DTYPE_NAMES = ("float32", "bfloat16")  # what the engine's C++ kernels take
KERNEL_CACHE_DTYPE_NAMES = (*KERNEL_DTYPE_NAMES, "fp8_e4m3", "fp8_e5m2")  # the KV caches their attention reads
BF16_GEMM_ENV = "DCPCTL_BF16_GEMM"
BF16_GEMMS = ("auto", "onednn", "panels")
# bf16 prefill attention's products, by `cpu_kernels.prefill_bf16_products()` name
PREFILL_PRODUCT_NAMES = {
    "amx": "AMX tiles (oneDNN brgemm)",
    "avx512_bf16": "AVX512-BF16 dot products",
    "fp32": "vector path in fp32",
}


KERNELS_ENV = "DCPCTL_CPU_KERNELS"


def kernels_wanted() -> bool:
    """False when DCPCTL_CPU_KERNELS=0 opts out of the engine's C++ kernels; a UserError for a value not 0 or 1."""
    value = os.environ.get(KERNELS_ENV, "1").strip() or "1"
    if value not in ("0", "1"):
        raise UserError(f"{KERNELS_ENV}={value!r} is not 0 (torch's kernels) or 1 (the engine's, the default)")
    return value == "1"


def requested_bf16_gemm() -> str:
    """DCPCTL_BF16_GEMM, or `auto`; a UserError names the choices for anything else."""
    value = os.environ.get(BF16_GEMM_ENV, "auto").strip().lower() or "auto"
    if value not in BF16_GEMMS:
        raise UserError(f"{BF16_GEMM_ENV}={value!r} is not one of {', '.join(BF16_GEMMS)}")
    return value


def bf16_dot_leads(isa: CpuIsa) -> bool:
    """Whether the panel GEMM's bf16 dot-product kernel runs decode-sized bf16 batches faster than oneDNN here: an
    AVX512-BF16 build on a CPU without AMX (with AMX, oneDNN's bf16 runs on the tiles)."""
    return isa.bf16_dot and not isa.amx_bf16


def gemm_choices(isa: CpuIsa, dtype: str, kernels: bool, bf16_gemm: str = "auto") -> tuple[str, ...]:
    """The GEMMs for more than GEMV_MAX_ROWS rows, best first; a layer takes the first that packs its weight.
    `bf16_gemm` (DCPCTL_BF16_GEMM) puts oneDNN or the panel GEMM first for bfloat16; `auto`: oneDNN where it packs,
    except where the panel GEMM's dot-product kernel leads (`bf16_dot_leads`)."""
    if dtype not in KERNEL_DTYPE_NAMES:
        return ("torch",)
    if bf16_gemm == "auto":
        onednn_first = dtype == "bfloat16" and isa.onednn_bf16 and not bf16_dot_leads(isa)
    else:
        onednn_first = dtype == "bfloat16" and bf16_gemm == "onednn"
    choices = ("onednn", "panels") if onednn_first else ("panels", "onednn")
    return (*(c for c in choices if kernels or c != "panels"), "torch")


def prefill_gemm_choices(isa: CpuIsa, dtype: str, kernels: bool, bf16_gemm: str = "auto") -> tuple[str, ...]:
    """The GEMMs for PREFILL_MIN_ROWS rows or more, best first (a layer takes the first that packs its weight):
    oneDNN's with AVX-512 (float32, and bfloat16 unless DCPCTL_BF16_GEMM asks otherwise), else what batched decode
    takes (the same packed weight)."""
    if isa.level == "avx512" and (dtype == "float32" or (dtype == "bfloat16" and bf16_gemm == "auto")):
        return ("onednn", *(c for c in gemm_choices(isa, dtype, kernels) if c != "onednn"))
    return gemm_choices(isa, dtype, kernels, bf16_gemm)


def gemm_name(gemm: str, isa: CpuIsa, dtype: str) -> str:
    """How the start-up line and plan checks name a GEMM: the panel GEMM says when it is the bf16 dot-product kernel."""
    if gemm == "panels" and dtype == "bfloat16" and isa.bf16_dot:
        return f"{GEMM_NAMES[gemm]} (AVX512-BF16 dot products)"
    return GEMM_NAMES[gemm]


def decode_path(kernels: bool, backend: str, dtypes: set[str]) -> str:
    """How decode attention runs: the engine's kernel on the `cpu` backend where it takes the model's and the
    cache's dtypes (`dtypes`), else the backend's (the `cpu` backend falls back to the torch backend's paths)."""
    if not (kernels and backend == "cpu"):
        return f"{backend} backend"
    if dtypes <= set(KERNEL_CACHE_DTYPE_NAMES):  # the model's dtype is never an fp8 one
        fp8 = sorted(dtypes - set(KERNEL_DTYPE_NAMES))
        return "engine paged decode kernel" + (f" on an {fp8[0]} cache" if fp8 else "")
    return "torch backend's paths (the kernels take float32 / bfloat16)"


def bf16_prefill_products(isa: CpuIsa) -> str:
    """How the kernel build of this level runs bf16 prefill attention's products, as the loaded build's
    `cpu_kernels.prefill_bf16_products()[0]` will say: `amx` (AMX tiles), `avx512_bf16` (dot products), else `fp32`."""
    if not isa.bf16_dot:
        return "fp32"
    return "amx" if isa.amx_bf16 else "avx512_bf16"


def bf16_prefill_attention(kernels: bool, backend: str, dtype: str, products: str) -> str | None:
    """What plan show and the start-up line add for bf16 prefill attention on the `cpu` backend's kernel (None for
    other dtypes and backends: fp32 always runs the kernel's vector path)."""
    if not (kernels and backend == "cpu" and dtype == "bfloat16"):
        return None
    return PREFILL_PRODUCT_NAMES[products]


def describe_paths(
    isa: CpuIsa,
    kernels: str,
    dtype: str,
    gemms: str,
    gemv: bool,
    decode: str,
    prefill: str | None = None,
    prefill_attention: str | None = None,
) -> str:
    """The one-line form plan show / validate and the engine's start-up line print (`prefill`: what layers take
    from PREFILL_MIN_ROWS rows on, where that differs from `gemms`; `prefill_attention`: bf16's products)."""
    rows = f"GEMV for 1-{GEMV_MAX_ROWS} rows, {gemms} for more" if gemv else gemms
    if prefill:
        rows += f", {prefill} from {PREFILL_MIN_ROWS} rows"
    line = f"CPU ISA {isa.describe()}; C++ kernels: {kernels}; {dtype} linear layers: {rows}"
    line += f"; decode attention: {decode}"
    return line + (f"; prefill attention: {prefill_attention}" if prefill_attention else "")


@dataclass(frozen=True)
class CpuPaths:
    """The kernels a CPU plan will run: ISA level, kernel build, and the dtype's matmul and attention paths."""

    isa: CpuIsa
    dtype: str
    kernels: bool
    backend: str
    bf16_gemm: str = "auto"  # DCPCTL_BF16_GEMM
    cache_dtype: str | None = None  # the KV cache's, where it differs from the model's

    @property
    def gemm(self) -> str:
        return gemm_choices(self.isa, self.dtype, self.kernels, self.bf16_gemm)[0]

    @property
    def prefill_gemm(self) -> str:
        return prefill_gemm_choices(self.isa, self.dtype, self.kernels, self.bf16_gemm)[0]

    def describe(self) -> str:
        """What the plan will run here (the start-up line reports what actually loaded)."""
        build = f"{self.isa.build_variant} build" if self.kernels else "off (DCPCTL_CPU_KERNELS=0)"
        gemv = self.kernels and self.dtype in KERNEL_DTYPE_NAMES
        decode = decode_path(self.kernels, self.backend, {self.dtype, self.cache_dtype or self.dtype})
        prefill = gemm_name(self.prefill_gemm, self.isa, self.dtype) if self.prefill_gemm != self.gemm else None
        gemm = gemm_name(self.gemm, self.isa, self.dtype)
        products = bf16_prefill_products(self.isa)
        attention = bf16_prefill_attention(self.kernels, self.backend, self.dtype, products)
        return describe_paths(self.isa, build, self.dtype, gemm, gemv, decode, prefill, attention)

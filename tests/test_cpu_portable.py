"""The portable kernel build (no `-march`): what a CPU without AVX2 runs, forced on this one (DCPCTL_CPU_ISA)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.kernels import cpu_isa

REPO = Path(__file__).resolve().parents[1]
PORTABLE_SUITE = [
    "tests/test_layers.py",
    "tests/test_kv_quant.py",  # the fp8 cache store and decode without vector loads
    "tests/test_cpu_prefill.py",  # prefill attention on the generic vector (8 lanes, no FMA)
    "tests/test_cpu_isa.py::test_panel_gemm_matches_exact_products",
    "tests/test_cpu_isa.py::test_panel_gemm_keeps_nan_and_takes_strided_weights",
    "tests/test_cpu_isa.py::test_layers_take_the_gemm_the_isa_level_allows",
]
PROBE = "from engine.kernels import cpu_kernels; cpu_kernels.cpu_kernels_available(); print(cpu_kernels.loaded_build())"


@pytest.mark.slow
@pytest.mark.multiproc
def test_the_portable_build_passes_the_kernel_tests(tmp_path):
    """The panel GEMM, GEMV, layer and prefill attention tests in a process forced to the baseline level: the C++
    kernels are built without `-march` (their generic code paths) and still give the exact products, F.linear's
    results and fp64 attention's."""
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")}
    env[cpu_isa.ENV] = "baseline"
    build = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=REPO, capture_output=True, text=True)
    assert build.stdout.strip().startswith("dcpctl_cpu_kernels_portable_"), build.stderr[-2000:]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp", str(tmp_path), *PORTABLE_SUITE]
    result = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else result.stderr[-2000:]
    assert result.returncode == 0, result.stdout[-4000:]
    assert " passed" in summary and "failed" not in summary and "error" not in summary, summary

"""The kernels with the C++ compilers users have, not only this machine's default: GCC 11 (Ubuntu 22.04's `g++`,
which has no `__builtin_shufflevector`) builds them and passes the kernel tests; and a compiler that cannot build
the CPU's level (an old one without AVX-512 or AVX512-BF16) loads the next lower build that it can.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.kernels import cpu_kernels
from engine.kernels.cpu_isa import detect

REPO = Path(__file__).resolve().parents[1]
# what .ci/run installs where it can (Debian's packages); another machine's compilers of these names also count
OTHER_COMPILERS = ("g++-11",)
KERNEL_SUITE = [
    "tests/test_layers.py",
    "tests/test_cpu_backend.py",
    "tests/test_cpu_isa.py::test_panel_gemm_matches_exact_products",
    "tests/test_cpu_isa.py::test_panel_gemm_keeps_nan_and_takes_strided_weights",
]
PROBE = "from engine.kernels import cpu_kernels; print(cpu_kernels.loaded_build())"
LEVEL_PROBE = r"""
#include <torch/library.h>
#include <string>

std::string level() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "portable";
#endif
}

TORCH_LIBRARY(dcpctl_fallback_test, m) { m.def("level", &level); }
"""


def _is_the_default(compiler: str) -> bool:
    default = shutil.which(cpu_kernels.compiler())
    return default is not None and os.path.realpath(default) == os.path.realpath(shutil.which(compiler) or compiler)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("compiler", OTHER_COMPILERS)
def test_another_compiler_builds_the_kernels_and_passes_their_tests(compiler, tmp_path):
    """CXX=<compiler>: the build of this CPU's own level (not a fallback), and the kernel tests pass with it."""
    if shutil.which(compiler) is None:
        pytest.skip(f"{compiler} is not installed (.ci/run installs it where apt-get can)")
    if _is_the_default(compiler):
        pytest.skip(f"{compiler} is this machine's default compiler: the whole suite runs with it")
    env = {**os.environ, "CXX": compiler}
    probe = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=REPO, capture_output=True, text=True)
    variant = detect().build_variant.replace("-", "_")
    assert probe.stdout.strip().startswith(f"dcpctl_cpu_kernels_{variant}_"), probe.stderr[-2000:]
    assert "build failed" not in probe.stderr, probe.stderr[-2000:]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp", str(tmp_path), *KERNEL_SUITE]
    cmd += ["-m", "not multiproc"]
    result = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else result.stderr[-2000:]
    assert result.returncode == 0, result.stdout[-4000:]
    assert " passed" in summary and "failed" not in summary and "error" not in summary, summary


@pytest.mark.slow
def test_a_compiler_without_the_cpus_level_loads_a_lower_build(tmp_path, monkeypatch, caplog):
    """A compiler that rejects the AVX2 and AVX-512 flags (as one too old for the CPU would): the builds above
    portable fail, each named in one warning line, and the portable build is the one loaded and used."""
    if len(detect().kernel_builds()) < 2:
        pytest.skip("this CPU's only build is the portable one: nothing to fall back from")
    real = shutil.which(cpu_kernels.compiler())
    if real is None:
        pytest.skip("no C++ compiler")
    old = tmp_path / "old-c++"
    old.write_text(
        "#!/bin/sh\n"
        'for a in "$@"; do case "$a" in -mavx2|-mavx512f) '
        "echo \"old-c++: error: unrecognized command-line option '$a'\" >&2; exit 1;; esac; done\n"
        f'exec {real} "$@"\n'
    )
    old.chmod(0o755)
    source = tmp_path / "level_probe.cpp"
    source.write_text(LEVEL_PROBE)
    monkeypatch.setenv("CXX", str(old))
    monkeypatch.setenv("HOME", str(tmp_path))  # a fresh kernels cache
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        isa, name = cpu_kernels.build_for_cpu((source,), "dcpctl_fallback_test")
    assert isa is not None and isa.build_variant == "portable" and "_portable_" in name
    [warning] = [r.getMessage() for r in caplog.records]
    failed = [b.build_variant for b in detect().kernel_builds()[:-1]]
    assert all(f"the {variant} build failed" in warning for variant in failed), warning
    assert warning.endswith("loaded the portable build") and "\n" not in warning
    assert torch.ops.dcpctl_fallback_test.level() == "portable"


def test_a_compiler_that_fails_to_run_is_a_reason_not_a_traceback(tmp_path, monkeypatch):
    """CXX=/bin/false (torch's `--version` probe fails): build_kernels returns the reason (the engine then warns
    once and runs on torch's kernels) instead of raising CalledProcessError."""
    source = tmp_path / "level_probe.cpp"
    source.write_text(LEVEL_PROBE)
    monkeypatch.setenv("CXX", "/bin/false")
    monkeypatch.setenv("HOME", str(tmp_path))
    reason = cpu_kernels.build_kernels((source,), "dcpctl_false_test", [])
    assert reason is not None and "/bin/false" in reason and "\n" not in reason

"""The engine's own CPU kernels (csrc/cpu_kernels.cpp): built for this CPU on first use, then cached.

torch's cpp_extension compiles the source once per machine (~15 s with gcc on 2 cores; scripts/setup.sh
does it at install) into `~/.cache/dcpctl/kernels` and registers the ops as `torch.ops.dcpctl.*`;
later processes load the cached library in milliseconds. Where it cannot be built (no C++ compiler)
the engine runs on torch's own kernels and a one-line warning says why; `DCPCTL_CPU_KERNELS=0`
opts out (the baseline of benchmarks/decode_throughput.py).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import time
from pathlib import Path

import torch

KERNEL_DTYPES = (torch.float32, torch.bfloat16)
SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.cpp"
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]  # no implicit FMA: rotary keeps torch's bits
STALE_LOCK_S = 600  # a build lock this old was left by a killed build; torch would wait on it forever
_log = logging.getLogger(__name__)


def _build_tag() -> str:
    """A short hash of what a build is only valid for: this CPU's feature flags (-march=native) and the torch
    install it links against (a second venv sharing the cache would otherwise rebuild it at every switch)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        flags = next(line for line in lines if line.startswith(("flags", "Features")))
    except (OSError, StopIteration):
        flags = torch.backends.cpu.get_cpu_capability()
    return hashlib.sha1(f"{flags}|{torch.__version__}|{torch.__file__}".encode()).hexdigest()[:8]


def kernels_dir() -> Path:
    """Where the built libraries are cached: `~/.cache/dcpctl/kernels`."""
    return Path.home() / ".cache" / "dcpctl" / "kernels"


def build_kernels(source: Path, name: str) -> str | None:
    """Compile (or load the cached build of) `source` as torch ops; None when loaded, else why not, in one line."""
    from torch.utils.cpp_extension import load

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler {compiler!r} on PATH; install g++ or set CXX"
    build_dir = kernels_dir() / name
    build_dir.mkdir(parents=True, exist_ok=True)
    lock = build_dir / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
        lock.unlink(missing_ok=True)
    if shutil.which("ninja") is None:  # the ninja wheel's binary, when the venv's bin/ is not on PATH
        import ninja

        os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
    try:
        load(name, sources=[str(source)], extra_cflags=CFLAGS, build_directory=str(build_dir), is_python_module=False)
    except (OSError, RuntimeError, ImportError) as exc:
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        log = build_dir / "error.log"
        log.write_text(f"{exc}\n")
        return f"{first_line.split(': [')[0]}; the compiler's output: {log}"
    return None


@functools.cache
def cpu_kernels_available() -> bool:
    """Build (first time) and load the kernels; False, with a warning, where that is not possible."""
    if os.environ.get("DCPCTL_CPU_KERNELS", "1") == "0":
        return False
    problem = build_kernels(SOURCE, f"dcpctl_cpu_kernels_{_build_tag()}")
    if problem:
        _log.warning("dcpctl CPU kernels unavailable, using torch's (%s)", problem)
    return problem is None


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) for a few rows of x, fp32 or bf16 on CPU (see `cpu_kernels_available`)."""
    return torch.ops.dcpctl.gemv(x, weight, bias)


def store_kv(new_kv: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Write new_kv [T, Hkv, D] into a layer's cache view [blocks, B, Hkv, D] at `slots` (-1: skipped)."""
    torch.ops.dcpctl.store_kv(new_kv, cache, slots)


def paged_decode(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor | None,
    block_tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    value_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query per sequence, q [S, H, Dk], against a layer's cache views [blocks, B, Hkv, D] (values None: the
    first `value_dim` dims of the keys); exact softmax in fp32. Returns out [S, H, value_dim], lse [S, H]."""
    return torch.ops.dcpctl.paged_decode(q, key_cache, value_cache, block_tables, lens, scale, value_dim)


if __name__ == "__main__":  # scripts/setup.sh: build now rather than in the first run
    print("dcpctl CPU kernels:", "ready" if cpu_kernels_available() else "unavailable (torch's kernels are used)")

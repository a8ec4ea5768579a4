"""The engine's own CPU kernels (csrc/*.cpp): built for this CPU's ISA level on first use, then cached.

torch's cpp_extension compiles the sources once per ISA level (~20 s with gcc on 2 cores; scripts/setup.sh
does it at install) and the library is published in `~/.cache/dcpctl/kernels` under a key that hashes the
sources' bytes, the flags, the compiler and the torch install (`build_key`); later processes whose key matches load
it directly (`torch.ops.load_library`, ops under `torch.ops.dcpctl.*`), with no lock, compiler or ninja. A build
holds an flock (a killed build's lock dies with it), compiles in a private folder and publishes by an atomic
rename: ranks, processes and venvs starting at once on a shared home build once and never see half a library.
The build targets the level `engine.kernels.cpu_isa` reports (x86-64-v4's instruction sets for AVX-512, plus
AVX512-BF16 where the CPU has it, x86-64-v3's for AVX2, none on other CPUs: `CpuIsa.target_flags`), never
`-march=native`, and the build variant and the compiler name the cached build: a home directory shared between
machines with different CPUs keeps one build per variant and never loads one the CPU cannot run. GCC 11 and 12 build
every level (tests/test_cpu_compilers.py); clang's builds do not load (its OpenMP calls are libomp's, torch's
runtime is libgomp), and the engine says so and uses torch's. Where the compiler cannot build the CPU's level, the
next lower one that builds is loaded, with a one-line warning (the portable build computes SiLU with std::exp, not
with the vector exp of torch's own kernels: bits may differ from torch's there); where none builds (no C++ compiler)
the engine runs on torch's own kernels and a one-line warning says why; `DCPCTL_CPU_KERNELS=0` opts out (the
baseline of benchmarks/decode_throughput.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.kernels.cpu_isa import CpuIsa, detect
from engine.kernels.cpu_paths import KERNEL_DTYPE_NAMES, kernels_wanted

KERNEL_DTYPES = tuple(getattr(torch, name) for name in KERNEL_DTYPE_NAMES)
KERNEL_CACHE_DTYPES = (*KERNEL_DTYPES, torch.float8_e4m3fn, torch.float8_e5m2)  # KERNEL_CACHE_DTYPE_NAMES' dtypes
SOURCES = tuple(Path(__file__).with_name("csrc") / name for name in ("cpu_kernels.cpp", "cpu_gemm.cpp"))
BASE_CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]  # no implicit FMA: rotary keeps torch's bits
STALE_LOCK_S = 600  # a build holding its lock this long is stuck: other starts build around it
LOCK_POLL_S = 0.1
_log = logging.getLogger(__name__)


def build_flags(isa: CpuIsa) -> list[str]:
    """Compiler flags of the build for `isa`'s level."""
    return BASE_CFLAGS + isa.target_flags


def compiler() -> str:
    """The C++ compiler torch's cpp_extension runs: $CXX, else `c++`."""
    return os.environ.get("CXX", "c++")


def compiler_problem() -> str | None:
    """Why no build can run here (no compiler on PATH), in one line; None when there is a compiler."""
    if shutil.which(compiler()) is None:
        return f"no C++ compiler {compiler()!r} on PATH; install g++ or set CXX"
    return None


def _toolchain() -> str:
    """What a build runs and links against: the compiler as the file it resolves to (a build another compiler failed
    or made is never taken for this one's) with its size and mtime (a compiler upgraded in place builds anew), and
    the torch install by version and real path (a venv reached through a symlink is the same install; a second venv
    sharing the cache gets builds of its own rather than rebuilding over the first's at every switch)."""
    found = shutil.which(compiler())
    identity = compiler()
    if found is not None:
        path = os.path.realpath(found)
        stat = os.stat(path)
        identity = f"{path}:{stat.st_size}:{stat.st_mtime_ns}"
    return f"{identity}|{torch.__version__}|{os.path.realpath(torch.__file__)}"


def build_name(isa: CpuIsa, library: str = "dcpctl_cpu_kernels") -> str:
    """The cached build's folder name: the library, the ISA level's variant, then a short hash of the level's flags
    and the toolchain. The sources are not in the name: `library_path` adds them."""
    key = f"{' '.join(build_flags(isa))}|{_toolchain()}"
    return f"{library}_{isa.build_variant.replace('-', '_')}_{hashlib.sha1(key.encode()).hexdigest()[:8]}"


def build_key(sources: tuple[Path, ...], cflags: list[str]) -> str:
    """A hash of everything that makes a build differ: the sources' bytes, the flags and the toolchain. A built
    library whose key matches is loaded as it is, without running the compiler or ninja."""
    digest = hashlib.sha1(f"{' '.join(cflags)}|{_toolchain()}".encode())
    for source in sources:
        digest.update(f"|{source.name}|".encode())
        digest.update(source.read_bytes())
    return digest.hexdigest()[:16]


def kernels_dir() -> Path:
    """Where the built libraries are cached: `~/.cache/dcpctl/kernels`."""
    return Path.home() / ".cache" / "dcpctl" / "kernels"


def library_path(sources: tuple[Path, ...], name: str, cflags: list[str]) -> Path:
    """Where the build of `sources` as `name` with `cflags` is published: `<kernels_dir>/<name>/<name>_<key>.so`."""
    return kernels_dir() / name / f"{name}_{build_key(sources, cflags)}.so"


def _one_line(exc: BaseException) -> str:
    """A build's or a load's exception in one line: its first line and, for a library that does not load, the
    loader's reason (after the library's path)."""
    first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0].split(": [")[0]
    if exc.__cause__ is not None:
        reason = (str(exc.__cause__).strip().splitlines() or [""])[0].split(": ", 1)[-1]
        first_line += f" ({reason})"
    return first_line


def _load(library: Path) -> str | None:
    """Load a published library: None when loaded, else the loader's reason in one line."""
    try:
        torch.ops.load_library(str(library))
    except OSError as exc:
        return _one_line(exc)
    return None


@contextlib.contextmanager
def _build_lock(path: Path) -> Iterator[None]:
    """Hold the build lock of one library while building it. The lock is an flock, which the kernel drops when
    its holder dies: a killed build leaves nothing that blocks. A holder alive but stuck for STALE_LOCK_S is built
    around, and a filesystem without locks builds unlocked: either way the build stays in its own folder until
    its atomic rename, so two builders never collide, they only repeat work."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        deadline = time.monotonic() + STALE_LOCK_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    _log.warning("%s held for over %d s: building without it", path, STALE_LOCK_S)
                    break
                time.sleep(LOCK_POLL_S)
            except OSError:  # no locks on this filesystem
                break
        yield
    finally:
        os.close(fd)  # releases the lock


def _remove_stale_builds(build_dir: Path) -> None:
    """Remove the private build folders of builds killed before they published (older than STALE_LOCK_S)."""
    for folder in build_dir.glob("tmp-*"):
        try:
            if time.time() - folder.stat().st_mtime > STALE_LOCK_S:
                shutil.rmtree(folder, ignore_errors=True)
        except FileNotFoundError:
            pass


def _build(sources: tuple[Path, ...], name: str, cflags: list[str], library: Path) -> str | None:
    """Compile `sources` in a private folder, load the result and publish it at `library` by an atomic rename:
    None when loaded, else why not, in one line (the compiler's output is in the folder's error.log)."""
    from torch.utils.cpp_extension import load

    if shutil.which("ninja") is None:  # the ninja wheel's binary, when the venv's bin/ is not on PATH
        import ninja

        os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
    _remove_stale_builds(library.parent)
    private = Path(tempfile.mkdtemp(prefix="tmp-", dir=library.parent))
    try:
        # a name of its own per attempt: torch skips a name it already built in this process
        built = private / f"{name}_{private.name[4:]}.so"
        paths = [str(source) for source in sources]
        try:
            load(built.stem, sources=paths, extra_cflags=cflags, build_directory=str(private), is_python_module=False)
        except (OSError, RuntimeError, ImportError, subprocess.CalledProcessError) as exc:  # a compiler that fails
            log = library.parent / "error.log"
            log.write_text(f"{exc}\n{exc.__cause__ or ''}\n")
            if built.is_file():  # built, but does not load (clang's OpenMP): later starts fail as fast as a load
                os.replace(built, library)
            return f"{_one_line(exc)}; the compiler's output: {log}"
        os.replace(built, library)
        return None
    finally:
        shutil.rmtree(private, ignore_errors=True)


def build_kernels(sources: tuple[Path, ...], name: str, cflags: list[str]) -> str | None:
    """Load the published build of `sources` (its key matches: no lock, no compiler), else build and publish it
    under the build lock: None when loaded, else why not, in one line."""
    if problem := compiler_problem():
        return problem
    library = library_path(sources, name, cflags)
    if library.is_file():
        return _load(library)
    library.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(library.parent / "build.lock"):
        if library.is_file():  # another process published it while this one waited
            return _load(library)
        return _build(sources, name, cflags, library)


def build_for_cpu(sources: tuple[Path, ...], library: str) -> tuple[CpuIsa | None, str]:
    """Build (or load the cached build of) `sources` for this process's ISA level, else for the next lower level
    the compiler can build (`CpuIsa.kernel_builds`; a fallback is logged in one line): (the level the loaded build
    targets, its name), or (None, why no build loaded, in one line)."""
    if problem := compiler_problem():
        return None, problem
    failed: list[str] = []
    for isa in detect().kernel_builds():
        name = build_name(isa, library)
        problem = build_kernels(sources, name, build_flags(isa))
        if problem is None:
            if failed:
                _log.warning("%s: %s; loaded the %s build", library, "; ".join(failed), isa.build_variant)
            return isa, name
        failed.append(f"the {isa.build_variant} build failed: {problem}")
    return None, "; ".join(failed)


@functools.cache
def _loaded() -> tuple[CpuIsa | None, str | None]:
    if not kernels_wanted():
        return None, None
    isa, outcome = build_for_cpu(SOURCES, "dcpctl_cpu_kernels")
    if isa is None:
        _log.warning("dcpctl CPU kernels unavailable, using torch's (%s)", outcome)
        return None, None
    return isa, outcome


def loaded_build() -> str | None:
    """Build (first time) and load the kernels for this process's ISA level: the build's name, or None, with a
    warning, where that is not possible. One build per process: its ops are registered under one name."""
    return _loaded()[1]


def kernel_isa() -> CpuIsa | None:
    """The level the loaded kernel build targets: the process's, or a lower one its compiler could build."""
    return _loaded()[0]


def cpu_kernels_available() -> bool:
    """True when the engine's kernels are loaded in this process (built first if needed)."""
    return loaded_build() is not None


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) for a few rows of x, fp32 or bf16 on CPU (see `cpu_kernels_available`)."""
    return torch.ops.dcpctl.gemv(x, weight, bias)


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """A copy of a [n, k] fp32/bf16 weight reordered into the panels `panel_linear` reads (same dtype)."""
    return torch.ops.dcpctl.pack_panels(weight.detach().contiguous())


def panel_linear(
    x: torch.Tensor, panels: torch.Tensor, shape: tuple[int, int], bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ weight.T (+ bias) for any rows of a 2-D x, against `pack_panels(weight)` of a weight of `shape` [n, k]."""
    return torch.ops.dcpctl.panel_linear(x, panels, shape[0], shape[1], bias)


def store_kv(new_kv: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, scale: float = 1.0) -> None:
    """Write new_kv [T, Hkv, D] into a layer's cache view [blocks, B, Hkv, D] at `slots` (-1: skipped); an fp8 cache
    stores new_kv / scale (fp32), as `kv_quant.to_cache`."""
    torch.ops.dcpctl.store_kv(new_kv, cache, slots, scale)


def rotary_store_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
    scales: tuple[float, float] = (1.0, 1.0),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary of the query and key heads of qkv [T, Hq + 2 Hkv, D] (returned: [T, Hq, D], [T, Hkv, D]) and the store
    of the rotated keys and the values into the cache views at `slots`: the bits of `rotary` then two `store_kv`
    (with the key's and the value's scale)."""
    return torch.ops.dcpctl.rotary_store_kv(qkv, cos, sin, interleaved, key_cache, value_cache, slots, *scales)


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


@dataclass(frozen=True)
class PrefillContext:
    """The cached tokens a prefill's prompts continue (`prefill_causal`): prompt p's first lens[p] tokens, stored in
    one layer's cache views [blocks, B, Hkv, D] (the model's dtype) at the blocks of row p of block_tables [P, W]."""

    lens: torch.Tensor  # [P] int64 (0: a fresh prompt)
    block_tables: torch.Tensor  # [P, W] int64
    key_cache: torch.Tensor
    value_cache: torch.Tensor


def prefill_causal(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    context: PrefillContext | None = None,
    products: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of each prompt's tokens (cu_seqlens [P + 1] int64) to themselves: q [T, H, Dk],
    k [T, Hkv, Dk], v [T, Hkv, Dv] of one dtype (fp32/bf16; any strides but the last), each KV head read once for
    its H / Hkv query heads; softmax in fp32. bf16's products run as `products` says, one of
    `prefill_bf16_products()` (`auto`: the first); on the stored bits (`amx`, `avx512_bf16`) the probabilities are
    rounded to bf16 for P.V, as torch's flash attention rounds them. With `context`, prompt p's tokens also attend to
    the first context.lens[p] tokens of its sequence in the paged cache, which precede them, in the same pass.
    Returns out [T, H, Dv] (q's dtype) and lse [T, H] (fp32) over every key attended."""
    if context is None:
        return torch.ops.dcpctl.prefill_causal(q, k, v, cu_seqlens, scale, products=products)
    return torch.ops.dcpctl.prefill_causal(
        q, k, v, cu_seqlens, scale, context.lens, context.key_cache, context.value_cache, context.block_tables, products
    )


def prefill_bf16_products() -> list[str]:
    """How `prefill_causal` can run bfloat16 products in this build on this CPU, best first (the default):
    `amx` (oneDNN's brgemm on AMX tiles, where torch's cpublas packs bf16), `avx512_bf16` (vdpbf16ps register tiles:
    an AVX512-BF16 build), `fp32` (the vector path on values widened to fp32, as float32 runs)."""
    return list(torch.ops.dcpctl.prefill_bf16_products())


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up] [rows, 2n] fp32/bf16 on CPU, with the bits of `F.silu(gate) * up`."""
    return torch.ops.dcpctl.silu_and_mul(x)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)` of fp32 x [rows, n] on CPU (first of equal maxima, first NaN)."""
    return torch.ops.dcpctl.argmax_rows(x)


if __name__ == "__main__":  # scripts/setup.sh: build now rather than in the first run
    print(f"dcpctl CPU kernels ({detect().describe()}):", loaded_build() or "unavailable (torch's kernels are used)")


def bind_threads(cores: tuple[int, ...]) -> list[int]:
    """Pin the calling thread's OpenMP team (the threads of its torch and oneDNN parallel regions), thread t to
    `cores[t % len(cores)]`; returns the core each thread got (-1: refused)."""
    return list(torch.ops.dcpctl.bind_threads(list(cores)))


def release_openmp_pool() -> bool:
    """Let the calling thread's idle OpenMP workers exit, as a thread that hands the engine to another thread should:
    libgomp stops spinning at barriers (every region then waits on a futex) while a process has more OpenMP threads
    than cores. True if the runtime released them."""
    return torch.ops.dcpctl.release_openmp_pool() == 0

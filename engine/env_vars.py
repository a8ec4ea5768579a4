"""Every environment variable dcpctl reads, in one registry: its name, default, meaning and the module that reads
it. The docs' environment reference (docs/reference/environment.md) is generated from it, and a test checks that
every `DCPCTL_*` name in the code is registered here. The reading modules keep their own parsing (and errors)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str  # what unset means
    meaning: str
    read_by: str  # the module that reads it


ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar(
        "DCPCTL_CACHE",
        "`~/.cache/dcpctl/models`",
        "Folder that holds pulled models (`dcpctl model pull`, model aliases); must be writable to pull.",
        "engine.checkpoints.aliases",
    ),
    EnvVar(
        "DCPCTL_GSM8K_DIR",
        "lm-eval's hub task",
        "Folder with GSM8K `test.jsonl` and `train.jsonl` for `dcpctl eval` and `dcpctl demo` when `--data-dir` "
        "is not given.",
        "evals.tasks",
    ),
    EnvVar(
        "DCPCTL_VLLM_PYTHON",
        "the interpreter of the `vllm` on PATH",
        "The python of a venv with vLLM: `dcpctl plan export --to vllm` checks its command against that vLLM, and a "
        "plan with `engine.name: vllm` (and no `engine.python`) is served by it in `dcpctl eval` and `dcpctl bench`.",
        "engine.peers.vllm_check",
    ),
    EnvVar(
        "DCPCTL_SGLANG_PYTHON",
        "the interpreter of the `sglang` on PATH",
        "The python of a venv with SGLang: `dcpctl plan export --to sglang` checks its command against that SGLang's "
        "parser and server-argument checks.",
        "engine.peers.sglang_check",
    ),
    EnvVar(
        "DCPCTL_COLLECTIVE_TIMEOUT",
        "300",
        "Seconds a collective between computing ranks may wait before the run fails (a positive number).",
        "engine.distributed",
    ),
    EnvVar(
        "DCPCTL_CPU_ISA",
        "auto (the CPU's level)",
        "Treat the CPU as `avx2` or `baseline` even when it has more (never above the CPU's level); also caps "
        "torch's and oneDNN's kernels. Set it before Python starts.",
        "engine.kernels.cpu_isa",
    ),
    EnvVar(
        "DCPCTL_CPU_KERNELS",
        "1",
        "`0` runs on torch's kernels instead of the engine's C++ CPU kernels (a side-by-side baseline); `1` or "
        "unset uses them.",
        "engine.kernels.cpu_paths",
    ),
    EnvVar(
        "DCPCTL_BIND_THREADS",
        "1",
        "`1` or unset pins each CPU rank's OpenMP threads one to a core (the ranks of a node take consecutive runs of "
        "the process's CPU set; not when GOMP_CPU_AFFINITY, OMP_PROC_BIND or OMP_PLACES is set, or the ranks have "
        "more threads than cores); `0` leaves them to the OS.",
        "engine.kernels.cpu_threads",
    ),
    EnvVar(
        "DCPCTL_BF16_GEMM",
        "auto",
        "Which GEMM goes first for bfloat16 linear layers of more than 2 rows: `onednn`, `panels` (the engine's "
        "panel GEMM; `vdpbf16ps` with AVX512-BF16) or `auto` (oneDNN where it packs).",
        "engine.kernels.cpu_paths",
    ),
    EnvVar(
        "DCPCTL_CPU_FIGURES",
        "`~/.cache/dcpctl/cpu-figures.json`",
        "Where `plan suggest --device cpu` caches this machine's measured figures; must be absent or such a file.",
        "engine.suggest.measure",
    ),
    EnvVar(
        "DCPCTL_RANK_STATS_DIR",
        "unset (off)",
        "Each rank writes its KV cache and weight allocations and what carries its collectives into this folder "
        "(tests and benchmarks/dcp_capacity.py).",
        "engine.core.startup",
    ),
    EnvVar(
        "DCPCTL_TEST_HOLD_READ",
        "unset (off)",
        "Tests only: a P/D READ in flight waits in this folder until a file `go` appears (fault tests).",
        "engine.kv_transfer.transport",
    ),
    EnvVar(
        "DCPCTL_SUPERVISOR_PID",
        "unset",
        "Set for the servers a dcpctl process starts (a P/D deployment's instances and router, an eval's or a "
        "bench's plans): its own pid; each stops itself within a second when that process is gone. Not for users.",
        "engine.serving.parent_watch",
    ),
    EnvVar(
        "OMP_WAIT_POLICY",
        "PASSIVE (set by dcpctl unless you set it)",
        "OpenMP threads sleep after a short spin at the end of a parallel region (see GOMP_SPINCOUNT).",
        "engine.kernels.cpu_threads",
    ),
    EnvVar(
        "GOMP_SPINCOUNT",
        "10000 (set by dcpctl unless you set it)",
        "How long (~100 µs) an idle OpenMP thread spins before it sleeps; catches a decode step's next region.",
        "engine.kernels.cpu_threads",
    ),
)

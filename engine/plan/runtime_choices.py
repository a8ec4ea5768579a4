"""What a plan resolves to run with: its dtypes, attention backend, CPU kernel paths and CPU collectives,
with the errors and notes of a requested choice this device cannot honour."""

from __future__ import annotations

import importlib.util

from engine.errors import UserError
from engine.kernels import cpu_isa
from engine.kernels.cpu_paths import BF16_GEMM_ENV, KERNELS_ENV, CpuPaths, kernels_wanted, requested_bf16_gemm
from engine.plan.resolved import ResolvedPlan
from engine.plan.schema import CACHE_DTYPE_ALIASES
from engine.plan.validation import PlanProblems


def resolve_dtypes(res: ResolvedPlan) -> None:
    """The model's and the cache's dtypes (`auto`: float32 on CPU, the checkpoint's half dtype on GPU; the cache's
    `fp8` resolves to fp8_e4m3, as in vLLM)."""
    plan = res.plan
    if plan.model.dtype != "auto":
        res.dtype = plan.model.dtype
    elif res.device == "cpu":
        res.dtype = "float32"
    else:
        ckpt = res.model.torch_dtype if res.model else "bfloat16"
        res.dtype = ckpt if ckpt in ("bfloat16", "float16") else "bfloat16"
    cache = CACHE_DTYPE_ALIASES.get(plan.cache.dtype, plan.cache.dtype)
    res.cache_dtype = res.dtype if cache == "auto" else cache


def _flash_attn_limits(res: ResolvedPlan) -> list[str]:
    """Why flash-attn's paged kernels cannot serve this GQA plan (empty when they can)."""
    plan = res.plan
    limits = []
    if plan.cache.block_size % 256:
        limits.append(
            f"flash-attn's paged KV needs cache.block_size a multiple of 256 (got {plan.cache.block_size}); "
            "set cache.block_size=256 or use attention.backend=triton"
        )
    if res.dtype not in ("bfloat16", "float16"):
        limits.append(
            f"flash-attn runs bfloat16/float16 only (model.dtype resolves to {res.dtype}); "
            "set model.dtype=bfloat16 or use triton"
        )
    if res.cache_dtype != res.dtype:
        limits.append(f"flash-attn needs cache.dtype equal to model.dtype ({res.cache_dtype} vs {res.dtype})")
    return limits


def resolve_backend(problems: PlanProblems, res: ResolvedPlan) -> None:
    """The attention backend (`auto`: cpu on CPU, flash_attn on CUDA where it serves the plan, else triton)."""
    plan = res.plan
    requested = plan.attention.backend
    is_mla = bool(res.model and res.model.is_mla)
    has_flash = importlib.util.find_spec("flash_attn") is not None
    if requested == "auto":
        if res.device != "cuda":
            res.backend = "cpu"
        else:
            usable = has_flash and not is_mla and not _flash_attn_limits(res)
            res.backend = "flash_attn" if usable else "triton"
        return
    res.backend = requested
    if requested == "flash_attn":
        if res.device != "cuda":
            problems.error(
                "attention.backend",
                "attention.backend=flash_attn needs CUDA (launch.device=cuda); use cpu or torch on CPU",
            )
        elif not has_flash:
            problems.error(
                "attention.backend",
                "attention.backend=flash_attn needs the flash-attn package (pip install 'dcpctl[gpu]'); or use triton",
            )
        elif is_mla:
            problems.notes.append("attention.backend=flash_attn: MLA layers use the Triton kernels")
        else:
            for message in _flash_attn_limits(res):
                problems.error("attention.backend", message)
    if requested == "cpu" and res.device == "cuda":
        problems.error(
            "attention.backend", "attention.backend=cpu runs on CPU only; use torch, triton or flash_attn on CUDA"
        )
    if requested == "triton" and res.device == "cpu":
        problems.warnings.append("attention.backend=triton on CPU runs in the Triton interpreter (slow; for tests)")


def resolve_cpu_paths(problems: PlanProblems, res: ResolvedPlan) -> None:
    """A CPU plan's kernel paths: the ISA level, the bf16 GEMM and whether the engine's kernels are wanted."""
    if res.device != "cpu":
        return
    try:
        isa = cpu_isa.detect()
    except UserError as exc:
        problems.error(cpu_isa.ENV, str(exc))
        return
    try:
        bf16_gemm = requested_bf16_gemm()
    except UserError as exc:
        problems.error(BF16_GEMM_ENV, str(exc))
        return
    try:
        kernels = kernels_wanted()
    except UserError as exc:
        problems.error(KERNELS_ENV, str(exc))
        return
    requested = cpu_isa.requested_level()
    if requested != "auto" and cpu_isa.LEVELS.index(requested) > cpu_isa.LEVELS.index(isa.detected):
        problems.notes.append(
            f"{cpu_isa.ENV}={requested} is above this CPU's {isa.detected}: it runs at {isa.detected}"
        )
    res.cpu_paths = CpuPaths(isa, res.dtype, kernels, res.backend, bf16_gemm, res.cache_dtype)


def resolve_cpu_comm(problems: PlanProblems, res: ResolvedPlan) -> None:
    """What carries a CPU plan's tensor collectives: shared memory when every rank is on this node, else gloo."""
    lch = res.plan.launch
    if lch.cpu_comm == "shm" and res.device == "cuda":
        problems.error(
            "launch.cpu_comm",
            "launch.cpu_comm=shm is for CPU ranks, but launch.device resolves to cuda here (NCCL carries the "
            "tensors); set launch.cpu_comm=auto, or launch.device=cpu",
        )
    elif lch.cpu_comm == "shm" and lch.nnodes > 1:
        problems.error(
            "launch.cpu_comm",
            f"launch.cpu_comm=shm needs every rank on one node, but launch.nnodes={lch.nnodes}; "
            "set launch.cpu_comm=auto (gloo between nodes) or launch.nnodes=1",
        )
    if res.device == "cpu":
        res.cpu_comm = "shm" if lch.cpu_comm in ("auto", "shm") and lch.nnodes == 1 else "gloo"

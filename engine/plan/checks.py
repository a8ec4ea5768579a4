"""Cross-checks of a loaded plan against the rules of DESIGN.md and the model's config.json.

Every problem is collected (not just the first), each naming the field, the values, the rule
and a fix. The result, a `PlanCheck`, holds those problems beside the resolved plan (device, dtypes, backend,
layout, KV sizing) that `plan show` displays and the engine runs with.
"""

from __future__ import annotations

import difflib
import importlib.util
import socket
from dataclasses import replace
from pathlib import Path

from engine import dcp, devices
from engine.checkpoints.aliases import is_alias, resolve_model_path
from engine.checkpoints.model_info import ModelInfo, dtype_bytes, read_model_info
from engine.errors import UserError
from engine.kernels import cpu_isa
from engine.kernels.cpu_paths import BF16_GEMM_ENV, KERNELS_ENV, CpuPaths, kernels_wanted, requested_bf16_gemm
from engine.parallel_layout import ParallelLayout, divisors, layout_problems
from engine.placement.split import COMM_CHOICES, DENSE_PLACEMENTS, DensePlacement
from engine.plan.kv_sizing import format_bytes, kv_sizing, parse_memory
from engine.plan.loader import LoadedPlan, PlanLoadError, load_plan
from engine.plan.resolved import ResolvedPlan, model_not_found
from engine.plan.schema import ATTENTION_BACKENDS, CPU_COMMS, DEVICES, DIST_BACKENDS, DTYPES
from engine.plan.validation import PlanCheck, PlanProblems

MAX_WORLD_SIZE = 65536  # ranks of one plan; far beyond any deployment, so a larger one is a typo


def _choice(problems: PlanProblems, key: str, value: str, choices: tuple[str, ...]) -> bool:
    if value in choices:
        return True
    close = difflib.get_close_matches(value, choices, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    problems.error(key, f"{key}={value!r} is not one of {', '.join(choices)}{hint}")
    return False


def _listing(values: list[int], limit: int = 16) -> str:
    shown = ", ".join(map(str, values[:limit]))
    return shown + (f", ... ({len(values)} in all)" if len(values) > limit else "")


def _check_static(problems: PlanProblems, res: ResolvedPlan) -> None:
    plan = res.plan
    p, c, s, lch = plan.parallel, plan.cache, plan.scheduler, plan.launch
    if p.pp != 1:
        problems.error(
            "parallel.pp", f"parallel.pp={p.pp}: pipeline parallelism is not supported yet; set parallel.pp=1"
        )
    if c.block_size < 1:
        problems.error("cache.block_size", f"cache.block_size={c.block_size} must be >= 1 (e.g. 16 or 64)")
    elif not 1 <= p.interleave <= c.block_size or c.block_size % p.interleave:
        problems.error(
            "parallel.interleave",
            f"parallel.interleave={p.interleave} does not divide cache.block_size={c.block_size}; "
            f"use one of {_listing(divisors(c.block_size))}",
        )
    _choice(problems, "model.dtype", plan.model.dtype, DTYPES)
    _choice(problems, "cache.dtype", c.dtype, DTYPES)
    _choice(problems, "attention.backend", plan.attention.backend, ATTENTION_BACKENDS)
    _choice(problems, "launch.device", lch.device, DEVICES)
    _choice(problems, "launch.dist_backend", lch.dist_backend, DIST_BACKENDS)
    _choice(problems, "launch.cpu_comm", lch.cpu_comm, CPU_COMMS)
    _choice(problems, "parallel.dense", p.dense, DENSE_PLACEMENTS)
    if p.dcp_comm_backend == "fi_a2a":
        problems.error(
            "parallel.dcp_comm_backend",
            "parallel.dcp_comm_backend='fi_a2a' is SGLang's FlashInfer MNNVL kernel and is not supported; "
            "use a2a (one all_to_all over the DCP group) or ag_rs",
        )
    else:
        _choice(problems, "parallel.dcp_comm_backend", p.dcp_comm_backend, COMM_CHOICES)
    if p.dcp == 1 and p.dcp_comm_backend == "a2a":
        problems.notes.append("parallel.dcp_comm_backend=a2a has no effect with parallel.dcp=1")
    if s.max_num_seqs < 1:
        problems.error("scheduler.max_num_seqs", f"scheduler.max_num_seqs={s.max_num_seqs} must be >= 1")
    if s.max_num_batched_tokens < 1:
        problems.error(
            "scheduler.max_num_batched_tokens",
            f"scheduler.max_num_batched_tokens={s.max_num_batched_tokens} must be >= 1",
        )
    if plan.model.max_model_len is not None and plan.model.max_model_len < 1:
        problems.error("model.max_model_len", f"model.max_model_len={plan.model.max_model_len} must be >= 1")
    if lch.nnodes < 1:
        problems.error("launch.nnodes", f"launch.nnodes={lch.nnodes} must be >= 1")
    elif not 0 <= lch.node_rank < lch.nnodes:
        problems.error(
            "launch.node_rank",
            f"launch.node_rank={lch.node_rank} must be in 0..{lch.nnodes - 1} (launch.nnodes={lch.nnodes})",
        )
    if lch.nnodes > 1 and lch.master_port == 0 and not lch.rdzv_endpoint:
        problems.error(
            "launch.master_port",
            "a multi-node launch needs launch.master_port (the same on every node) or launch.rdzv_endpoint",
        )
    if not 0 <= lch.master_port <= 65535:
        problems.error("launch.master_port", f"launch.master_port={lch.master_port} is not a port (0 picks a free one)")
    if not 0 <= plan.serve.port <= 65535:
        problems.error("serve.port", f"serve.port={plan.serve.port} is not a port number (1..65535)")
    if lch.dist_backend == "nccl" and res.device == "cpu":
        problems.error("launch.dist_backend", "launch.dist_backend=nccl needs CUDA; use gloo (or auto) on CPU")
    if lch.threads_per_rank < 0:
        problems.error(
            "launch.threads_per_rank",
            f"launch.threads_per_rank={lch.threads_per_rank} must be >= 0 (0: cores / local ranks)",
        )
    try:
        res.kv_budget_bytes, fraction = parse_memory(c.memory)
    except UserError as exc:
        problems.error("cache.memory", str(exc))
        return
    if fraction is not None and res.device == "cpu":
        local = res.local_world_size
        res.kv_budget_bytes = int(fraction * devices.available_memory_bytes() / local)
        problems.notes.append(
            f"cache.memory={c.memory}: {format_bytes(res.kv_budget_bytes)} per rank "
            f"({fraction:g} of free RAM over {local} local ranks)"
        )
    elif fraction is not None:
        problems.notes.append(f"cache.memory={c.memory}: the byte budget is measured on the GPU at launch")


def _resolve_dtypes(res: ResolvedPlan) -> None:
    plan = res.plan
    if plan.model.dtype != "auto":
        res.dtype = plan.model.dtype
    elif res.device == "cpu":
        res.dtype = "float32"
    else:
        ckpt = res.model.torch_dtype if res.model else "bfloat16"
        res.dtype = ckpt if ckpt in ("bfloat16", "float16") else "bfloat16"
    res.cache_dtype = res.dtype if plan.cache.dtype == "auto" else plan.cache.dtype


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


def _resolve_backend(problems: PlanProblems, res: ResolvedPlan) -> None:
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


def _resolve_cpu_paths(problems: PlanProblems, res: ResolvedPlan) -> None:
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


def _resolve_cpu_comm(problems: PlanProblems, res: ResolvedPlan) -> None:
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


def _check_model(problems: PlanProblems, res: ResolvedPlan, info: ModelInfo, dense_set: bool) -> None:
    plan = res.plan
    p = plan.parallel
    bad_layout = layout_problems(p.tp, p.dcp, info.num_heads, info.num_kv_heads, info.is_mla)
    for key, message in bad_layout:
        problems.error(key, message)
    if not bad_layout:
        res.layout = ParallelLayout.build(p.tp, p.dcp, info.num_heads, info.num_kv_heads, info.is_mla)
        # a world beyond MAX_WORLD_SIZE is an error of its own (_check_devices); its ranks are not enumerated
        choices = p.dense in DENSE_PLACEMENTS and p.dcp_comm_backend in COMM_CHOICES
        if choices and res.layout.world_size <= MAX_WORLD_SIZE:
            res.placement = DensePlacement.build(res.layout, info, p.dense, p.dcp_comm_backend)
            problems.notes.extend(res.placement.notes(dense_set))
    for name, size in (
        ("intermediate_size", info.intermediate_size),
        ("moe_intermediate_size", info.moe_intermediate_size),
    ):
        if not bad_layout and size and size % p.tp:
            problems.error("parallel.tp", f"parallel.tp={p.tp} does not divide the model's {name}={size}")
    limit = info.max_position_embeddings
    if plan.model.max_model_len is not None and plan.model.max_model_len > limit:
        problems.error(
            "model.max_model_len",
            f"model.max_model_len={plan.model.max_model_len} exceeds the model's "
            f"max_position_embeddings={limit}; use at most {limit}",
        )
    res.max_model_len = min(plan.model.max_model_len or limit, limit)


def _check_kv(problems: PlanProblems, res: ResolvedPlan, info: ModelInfo) -> None:
    plan = res.plan
    if res.kv_budget_bytes is None or res.layout is None or plan.cache.block_size < 1:
        return
    try:
        elem = dtype_bytes(res.cache_dtype)
    except UserError:
        return
    kv = kv_sizing(info, plan.parallel.tp, plan.parallel.dcp, plan.cache.block_size, elem, res.kv_budget_bytes)
    res.kv = kv
    need = res.max_model_len or 0
    if kv.token_capacity < need:
        budget = replace(kv, num_blocks=dcp.blocks_needed(need, kv.block_size, kv.dcp)).bytes_per_rank
        problems.error(
            "cache.memory",
            f"cache.memory={plan.cache.memory} holds {kv.token_capacity} tokens "
            f"({kv.num_blocks} blocks of {kv.block_size} per rank x dcp {kv.dcp}), fewer than one "
            f"sequence of model.max_model_len={need}; raise cache.memory to at least "
            f"{format_bytes(budget)} or lower model.max_model_len",
        )
    if not plan.scheduler.chunked_prefill and plan.scheduler.max_num_batched_tokens < need:
        problems.error(
            "scheduler.max_num_batched_tokens",
            f"scheduler.max_num_batched_tokens={plan.scheduler.max_num_batched_tokens} is below "
            f"model.max_model_len={need} with chunked_prefill off, so long prompts could never be "
            f"scheduled; enable scheduler.chunked_prefill or raise the token budget",
        )


def _check_devices(problems: PlanProblems, res: ResolvedPlan, here: bool) -> None:
    plan = res.plan
    world = res.world_size
    if world is None:
        return
    if world > MAX_WORLD_SIZE:
        problems.error(
            "parallel.dcp" if res.layout.replicas > 1 else "parallel.tp",
            f"world size {world} (tp={plan.parallel.tp} x replicas {res.layout.replicas}) is more ranks than "
            f"dcpctl launches (at most {MAX_WORLD_SIZE}); lower parallel.tp or parallel.dcp",
        )
        return
    nnodes = max(1, plan.launch.nnodes)
    if world % nnodes:
        problems.error(
            "launch.nnodes",
            f"world size {world} (tp={plan.parallel.tp} x replicas "
            f"{res.layout.replicas}) is not divisible by launch.nnodes={nnodes}",
        )
        return
    local = res.local_world_size
    if not here:
        return
    _check_addresses(problems, res)
    if res.device == "cuda":
        gpus = devices.cuda_device_count()
        if gpus < local:
            problems.error(
                "launch.device",
                f"the plan needs {local} GPUs on this node (world size {world} over "
                f"{nnodes} node(s)) but {gpus} are visible; lower parallel.tp/dcp or add nodes",
            )
        if plan.launch.dist_backend == "gloo":
            problems.warnings.append("launch.dist_backend=gloo on CUDA moves tensors through host memory (slow)")
    else:
        cores = devices.cpu_cores()
        if local > cores:
            problems.warnings.append(
                f"{local} ranks on {cores} CPU cores: ranks share cores (fine for checking correctness, slow for speed)"
            )
        _check_ram(problems, res, local)


def _check_addresses(problems: PlanProblems, res: ResolvedPlan) -> None:
    """The addresses this node binds: a single node's master (torchrun retries one that does not resolve for
    minutes) and node 0's server must resolve to an address of this machine."""
    lch, serve = res.plan.launch, res.plan.serve
    single = lch.nnodes == 1 and not lch.rdzv_endpoint and (res.world_size or 1) > 1
    if single and (problem := local_address_problem(lch.master_addr)):
        problems.error(
            "launch.master_addr", f"launch.master_addr={lch.master_addr} {problem}; on one node use 127.0.0.1"
        )
    if lch.node_rank == 0 and (problem := local_address_problem(serve.host)):
        problems.error(
            "serve.host", f"serve.host={serve.host} {problem}; use 127.0.0.1, or 0.0.0.0 for every interface"
        )


def local_address_problem(host: str) -> str | None:
    """Why a socket cannot bind `host` on this machine (it does not resolve, or is not one of its addresses)."""
    try:
        family, kind, _, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    except (OSError, UnicodeError, ValueError):
        return "does not resolve to an address"
    try:
        with socket.socket(family, kind) as sock:
            sock.bind(address)
    except OSError:
        return f"({address[0]}) is not an address of this machine"
    return None


def _check_ram(problems: PlanProblems, res: ResolvedPlan, local: int) -> None:
    """A CPU plan's KV caches on this node: an error beyond the machine's RAM, a warning beyond what is free now."""
    kv = (res.kv_budget_bytes or 0) * local
    total, free = devices.total_memory_bytes(), devices.available_memory_bytes()
    what = f"cache.memory={res.plan.cache.memory} x {local} local rank(s) is {format_bytes(kv)} of KV cache"
    if total and kv > total:
        problems.error(
            "cache.memory",
            f"{what}, more than this machine's {format_bytes(total)} of RAM; lower cache.memory "
            "(or give a fraction of free RAM, e.g. 0.5)",
        )
    elif free and kv > free:
        problems.warnings.append(f"{what}, more than the {format_bytes(free)} of RAM free now; the run may fail")


def _read_model(problems: PlanProblems, res: ResolvedPlan, strict: bool) -> ModelInfo | None:
    """The model's config, or None with an error (a folder that is not a checkpoint) or a note (no folder yet)."""
    path = res.plan.model.path
    try:
        res.model_path = resolve_model_path(path)
        exists, is_dir = res.model_path.exists(), res.model_path.is_dir()
        has_config = (res.model_path / "config.json").is_file()
    except (OSError, ValueError) as exc:
        problems.error("model.path", f"model.path={path!r} is not a usable path ({exc}); fix model.path")
        return None
    if has_config:
        try:
            return read_model_info(res.model_path)
        except UserError as exc:
            problems.error("model.path", str(exc))
            return None
    if exists:
        what = f"the folder {res.model_path} has no config.json" if is_dir else f"{res.model_path} is a file"
        fix = (
            f"run `dcpctl model pull {path}`"
            if is_alias(path)
            else "point model.path at an HF checkpoint folder (config.json, *.safetensors)"
        )
        problems.error("model.path", f"model.path={path} is not a model: {what}; {fix}")
        return None
    message = model_not_found(res.model_path, path)
    if strict:
        problems.error("model.path", f"{message}; required by --strict")
    else:
        problems.notes.append(f"{message}; model checks skipped")
    return None


def check_plan(
    loaded: LoadedPlan,
    strict: bool = False,
    model: ModelInfo | None = None,
    devices_here: bool = True,
    prefill: PlanCheck | None = None,
) -> PlanCheck:
    """Validate a loaded plan against every rule; never raises for a bad plan.

    `model`: the model's facts when they are known without its folder (`plan suggest` plans for shipped
    architectures). `devices_here=False` checks the plan for the cluster it names, not this machine's GPUs and cores.
    `prefill`: a P/D plan's prefill plan, already checked, instead of the file `disagg.prefill` names.
    """
    plan = loaded.plan
    problems = PlanProblems(where=loaded.where)
    res = ResolvedPlan(source=str(loaded.source), plan=plan)
    res.device = devices.resolve_device(plan.launch.device) if plan.launch.device in DEVICES else "cpu"
    if model is not None:
        res.model_path = resolve_model_path(plan.model.path)
    res.model = info = model if model is not None else _read_model(problems, res, strict)
    if info is not None:
        _check_model(problems, res, info, dense_set="parallel.dense" in loaded.origins)
    _resolve_dtypes(res)
    _check_static(problems, res)
    _resolve_backend(problems, res)
    _resolve_cpu_paths(problems, res)
    _resolve_cpu_comm(problems, res)
    if info is not None:
        _check_kv(problems, res, info)
    _check_devices(problems, res, devices_here)
    if plan.disagg.prefill is not None:
        from engine.plan import disagg  # P/D plans only

        if prefill is None:
            prefill = validate_plan_file(disagg.prefill_file(loaded), loaded.prefill_overrides, strict=strict)
        res.disagg = disagg.check_pair(problems, res, prefill)
    return PlanCheck(source=res.source, name=plan.name, problems=problems, resolved=res)


def validate_plan_file(path: str | Path, overrides: list[str] | None = None, strict: bool = False) -> PlanCheck:
    """Load and check one plan file; schema problems come back as errors in the check."""
    try:
        loaded = load_plan(path, overrides)
    except PlanLoadError as exc:
        return PlanCheck(source=str(path), name=Path(path).stem, problems=PlanProblems(errors=list(exc.problems)))
    return check_plan(loaded, strict=strict)


def resolve_plan(plan: str | Path | ResolvedPlan, overrides: list[str] | None = None) -> ResolvedPlan:
    """A plan file (with overrides) checked and resolved; a UserError lists every problem of an invalid plan."""
    if isinstance(plan, ResolvedPlan):
        return plan
    return validate_plan_file(plan, overrides).require_valid()

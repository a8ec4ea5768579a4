"""The checks of a plan's own fields, each against its rule alone: choices, ranges, ports, the KV byte budget.

Nothing here reads the model or this machine's devices beyond the free RAM a `cache.memory` fraction takes.
"""

from __future__ import annotations

import difflib

from engine import devices
from engine.errors import UserError
from engine.parallel_layout import divisors
from engine.placement.split import COMM_CHOICES, DENSE_PLACEMENTS
from engine.plan.kv_sizing import format_bytes, parse_memory
from engine.plan.resolved import ResolvedPlan
from engine.plan.schema import (
    ATTENTION_BACKENDS,
    CACHE_DTYPES,
    CPU_COMMS,
    DEVICES,
    DIST_BACKENDS,
    DTYPES,
    SERVING_ENGINES,
)
from engine.plan.validation import PlanProblems

# The fields whose value is one of a few names (the docs' plan reference lists them from here).
FIELD_CHOICES: dict[str, tuple[str, ...]] = {
    "model.dtype": DTYPES,
    "cache.dtype": CACHE_DTYPES,
    "attention.backend": ATTENTION_BACKENDS,
    "launch.device": DEVICES,
    "launch.dist_backend": DIST_BACKENDS,
    "launch.cpu_comm": CPU_COMMS,
    "parallel.dense": DENSE_PLACEMENTS,
    "parallel.dcp_comm_backend": COMM_CHOICES,
    "engine.name": SERVING_ENGINES,
}


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


def check_fields(problems: PlanProblems, res: ResolvedPlan) -> None:
    """Every field against its own rule; resolves the KV byte budget `cache.memory` gives each rank."""
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
    for key, choices in FIELD_CHOICES.items():
        section, name = key.split(".")
        if key != "parallel.dcp_comm_backend":  # below: SGLang's fi_a2a gets a fix of its own
            _choice(problems, key, getattr(getattr(plan, section), name), choices)
    if p.dcp_comm_backend == "fi_a2a":
        problems.error(
            "parallel.dcp_comm_backend",
            "parallel.dcp_comm_backend='fi_a2a' is SGLang's FlashInfer MNNVL kernel and is not supported; "
            "use a2a (one all_to_all over the DCP group) or ag_rs",
        )
    else:
        _choice(problems, "parallel.dcp_comm_backend", p.dcp_comm_backend, FIELD_CHOICES["parallel.dcp_comm_backend"])
    if c.calculate_kv_scales and not c.dtype.startswith("fp8"):
        problems.error(
            "cache.calculate_kv_scales",
            f"cache.calculate_kv_scales calibrates an fp8 cache's scales, but cache.dtype is {c.dtype}; "
            "set cache.dtype=fp8 (or fp8_e4m3, fp8_e5m2) or drop cache.calculate_kv_scales",
        )
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
    if lch.rdzv_timeout_s < 1:
        problems.error("launch.rdzv_timeout_s", f"launch.rdzv_timeout_s={lch.rdzv_timeout_s} must be >= 1 (seconds)")
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
    timeout = plan.engine.startup_timeout_s
    if timeout is not None and not (0 < timeout < float("inf")):
        problems.error(
            "engine.startup_timeout_s",
            f"engine.startup_timeout_s={timeout} must be a positive number of seconds (vLLM-CPU starts in 100-220)",
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

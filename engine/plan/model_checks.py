"""The checks of a plan against its model: the checkpoint folder, the layout its heads allow, the dense placement,
max_model_len, and whether the KV budget holds one sequence of it."""

from __future__ import annotations

from dataclasses import replace

from engine import dcp
from engine.checkpoints.aliases import is_alias, resolve_model_path
from engine.checkpoints.model_info import ModelInfo, dtype_bytes, read_model_info
from engine.errors import UserError
from engine.parallel_layout import ParallelLayout, layout_problems
from engine.placement.split import COMM_CHOICES, DENSE_PLACEMENTS, DensePlacement
from engine.plan.kv_sizing import format_bytes, kv_sizing
from engine.plan.machine_checks import MAX_WORLD_SIZE
from engine.plan.resolved import ResolvedPlan, model_not_found
from engine.plan.validation import PlanProblems


def read_model(problems: PlanProblems, res: ResolvedPlan, strict: bool) -> ModelInfo | None:
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


def check_model(problems: PlanProblems, res: ResolvedPlan, info: ModelInfo, dense_set: bool) -> None:
    """The layout the model's heads allow, its dense placement, tp against the MLP widths, max_model_len."""
    plan = res.plan
    p = plan.parallel
    bad_layout = layout_problems(p.tp, p.dcp, info.num_heads, info.num_kv_heads, info.is_mla)
    for key, message in bad_layout:
        problems.error(key, message)
    if not bad_layout:
        res.layout = ParallelLayout.build(p.tp, p.dcp, info.num_heads, info.num_kv_heads, info.is_mla)
        # a world beyond MAX_WORLD_SIZE is an error of its own (check_devices); its ranks are not enumerated
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


def check_kv(problems: PlanProblems, res: ResolvedPlan, info: ModelInfo) -> None:
    """Whether the KV budget holds one sequence of max_model_len, and the token budget one prompt."""
    plan = res.plan
    if res.kv_budget_bytes is None or res.layout is None or plan.cache.block_size < 1:
        return
    try:
        elem = dtype_bytes(res.cache_dtype)
    except UserError:
        return
    draft = res.speculative.draft if res.speculative is not None else None
    kv = kv_sizing(
        info,
        plan.parallel.tp,
        plan.parallel.dcp,
        plan.cache.block_size,
        elem,
        res.kv_budget_bytes,
        draft.info if draft is not None else None,
    )
    res.kv = kv
    need = res.max_model_len or 0
    if kv.token_capacity < need:
        budget = replace(kv, num_blocks=dcp.blocks_needed(need, kv.block_size, kv.dcp)).bytes_on_rank0
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

"""The slice of a resolved plan that the engine runs with (`EngineConfig`): every rank's start-up and rank 0's
engine read it, never the whole resolved plan."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.checkpoints.model_info import ModelInfo
from engine.core.scheduler import SchedulerConfig
from engine.errors import UserError
from engine.kv_transfer.handles import KVRole
from engine.parallel_layout import ParallelLayout
from engine.placement.split import DensePlacement
from engine.plan.kv_sizing import parse_memory
from engine.plan.resolved import ResolvedPlan, SpeculativeConfig


@dataclass(frozen=True)
class EngineConfig:
    """The slice of a resolved plan the engine runs with."""

    model_path: Path
    model: ModelInfo
    layout: ParallelLayout
    placement: DensePlacement
    dtype: str
    cache_dtype: str
    calculate_kv_scales: bool  # an fp8 cache's scales from the first prefill (cache.calculate_kv_scales)
    device: str
    dist_backend: str
    cpu_comm: str  # CPU: "shm" or "gloo" (the plan's launch.cpu_comm resolved); "" on CUDA
    cpu_comm_strict: bool  # launch.cpu_comm=shm asked for it: no fallback to gloo
    attention_backend: str
    block_size: int
    interleave: int
    max_model_len: int
    num_blocks: int | None  # KV blocks per rank; None: a fraction of free GPU memory, measured after loading
    kv_memory_fraction: float | None
    scheduler: SchedulerConfig
    prefix_caching: bool
    threads_per_rank: int
    local_world_size: int  # ranks on this node, which share its cores
    kv_role: KVRole | None = None  # P/D: this instance's part in the hand-off
    speculative: SpeculativeConfig | None = None  # speculative decoding (speculative_config), None: off
    enforce_eager: bool = False  # CUDA: no decode graphs

    @classmethod
    def from_plan(cls, resolved: ResolvedPlan, kv_role: KVRole | None = None) -> EngineConfig:
        """The engine's slice of a valid plan (`PlanCheck.require_valid`); a UserError when its model folder is
        not here. `kv_role`: the instance's part in a P/D hand-off."""
        if resolved.missing_model:
            raise UserError(resolved.missing_model)
        plan = resolved.plan
        _, fraction = parse_memory(plan.cache.memory)
        max_len = resolved.max_model_len or resolved.model.max_position_embeddings
        return cls(
            model_path=resolved.model_path,
            model=resolved.model,
            layout=resolved.layout,
            placement=resolved.placement,
            dtype=resolved.dtype,
            cache_dtype=resolved.cache_dtype,
            calculate_kv_scales=plan.cache.calculate_kv_scales,
            device=resolved.device,
            dist_backend=plan.launch.dist_backend,
            cpu_comm=resolved.cpu_comm,
            cpu_comm_strict=plan.launch.cpu_comm == "shm",
            attention_backend=resolved.backend,
            block_size=plan.cache.block_size,
            interleave=plan.parallel.interleave,
            max_model_len=max_len,
            num_blocks=resolved.kv.num_blocks if resolved.kv is not None else None,
            kv_memory_fraction=fraction,
            scheduler=SchedulerConfig(
                plan.scheduler.max_num_seqs,
                plan.scheduler.max_num_batched_tokens,
                plan.scheduler.chunked_prefill,
                max_len,
            ),
            prefix_caching=plan.cache.prefix_caching,
            threads_per_rank=plan.launch.threads_per_rank,
            local_world_size=resolved.local_world_size,
            kv_role=kv_role,
            speculative=resolved.speculative,
            enforce_eager=plan.model.enforce_eager,
        )

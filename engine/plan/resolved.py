"""What a plan resolves to on this machine (`ResolvedPlan`): its sections, the model's facts and folder, the layout,
the KV sizing, the device, dtypes and attention backend, the CPU kernel paths.

Facts derived from those (world size, ranks per node, why the model cannot load here, the overrides every rank
reproduces the plan with) are its properties, worked out in one place. It holds no validation problems: those are
`engine.plan.validation.PlanProblems`, and `PlanCheck.require_valid` is the one door from a check to a runnable
plan. The engine takes only its slice of it (`engine.core.config.EngineConfig`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.checkpoints.model_info import ModelInfo
from engine.kernels.cpu_paths import CpuPaths
from engine.parallel_layout import ParallelLayout
from engine.placement.split import DensePlacement
from engine.plan.kv_sizing import KVSizing
from engine.plan.schema import DisaggSection, Plan


@dataclass(frozen=True)
class DraftModel:
    """speculative_config.model resolved: the draft checkpoint rank 0 runs unsharded beside the target."""

    path: Path
    info: ModelInfo
    num_params: int  # parameters in its safetensors (tied weights once): its weights on rank 0 at the plan's dtype


@dataclass(frozen=True)
class SpeculativeConfig:
    """The plan's speculative_config, resolved (method ngram, or draft_model when `draft` is set)."""

    num_speculative_tokens: int  # k: proposals per step
    prompt_lookup_min: int  # ngram: shortest suffix n-gram looked up (0 with a draft model)
    prompt_lookup_max: int  # ngram: longest suffix n-gram looked up (0 with a draft model)
    disable_by_batch_size: int | None = None  # no proposals while more sequences than this run
    draft: DraftModel | None = None  # method draft_model: the draft checkpoint (None: ngram)


@dataclass
class DisaggPlan:
    """A P/D plan's deployment: its disagg section and the prefill plan (None when that plan is not valid)."""

    section: DisaggSection
    prefill_name: str
    prefill: ResolvedPlan | None


@dataclass
class ResolvedPlan:
    """A plan's sections and what they resolve to here (filled in while the plan is checked).

    Model, layout and KV sizing stay None while the model folder is absent (a note, unless --strict).
    """

    source: str  # the plan file
    plan: Plan
    model: ModelInfo | None = None
    model_path: Path | None = None
    layout: ParallelLayout | None = None
    placement: DensePlacement | None = None  # the dense layers' splits (parallel.dense, parallel.dcp_comm_backend)
    kv: KVSizing | None = None
    device: str = ""
    dtype: str = ""
    cache_dtype: str = ""
    backend: str = ""
    max_model_len: int | None = None
    kv_budget_bytes: int | None = None
    cpu_paths: CpuPaths | None = None  # CPU plans: the ISA level and the kernels chosen from it
    cpu_comm: str = ""  # CPU plans: "shm" or "gloo", what carries the tensor collectives between ranks
    disagg: DisaggPlan | None = None  # P/D plans: the deployment (this plan is its decode side)
    speculative: SpeculativeConfig | None = None  # speculative_config, when it asks for speculative decoding

    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def world_size(self) -> int | None:
        return self.layout.world_size if self.layout is not None else None

    @property
    def local_world_size(self) -> int:
        """Ranks each node starts: the world size over launch.nnodes, at least 1 (the one place that divides).

        Without a layout (no model to check the heads against) parallel.tp, the least world size, stands in.
        """
        return max(1, (self.world_size or self.plan.parallel.tp) // max(1, self.plan.launch.nnodes))

    @property
    def missing_model(self) -> str | None:
        """Why the plan cannot run here for want of its model folder (None when the folder is there)."""
        if self.model is not None:
            return None
        return f"plan {self.name}: {model_not_found(self.model_path, self.plan.model.path)}"

    @property
    def collectives_transport(self) -> str:
        """What carries the tensor collectives between the plan's ranks (the run's start-up line says what did)."""
        launch = self.plan.launch
        if self.world_size == 1:
            return "none (one rank)"
        if self.device != "cpu":
            return f"{launch.dist_backend if launch.dist_backend != 'auto' else 'nccl'} (gloo for step plans)"
        if self.cpu_comm == "shm":
            return f"shared memory, every rank on this node (launch.cpu_comm={launch.cpu_comm}); gloo for step plans"
        why = f"launch.nnodes={launch.nnodes}" if launch.nnodes > 1 else f"launch.cpu_comm={launch.cpu_comm}"
        return f"gloo ({why})"

    def rank_overrides(self, overrides: list[str]) -> list[str]:
        """The overrides every rank loads the plan file with: the given ones, and a CPU plan's KV budget pinned in
        bytes (a fraction of free RAM differs from rank to rank; every rank must size the same cache)."""
        if self.kv_budget_bytes is not None and self.device == "cpu":
            return [*overrides, f"cache.memory={self.kv_budget_bytes}B"]
        return list(overrides)


def model_not_found(model_path: Path | None, spec: str) -> str:
    """The one wording of an absent model folder, with its fix (plan checks and every launch say it so)."""
    return f"model folder {model_path} not found (run `dcpctl model pull {spec}` or fix model.path)"

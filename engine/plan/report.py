"""The outcome of checking one plan: every problem found (errors with their place, warnings, notes) and what the
plan resolves to on this machine (model, device, dtypes, backend, layout, KV sizing, CPU kernel paths).

Facts derived from those (world size, ranks per node, why the plan cannot run here) are properties of the report,
worked out in one place; the engine takes only its slice of a report (`engine.core.config.EngineConfig`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from engine.checkpoints.model_info import ModelInfo
from engine.errors import UserError
from engine.kernels.cpu_paths import CpuPaths
from engine.parallel_layout import ParallelLayout
from engine.plan.kv_sizing import KVSizing
from engine.plan.loader import LoadedPlan, PlanProblem
from engine.plan.schema import Plan

if TYPE_CHECKING:
    from engine.plan.disagg import DisaggPlan


@dataclass
class PlanReport:
    """Outcome of validating one plan, plus what it resolves to."""

    source: str
    name: str = ""
    loaded: LoadedPlan | None = None
    errors: list[PlanProblem] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    model: ModelInfo | None = None
    model_path: Path | None = None
    layout: ParallelLayout | None = None
    kv: KVSizing | None = None
    device: str = ""
    dtype: str = ""
    cache_dtype: str = ""
    backend: str = ""
    max_model_len: int | None = None
    kv_budget_bytes: int | None = None
    cpu_paths: CpuPaths | None = None  # CPU plans: the ISA level and the kernels chosen from it
    disagg: DisaggPlan | None = None  # P/D plans: the deployment (this plan is its decode side)

    @property
    def valid(self) -> bool:
        return not self.errors

    @property
    def plan(self) -> Plan:
        assert self.loaded is not None
        return self.loaded.plan

    @property
    def world_size(self) -> int | None:
        if self.layout is not None:
            return self.layout.world_size
        return None

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

    def require_valid(self) -> PlanReport:
        """This report, or a UserError that lists every problem of the invalid plan."""
        if self.errors:
            raise UserError(f"plan {self.name} is invalid: " + "; ".join(str(e) for e in self.errors))
        return self

    def error(self, key: str, message: str) -> None:
        file, line = self.loaded.where(key) if self.loaded else (self.source, None)
        self.errors.append(PlanProblem(key, message, file, line))


def model_not_found(model_path: Path | None, spec: str) -> str:
    """The one wording of an absent model folder, with its fix (plan checks and every launch say it so)."""
    return f"model folder {model_path} not found (run `dcpctl model pull {spec}` or fix model.path)"

"""What every export shares: the plan facts an exporter reads (`PlanFacts`), what it returns (`Export`: the
commands or configs per instance, and every gap with the engine's rule and a reference), and the one list of
plan fields an engine has no equivalent for (`uncarried_gaps`), so that nothing is dropped silently.

The per-engine rules live beside it (`vllm_export`, `sglang_export`, `trtllm_export`); `exporters.export_plan`
picks one.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.checkpoints.aliases import HUB_ALIASES, KNOWN_ALIASES, resolve_model_path
from engine.errors import UserError
from engine.parallel_layout import ParallelLayout
from engine.plan.checks import check_plan
from engine.plan.loader import PlanLoadError, load_plan, plan_to_dict
from engine.plan.resolved import ResolvedPlan
from engine.plan.schema import Plan

ENGINES = ("vllm", "sglang", "trtllm")
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang", "trtllm": "TensorRT-LLM"}
# plan fields that describe the plan or dcpctl itself: no engine needs them
_OWN_FIELDS = ("name", "description", "base", "engine.", "disagg.prefill")


@dataclass(frozen=True)
class Gap:
    """A plan setting the target engine cannot take as it is, or a layout it rejects."""

    field: str  # the plan field ("parallel.dcp"), or "layout"
    message: str  # what happens to it there, with the engine's own rule
    reference: str  # where that rule is written (docs page, source, PR)
    blocking: bool = False  # the plan cannot run there as it is (the export exits 1 without --allow-partial)
    closest: str = ""  # blocking: the change the closest runnable export made ("parallel.dcp 2 -> 1")

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v != ""}


@dataclass
class Instance:
    """One server of the deployment: its command line, environment and (TensorRT-LLM) config file."""

    role: str  # "serve", or "prefill" / "decode" for a P/D plan
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    config: dict[str, Any] | None = None  # TensorRT-LLM's --extra_llm_api_options YAML
    config_file: str = ""  # the name the command gives that YAML

    @property
    def command(self) -> str:
        """The shell line: environment, then the quoted words."""
        env = [f"{k}={shlex.quote(v)}" for k, v in self.env.items()]
        return " ".join([*env, *(shlex.quote(w) for w in self.argv)])

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"role": self.role, "command": self.command, "argv": self.argv, "env": self.env}
        if self.config is not None:
            data["config_file"], data["config"] = self.config_file, self.config
        return data


@dataclass
class Export:
    """A plan exported to one engine."""

    engine: str
    plan: str  # the plan's name
    source: str  # the plan file
    instances: list[Instance]
    gaps: list[Gap]
    checked: str = ""  # what the export was checked against (an installed vLLM's version and verdict), if anything

    @property
    def runnable(self) -> bool:
        """False when a gap blocks: the instances are then only the closest runnable layout."""
        return not any(g.blocking for g in self.gaps)

    def to_dict(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "plan": self.plan,
            "source": self.source,
            "runnable": self.runnable,
            "instances": [i.to_dict() for i in self.instances],
            "gaps": [g.to_dict() for g in self.gaps],
            "checked": self.checked,
        }


@dataclass(frozen=True)
class PlanFacts:
    """What an exporter reads of a checked plan: its fields and the model facts the engines' rules need."""

    plan: Plan
    source: str
    is_mla: bool | None  # None: the model's config is not known here
    num_kv_heads: int | None
    world_size: int
    max_model_len: int | None
    comm_backend: str  # the DCP combine, `auto` resolved where the model is known
    model_arg: str  # what the engine loads: a hub id for a hub alias, else the folder
    prefill: PlanFacts | None = None  # a P/D plan's prefill side

    @property
    def device(self) -> str:
        """cpu or cuda: a plan that leaves launch.device to auto is taken to be for GPUs."""
        return "cpu" if self.plan.launch.device == "cpu" else "cuda"

    @property
    def tp_reuses_ranks(self) -> bool:
        """DCP inside the TP group (tp % dcp == 0), the only layout vLLM and SGLang have."""
        return self.plan.parallel.tp % self.plan.parallel.dcp == 0


def model_arg(path_or_alias: str) -> str:
    """The model argument a peer engine takes: a hub alias's repo id, else the checkpoint folder."""
    if path_or_alias in HUB_ALIASES:
        return HUB_ALIASES[path_or_alias]
    if path_or_alias in KNOWN_ALIASES:
        return str(resolve_model_path(path_or_alias))
    return path_or_alias


def model_path_of(arg: str) -> str:
    """Inverse of `model_arg`: an alias where the argument is one's repo id or folder, else the argument."""
    for alias, repo in HUB_ALIASES.items():
        if arg == repo:
            return alias
    for alias in KNOWN_ALIASES:
        if Path(arg).expanduser() == resolve_model_path(alias):
            return alias
    return arg


def _model_info(plan: Plan):
    """The model's facts: from its folder, else from the config facts dcpctl ships (None when neither)."""
    from engine.suggest.models import planned_model

    try:
        return planned_model(plan.model.path).info
    except UserError:
        return None


def plan_facts(path: str | Path, overrides: list[str] | None = None) -> PlanFacts:
    """Load and check a plan for export (for the cluster it names, not this machine); a UserError lists every
    problem of an invalid plan."""
    try:
        loaded = load_plan(path, overrides)
    except PlanLoadError as exc:
        raise UserError(f"{path}: " + "; ".join(str(p) for p in exc.problems)) from None
    info = _model_info(loaded.plan)
    check = check_plan(loaded, model=info, devices_here=False)
    if check.problems.errors:
        problems = "; ".join(str(e) for e in check.problems.errors)
        raise UserError(f"plan {check.name} is not valid ({problems}); fix it first (`dcpctl plan validate {path}`)")
    res: ResolvedPlan = check.resolved
    plan = res.plan
    prefill = None
    if plan.disagg.prefill is not None:
        from engine.plan import disagg

        prefill = plan_facts(disagg.prefill_file(loaded), loaded.prefill_overrides)
    p = plan.parallel
    world = p.tp
    if info is not None:
        world = ParallelLayout.build(p.tp, p.dcp, info.num_heads, info.num_kv_heads, info.is_mla).world_size
    comm = res.placement.comm_backend if res.placement is not None else p.dcp_comm_backend
    return PlanFacts(
        plan=plan,
        source=str(path),
        is_mla=info.is_mla if info is not None else None,
        num_kv_heads=info.num_kv_heads if info is not None else None,
        world_size=world,
        max_model_len=res.max_model_len or plan.model.max_model_len,
        comm_backend=comm,
        model_arg=model_arg(plan.model.path),
        prefill=prefill,
    )


def _flat(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def set_fields(plan: Plan) -> dict[str, Any]:
    """The plan's fields whose value differs from the schema default (model.path always differs)."""
    defaults = _flat(plan_to_dict(Plan(model=type(plan.model)(path=""))))
    return {k: v for k, v in _flat(plan_to_dict(plan)).items() if defaults.get(k) != v}


def uncarried_gaps(plan: Plan, carried: set[str], engine: str, reference: str) -> list[Gap]:
    """A gap for every field set in the plan that the engine has no equivalent for (`carried`: those it has)."""
    gaps = []
    for key, value in sorted(set_fields(plan).items()):
        if key in carried or key.startswith(_OWN_FIELDS):
            continue
        gaps.append(Gap(key, f"{key}={value} has no {engine} equivalent: not carried over", reference))
    return gaps


def pd_ports(plan: Plan) -> dict[str, int]:
    """A P/D plan's instance ports: disagg.prefill_port / decode_port, or the two after serve.port (the router's)
    where they are 0 (dcpctl picks free ones; another engine's command needs them fixed)."""
    return {
        "prefill": plan.disagg.prefill_port or plan.serve.port + 1,
        "decode": plan.disagg.decode_port or plan.serve.port + 2,
    }


def prefixed(gap: Gap, side: str) -> Gap:
    """The gap as one side of a P/D deployment ("prefill: ...")."""
    return Gap(gap.field, f"{side}: {gap.message}", gap.reference, gap.blocking, gap.closest)

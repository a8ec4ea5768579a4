"""Cross-checks of a loaded plan against the rules of DESIGN.md and the model's config.json.

Every problem is collected (not just the first), each naming the field, the values, the rule
and a fix. The result, a `PlanCheck`, holds those problems beside the resolved plan (device, dtypes, backend,
layout, KV sizing) that `plan show` displays and the engine runs with.

The checks sit beside this module by what they read: the plan's own fields (`field_checks`), the model
(`model_checks`), what the plan resolves to run with (`runtime_choices`) and the machine (`machine_checks`).
"""

from __future__ import annotations

from pathlib import Path

from engine import devices
from engine.checkpoints.aliases import resolve_model_path
from engine.checkpoints.model_info import ModelInfo
from engine.plan.field_checks import check_fields
from engine.plan.loader import LoadedPlan, PlanLoadError, load_plan
from engine.plan.machine_checks import check_devices
from engine.plan.model_checks import check_kv, check_model, read_model
from engine.plan.resolved import ResolvedPlan
from engine.plan.runtime_choices import resolve_backend, resolve_cpu_comm, resolve_cpu_paths, resolve_dtypes
from engine.plan.schema import DEVICES
from engine.plan.speculative import check_speculative
from engine.plan.validation import PlanCheck, PlanProblems


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
    res.model = info = model if model is not None else read_model(problems, res, strict)
    if info is not None:
        check_model(problems, res, info, dense_set="parallel.dense" in loaded.origins)
    resolve_dtypes(res)
    check_fields(problems, res)
    res.speculative = check_speculative(problems, plan.speculative_config, res)
    resolve_backend(problems, res)
    resolve_cpu_paths(problems, res)
    resolve_cpu_comm(problems, res)
    if info is not None:
        check_kv(problems, res, info)
    check_devices(problems, res, devices_here)
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

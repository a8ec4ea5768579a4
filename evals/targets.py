"""What `dcpctl eval` and `dcpctl bench` measure: targets, each a plan file (launched) or an endpoint URL (as it is).

`resolve_targets` validates every plan and checks every URL before anything launches, and returns every problem
found (it prints nothing): the caller shows them and stops.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from engine.errors import UserError
from engine.plan.checks import validate_plan_file
from engine.plan.resolved import ResolvedPlan
from engine.plan.validation import PlanCheck
from evals.endpoint import check_server, normalize_base_url

URL_PREFIXES = ("http://", "https://")


def is_url(spec: str) -> bool:
    """A target given as an endpoint rather than a plan file."""
    return spec.startswith(URL_PREFIXES)


@dataclass
class Target:
    """One column of a comparison: a plan file with its resolved plan (launched only when its check found no
    problem), or a URL (no resolved plan)."""

    spec: str
    label: str
    resolved: ResolvedPlan | None = None
    dir_name: str = ""  # its folder under the output directory

    @property
    def is_url(self) -> bool:
        return self.resolved is None


@dataclass
class TargetCheck:
    """The targets, the plans' checks (for the validation table) and every problem that stops the run."""

    targets: list[Target] = field(default_factory=list)
    plan_checks: list[PlanCheck] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def resolve_targets(specs: list[str], overrides: list[str]) -> TargetCheck:
    """Validate every plan (with the overrides) and check every URL; labels and folder names come out unique."""
    check = TargetCheck()
    for spec in specs:
        if is_url(spec):
            try:
                root = normalize_base_url(spec)
                check_server(root)
            except UserError as exc:
                check.problems.append(f"{spec}: {exc}")
                root = spec
            check.targets.append(Target(spec=root, label=root))
            continue
        checked = validate_plan_file(spec, overrides)
        check.plan_checks.append(checked)
        if checked.valid and checked.resolved.missing_model:
            check.problems.append(checked.resolved.missing_model)
        check.problems += [f"plan {checked.name}: {e}" for e in checked.problems.errors]
        if checked.valid and checked.resolved.plan.engine.name == "vllm":
            from engine.peers.vllm_server import vllm_problems

            check.problems += vllm_problems(spec, overrides)
        check.targets.append(Target(spec=spec, label=checked.name, resolved=checked.resolved))
    labels = [t.label for t in check.targets]
    for t, label, name in zip(check.targets, unique_labels(labels), plan_dir_names(labels), strict=True):
        t.label, t.dir_name = label, name
    return check


def unique_labels(labels: list[str]) -> list[str]:
    """The labels, a repeated one numbered: ['a', 'a'] -> ['a', 'a (2)']."""
    out: list[str] = []
    for label in labels:
        name, k = label, 2
        while name in out:
            name, k = f"{label} ({k})", k + 1
        out.append(name)
    return out


def plan_dir_names(labels: list[str]) -> list[str]:
    """Folder-safe, unique names for plan labels (e.g. 'plans/tp2.yaml' -> 'plans_tp2.yaml')."""
    names: list[str] = []
    for label in labels:
        base = re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("._") or "plan"
        name, k = base, 2
        while name in names:
            name, k = f"{base}_{k}", k + 1
        names.append(name)
    return names

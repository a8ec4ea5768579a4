"""The outcome of checking one plan (`PlanCheck`): every problem found (`PlanProblems`: errors with their place,
warnings, notes) beside what the plan resolves to (`engine.plan.resolved.ResolvedPlan`).

`PlanCheck.require_valid` is the one place a check becomes a plan to run, or a UserError listing every problem.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from engine.errors import UserError
from engine.plan.loader import PlanProblem
from engine.plan.resolved import ResolvedPlan


@dataclass
class PlanProblems:
    """What checking a plan found: errors (each with its file and line), warnings and notes."""

    errors: list[PlanProblem] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    where: Callable[[str], tuple[str, int | None]] | None = field(default=None, repr=False, compare=False)

    def error(self, key: str, message: str) -> None:
        """An error about plan field `key`, placed where that field was set."""
        file, line = self.where(key) if self.where is not None else ("", None)
        self.errors.append(PlanProblem(key, message, file, line))


@dataclass
class PlanCheck:
    """One plan checked: its problems and what it resolves to.

    `resolved` is None when the plan did not load; for an invalid plan it holds what could be resolved (for
    `plan show` and the validation table), so the run paths take it only through `require_valid`.
    """

    source: str
    name: str
    problems: PlanProblems
    resolved: ResolvedPlan | None = None

    @property
    def valid(self) -> bool:
        return not self.problems.errors

    def require_valid(self) -> ResolvedPlan:
        """The resolved plan, or a UserError that lists every problem of the invalid plan."""
        if self.problems.errors or self.resolved is None:
            errors = "; ".join(str(e) for e in self.problems.errors)
            raise UserError(f"plan {self.name} is invalid: {errors}")
        return self.resolved

"""Shared command-line argument conventions."""

from __future__ import annotations

import typer

from evals.targets import is_url


def split_plans_and_overrides(args: list[str]) -> tuple[list[str], list[str]]:
    """Split positional arguments into plan files/URLs and trailing KEY=VALUE overrides."""
    plans = [a for a in args if "=" not in a or is_url(a)]
    overrides = [a for a in args if a not in plans]
    if not plans:
        raise typer.BadParameter("give at least one plan file (e.g. plans/tp1_dcp1.yaml)")
    return plans, overrides

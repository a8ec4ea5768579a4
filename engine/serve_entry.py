"""`python -m engine.serve_entry PLAN [KEY=VALUE ...]`: serve a plan's OpenAI-compatible API.

The engine's own entry point for serving, without the `dcpctl` command line: `dcpctl run PLAN` (no prompts) calls
the same functions, and evals starts the plans it measures through it. Once healthy it prints
`serving NAME on http://HOST:PORT ...`; a user error prints `error: ...` and exits 1; SIGINT stops every rank
(exit 0 for one rank, 130 when it interrupts torchrun); bad arguments exit 2.
"""

from __future__ import annotations

import argparse
import sys

from engine.errors import UserError
from engine.plan.report import PlanReport

ROLES = ("all", "prefill", "decode", "router")  # the pieces of a P/D plan `--role` may serve


def serving_report(plan: str, overrides: list[str]) -> PlanReport:
    """The validated plan, with its model folder present; UserError otherwise."""
    from engine.llm import resolve_report

    report = resolve_report(plan, overrides)
    if report.missing_model:
        raise UserError(report.missing_model)
    return report


def serve(report: PlanReport, overrides: list[str], role: str = "all") -> None:
    """Serve the plan until SIGINT/SIGTERM: in this process for one rank, else its ranks under torchrun.

    A P/D plan (`disagg` section) is served whole (`role` "all": both instances and the router), or one piece of it
    ("prefill", "decode", "router"): each instance is served as a plan of its own, with its part in the hand-off.
    """
    from engine.runtime.launcher import ensure_port_free

    serve_cfg = report.plan.serve
    if report.disagg is None:
        if role != "all":
            raise UserError(f"--role {role} needs a P/D plan (one with a disagg section); {report.name} is not one")
        ensure_port_free(serve_cfg.host, serve_cfg.port, "serve.port")
        _serve_instance(report, report, overrides, None)
        return
    from engine.serving import deployment

    section = report.plan.disagg
    name = serve_cfg.model_name or report.name
    if role == "all":
        ensure_port_free(serve_cfg.host, serve_cfg.port, "serve.port")
        deployment.serve_deployment(report.source, name, overrides, section, serve_cfg)
    elif role == "router":
        ensure_port_free(serve_cfg.host, serve_cfg.port, "serve.port")
        deployment.serve_router_role(name, section, serve_cfg)
    else:
        from engine.plan.disagg import instance

        inst, kv_role = instance(report, role)
        if inst.plan.serve.port:
            ensure_port_free(inst.plan.serve.host, inst.plan.serve.port, f"disagg.{role}_port")
        _serve_instance(report, inst, overrides, kv_role)


def _serve_instance(report: PlanReport, inst: PlanReport, overrides: list[str], kv_role) -> None:
    """One instance: in this process for one rank, else its ranks under torchrun (each resolving `report`'s file
    and overrides, and the instance of it that `kv_role` names)."""
    if inst.world_size == 1:
        from engine.serving.hosting import serve_plan

        serve_plan(inst, kv_role)
        return
    import dataclasses

    from engine.runtime.launcher import launch

    job = ["--serve"]
    if kv_role is not None:
        job += ["--kv-role", kv_role.role]
        if inst.kv_budget_bytes is not None and inst.device == "cpu":  # every rank sizes the same cache
            key = "prefill.cache.memory" if kv_role.role == "prefill" else "cache.memory"
            overrides = [*overrides, f"{key}={inst.kv_budget_bytes}B"]
        inst = dataclasses.replace(inst, source=report.source, kv_budget_bytes=None)
    launch(inst, overrides, job)


def main(argv: list[str] | None = None) -> int:
    """Parse `PLAN [KEY=VALUE ...]`, serve, and return the exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m engine.serve_entry", description="Serve a plan's OpenAI-compatible API."
    )
    parser.add_argument("plan", help="a plan file")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="plan fields to override")
    parser.add_argument(
        "--role", choices=ROLES, default="all", help="a P/D plan: serve all of it, or one instance, or the router"
    )
    args = parser.parse_args(argv)
    try:
        serve(serving_report(args.plan, args.overrides), args.overrides, args.role)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

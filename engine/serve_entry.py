"""`python -m engine.serve_entry PLAN [KEY=VALUE ...]`: serve a plan's OpenAI-compatible API.

The engine's own entry point for serving, without the `dcpctl` command line: `dcpctl run PLAN` calls the same
functions (`launch_ranks` for its offline jobs of several ranks too), and evals starts the plans it measures through
it. Once healthy it prints
`serving NAME on http://HOST:PORT ...`; a user error prints `error: ...` and exits 1; SIGINT or SIGTERM stops every
rank, a clean stop that exits 0 whatever the number of ranks; bad arguments exit 2.
"""

from __future__ import annotations

import argparse
import signal
import sys
from typing import TYPE_CHECKING

from engine.errors import UserError
from engine.plan.resolved import ResolvedPlan

if TYPE_CHECKING:
    from engine.kv_transfer.handles import KVRole

ROLES = ("all", "prefill", "decode", "router")  # the pieces of a P/D plan `--role` may serve


def runnable_plan(plan: str, overrides: list[str]) -> ResolvedPlan:
    """The plan file checked and resolved, with its model folder present; UserError otherwise."""
    from engine.plan.checks import resolve_plan

    resolved = resolve_plan(plan, overrides)
    if resolved.missing_model:
        raise UserError(resolved.missing_model)
    return resolved


def launch_ranks(resolved: ResolvedPlan, overrides: list[str], job_args: list[str]) -> signal.Signals | None:
    """Run the plan's ranks on this node under torchrun (the job: `--serve` or `--job-file FILE`); the signal that
    stopped them early, if one did."""
    from engine.runtime.launcher import launch

    overrides = resolved.rank_overrides(overrides)
    return launch(resolved.plan.launch, resolved.local_world_size, resolved.source, overrides, job_args)


def serve(resolved: ResolvedPlan, overrides: list[str], role: str = "all") -> None:
    """Serve the plan until SIGINT/SIGTERM: in this process for one rank, else its ranks under torchrun.

    A P/D plan (`disagg` section) is served whole (`role` "all": both instances and the router), or one piece of it
    ("prefill", "decode", "router"): each instance is served as a plan of its own, with its part in the hand-off.
    """
    from engine.runtime.launcher import ensure_port_free

    serve_cfg = resolved.plan.serve
    if resolved.disagg is None:
        if role != "all":
            raise UserError(f"--role {role} needs a P/D plan (one with a disagg section); {resolved.name} is not one")
        ensure_port_free(serve_cfg.host, serve_cfg.port, "serve.port")
        _serve_instance(resolved, resolved, overrides, None)
        return
    from engine.serving import deployment

    section = resolved.plan.disagg
    name = serve_cfg.model_name or resolved.name
    if role == "all":
        ensure_port_free(serve_cfg.host, serve_cfg.port, "serve.port")
        deployment.serve_deployment(resolved.source, name, overrides, section, serve_cfg)
    elif role == "router":
        ensure_port_free(serve_cfg.host, serve_cfg.port, "serve.port")
        deployment.serve_router_role(name, section, serve_cfg)
    else:
        from engine.plan.disagg import instance

        inst, kv_role = instance(resolved, role)
        if inst.plan.serve.port:
            ensure_port_free(inst.plan.serve.host, inst.plan.serve.port, f"disagg.{role}_port")
        _serve_instance(resolved, inst, overrides, kv_role)


def _serve_instance(resolved: ResolvedPlan, inst: ResolvedPlan, overrides: list[str], kv_role: KVRole | None) -> None:
    """One instance: in this process for one rank, else its ranks under torchrun. The ranks of a P/D instance each
    resolve the P/D plan file (`resolved`) with the overrides and pick their instance (`--kv-role`). A server stops
    on SIGINT or SIGTERM: a clean stop."""
    if inst.world_size == 1:
        from engine.serving.ranks import serve_plan

        serve_plan(inst, kv_role)
        return
    if kv_role is None:
        launch_ranks(inst, overrides, ["--serve"])
        return
    from engine.runtime.launcher import launch

    prefix = "prefill." if kv_role.role == "prefill" else ""  # the prefill plan's overrides carry this prefix
    pinned = [prefix + o for o in inst.rank_overrides([])]
    job = ["--serve", "--kv-role", kv_role.role]
    launch(inst.plan.launch, inst.local_world_size, resolved.source, [*overrides, *pinned], job)


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
    from engine.serving.parent_watch import stop_without_supervisor

    stop_without_supervisor()
    try:
        serve(runnable_plan(args.plan, args.overrides), args.overrides, args.role)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

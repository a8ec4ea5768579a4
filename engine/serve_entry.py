"""`python -m engine.serve_entry PLAN [KEY=VALUE ...]`: serve a plan's OpenAI-compatible API.

The engine's own entry point for serving, without the `dcpctl` command line: `dcpctl run PLAN` calls the same
functions (`launch_ranks` for its offline jobs of several ranks too), and evals starts the plans it measures through
it. Once healthy it prints
`serving NAME on http://HOST:PORT ...`; a user error prints `error: ...` and exits 1; SIGINT stops every rank
(exit 0 for one rank, 130 when it interrupts torchrun); bad arguments exit 2.
"""

from __future__ import annotations

import argparse
import sys

from engine.errors import UserError
from engine.plan.resolved import ResolvedPlan


def runnable_plan(plan: str, overrides: list[str]) -> ResolvedPlan:
    """The plan file checked and resolved, with its model folder present; UserError otherwise."""
    from engine.llm import resolve_plan

    resolved = resolve_plan(plan, overrides)
    if resolved.missing_model:
        raise UserError(resolved.missing_model)
    return resolved


def launch_ranks(resolved: ResolvedPlan, overrides: list[str], job_args: list[str]) -> None:
    """Run the plan's ranks on this node under torchrun (the job: `--serve` or `--job-file FILE`)."""
    from engine.runtime.launcher import launch

    overrides = resolved.rank_overrides(overrides)
    launch(resolved.plan.launch, resolved.local_world_size, resolved.source, overrides, job_args)


def serve(resolved: ResolvedPlan, overrides: list[str]) -> None:
    """Serve the plan until SIGINT/SIGTERM: in this process for one rank, else its ranks under torchrun."""
    from engine.runtime.launcher import ensure_port_free

    serve_cfg = resolved.plan.serve
    ensure_port_free(serve_cfg.host, serve_cfg.port, "serve.port")
    if resolved.world_size == 1:
        from engine.serving.hosting import serve_plan

        serve_plan(resolved)
    else:
        launch_ranks(resolved, overrides, ["--serve"])


def main(argv: list[str] | None = None) -> int:
    """Parse `PLAN [KEY=VALUE ...]`, serve, and return the exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m engine.serve_entry", description="Serve a plan's OpenAI-compatible API."
    )
    parser.add_argument("plan", help="a plan file")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="plan fields to override")
    args = parser.parse_args(argv)
    try:
        serve(runnable_plan(args.plan, args.overrides), args.overrides)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`dcpctl eval gsm8k --compare PLAN_OR_URL ...`: lm-eval gsm8k on each plan's server (or endpoint), one table.

The options become evals' EvalOptions; dcpctl.eval_view runs the comparison (validation before any launch, then
evals.evaluate on each target in turn) and draws it. Exit 1 when a target failed, or with --strict when a plan's
generation diverged from the baseline's beyond a tie flip.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from dcpctl.args import split_plans_and_overrides
from dcpctl.eval_view import run_comparison
from engine.io_utils import writable_folder
from evals.evaluate import DEFAULT_NUM_CONCURRENT, EvalOptions
from evals.launch import DEFAULT_HEALTH_TIMEOUT_S
from evals.tasks import DATA_DIR_ENV, SUPPORTED_TASKS, resolve_data_dir

app = typer.Typer(help="Evaluate plans (or OpenAI-compatible endpoints) with lm-eval.", no_args_is_help=True)


@app.callback()
def _group() -> None:
    """Evaluate plans (or OpenAI-compatible endpoints) with lm-eval and compare them."""


@app.command("gsm8k")
def gsm8k(
    args: Annotated[
        list[str],
        typer.Argument(help="Plan files and/or http(s):// endpoints, then KEY=VALUE overrides for every plan."),
    ],
    compare: Annotated[
        bool, typer.Option("--compare", help="Compare the targets side by side (the first is the baseline).")
    ] = False,
    limit: Annotated[int | None, typer.Option(help="Evaluate the first N test questions.")] = None,
    num_fewshot: Annotated[int, typer.Option(help="Few-shot examples per question.")] = 5,
    fixed_fewshot: Annotated[
        bool,
        typer.Option(help="The first train examples as every question's shots (a shared prefix the cache reuses)."),
    ] = False,
    apply_chat_template: Annotated[
        bool, typer.Option(help="Send chat messages to /v1/chat/completions (the model's template).")
    ] = False,
    data_dir: Annotated[
        Path | None,
        typer.Option(help=f"Folder with GSM8K test.jsonl/train.jsonl (else ${DATA_DIR_ENV}, else the hub)."),
    ] = None,
    output: Annotated[
        Path | None, typer.Option(help="Write comparison.{json,md}, accuracy.png and per-plan samples here.")
    ] = None,
    resume: Annotated[bool, typer.Option(help="Reuse finished targets' results from --output.")] = False,
    num_concurrent: Annotated[
        int, typer.Option(help="Requests in flight at once (the engine batches them).")
    ] = DEFAULT_NUM_CONCURRENT,
    max_gen_toks: Annotated[int, typer.Option(help="Most tokens generated per question.")] = 256,
    task: Annotated[str, typer.Option(help=f"lm-eval task: {', '.join(SUPPORTED_TASKS)}.")] = "gsm8k",
    health_timeout: Annotated[
        float, typer.Option(help="Seconds to wait for a launched server's /health.")
    ] = DEFAULT_HEALTH_TIMEOUT_S,
    strict: Annotated[
        bool, typer.Option(help="Exit 1 when a plan's generation diverges from the baseline's beyond a tie flip.")
    ] = False,
    verbose: Annotated[
        bool, typer.Option(help="Show lm-eval's logs and progress bars (else they go to run.log in --output).")
    ] = False,
) -> None:
    """Run lm-eval gsm8k on each plan (launched in turn) or endpoint, and print one comparison table."""
    del compare  # the targets are always compared; the flag reads well on the command line
    specs, overrides = split_plans_and_overrides(args)
    if output is not None:
        writable_folder(output, "--output")
    if num_concurrent < 1:
        raise typer.BadParameter("--num-concurrent must be at least 1")
    opts = EvalOptions(
        task=task,
        data_dir=resolve_data_dir(data_dir),
        limit=limit,
        num_fewshot=num_fewshot,
        fixed_fewshot=fixed_fewshot,
        apply_chat_template=apply_chat_template,
        num_concurrent=num_concurrent,
        max_gen_toks=max_gen_toks,
        health_timeout_s=health_timeout,
    )
    cmp, results = run_comparison(specs, overrides, opts, output=output, resume=resume, verbose=verbose)
    failed = [r.target.label for r in results if r.run.failed]
    errors = Console(stderr=True)
    if failed:
        errors.print(
            f"[bold red]error:[/] {len(failed)} of {len(results)} target(s) failed: {', '.join(failed)} "
            "(reasons in the table caption)",
            highlight=False,
        )
    diverged = {c.label: len(c.unexplained) for c in cmp.columns[1:] if c.unexplained}
    if strict and diverged:
        per = ", ".join(f"{label}: {n}" for label, n in diverged.items())
        errors.print(
            f"[bold red]error:[/] unexplained divergences from the baseline ({per}); --strict fails on them",
            highlight=False,
        )
    if failed or (strict and diverged):
        raise typer.Exit(1)

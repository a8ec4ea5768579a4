"""The gsm8k comparison as `dcpctl eval` and `dcpctl demo` show it: the plans' validation, the task, a progress
line per target while evals runs them, then the comparison table, the launch times and where the report went."""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

from rich.console import Console

from dcpctl.render import ProgressFeed, checked_targets, make_console
from engine.errors import UserError
from evals.compare import Comparison, compare_runs
from evals.evaluate import EvalOptions, TargetEval, evaluate_targets
from evals.lifecycle import ServerHook
from evals.report import render_table, write_report
from evals.tasks import prepare_task


def _quiet_libraries(verbose: bool) -> None:
    """Keep lm-eval's and datasets' logs and tqdm bars out of the rich output unless --verbose."""
    if verbose:
        return
    # tqdm reads TQDM_* when it is imported (lm-eval imports it lazily, after this).
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    for name in ("lm_eval", "lm-eval", "datasets", "httpx", "urllib3"):
        logging.getLogger(name).setLevel(logging.ERROR)


def run_comparison(
    specs: list[str],
    overrides: list[str],
    opts: EvalOptions,
    *,
    output: Path | None = None,
    resume: bool = False,
    console: Console | None = None,
    on_server: ServerHook | None = None,
    verbose: bool = False,
) -> tuple[Comparison, list[TargetEval]]:
    """Validate all targets, evaluate each (or reuse it with `resume`), print the table, write the report."""
    console = console or make_console()
    if resume and output is None:
        raise UserError("--resume needs --output DIR (the folder of an earlier run's results)")
    opts.check()
    _quiet_libraries(verbose)
    targets = checked_targets(specs, overrides, console)
    results: list[TargetEval] = []
    with tempfile.TemporaryDirectory(prefix="dcpctl-eval-") as tmp:
        task = prepare_task(opts.task, opts.data_dir, Path(tmp) / "task")
        console.print(f"[bold]task[/] {task.name} on {task.display_name}", highlight=False)
        if task.synthetic:
            console.print("[bold yellow]SYNTHETIC data (not GSM8K): accuracies say nothing about GSM8K[/]")
        try:
            with ProgressFeed(console) as feed:
                evaluate_targets(
                    targets,
                    overrides,
                    task,
                    opts,
                    out_root=output if output is not None else Path(tmp) / "out",
                    keep_files=output is not None,
                    resume=resume,
                    feed=feed,
                    results=results,
                    on_server=on_server,
                )
        finally:
            # Also on Ctrl-C or an unexpected error: what finished is reported and kept.
            if results and output is not None:
                write_report(compare_runs([r.run for r in results]), output)
        cmp = compare_runs([r.run for r in results])
        console.print(render_table(cmp))
        _print_launches(console, results)
        if output is not None:
            console.print(f"report: {output / 'comparison.md'} (also comparison.json, accuracy.png, per-plan samples)")
    return cmp, results


def _print_launches(console: Console, results: list[TargetEval]) -> None:
    for r in results:
        if r.reused:
            console.print(f"{r.target.label}: reused saved results", highlight=False)
            continue
        tth = r.launch.get("time_to_healthy_s")
        if tth is not None:
            total = r.launch.get("total_s")
            console.print(
                f"{r.target.label}: healthy {tth:.1f} s after launch"
                + (f", {total:.1f} s in all (launch + eval + stop)" if total is not None else ""),
                highlight=False,
            )

"""The gsm8k comparison as `dcpctl eval` and `dcpctl demo` show it: the plans' validation, the task, a progress
line per target while evals runs them, then the comparison table, every unexplained divergence, the launch times and
where the report went. lm-eval's own logging and bars go to the run's log (`run.log` in the output) unless verbose."""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from dcpctl.render import ProgressFeed, checked_targets, make_console
from engine.errors import UserError
from evals.compare import Comparison, compare_runs
from evals.evaluate import EvalOptions, TargetEval, evaluate_targets
from evals.lifecycle import ServerHook
from evals.report import render_table, write_report
from evals.runlog import RUN_LOG, library_output_to
from evals.tasks import prepare_task


def library_output(log_path: Path, verbose: bool) -> contextlib.AbstractContextManager[None]:
    """The libraries' logging and bars into `log_path`, or left alone (on the terminal) when `verbose`."""
    return contextlib.nullcontext() if verbose else library_output_to(log_path)


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
    targets = checked_targets(specs, overrides, console)
    results: list[TargetEval] = []
    with tempfile.TemporaryDirectory(prefix="dcpctl-eval-") as tmp:
        log_path = (output if output is not None else Path(tmp)) / RUN_LOG
        with library_output(log_path, verbose):
            task = prepare_task(
                opts.task,
                opts.data_dir,
                Path(tmp) / "task",
                fixed_fewshot=opts.fixed_fewshot,
                num_fewshot=opts.num_fewshot,
            )
        console.print(f"[bold]task[/] {task.name} on {task.display_name}", highlight=False)
        if task.synthetic:
            console.print("[bold yellow]SYNTHETIC data (not GSM8K): accuracies say nothing about GSM8K[/]")
        try:
            with ProgressFeed(console, redirect=verbose) as feed, library_output(log_path, verbose):
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
        _print_unexplained(console, cmp)
        _print_launches(console, results)
        if output is not None:
            logged = f"; lm-eval's log: {log_path}" if log_path.is_file() else ""
            console.print(
                f"report: {output / 'comparison.md'} (also comparison.json, accuracy.png, per-plan samples{logged})"
            )
    return cmp, results


def _print_unexplained(console: Console, cmp: Comparison) -> None:
    """Every divergence that numerical noise does not explain, one line each, in red."""
    for col in cmp.columns[1:]:
        for d in col.unexplained:
            v = d.divergence
            at = (
                f"token {v.position}: {v.baseline_piece!r} -> {v.plan_piece!r}, "
                if v.position is not None and v.baseline_token is not None
                else ""
            )
            console.print(
                f"[bold red]unexplained divergence[/] {escape(col.label)} vs {escape(cmp.baseline.label)}, "
                f"doc {d.doc_id}: {escape(at + v.reason)}",
                highlight=False,
            )


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

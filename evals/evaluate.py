"""lm-eval on each target in turn: launch (plans), evaluate, stop; a target that fails (never healthy, engine
crash mid-eval) becomes a failed EvalRun with its reason and the others still run. With `resume`, a target whose
saved run matches today's settings exactly is reused instead (`eval_run.json` in its folder).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import UserError
from engine.io_utils import atomic_write_text
from engine.plan.loader import plan_to_dict
from evals.endpoint import StatsWatch
from evals.launch import DEFAULT_HEALTH_TIMEOUT_S
from evals.lifecycle import Feed, Served, ServerHook, Status, measure_target
from evals.results import EvalRun
from evals.targets import Target
from evals.tasks import TaskSpec

DEFAULT_NUM_CONCURRENT = 16
RUN_FILE = "eval_run.json"  # per target: settings fingerprint + the EvalRun with samples + launch facts


@dataclass
class EvalOptions:
    """What every target is evaluated with."""

    task: str = "gsm8k"
    data_dir: Path | None = None
    limit: int | None = None
    num_fewshot: int = 5
    apply_chat_template: bool = False
    num_concurrent: int = DEFAULT_NUM_CONCURRENT
    max_gen_toks: int = 256
    health_timeout_s: float = DEFAULT_HEALTH_TIMEOUT_S

    def check(self) -> None:
        """UserError for a value no eval can use."""
        if self.limit is not None and self.limit < 1:
            raise UserError(f"--limit must be at least 1 (got {self.limit})")

    @property
    def questions(self) -> str:
        return f"{self.limit} questions" if self.limit else "all questions"


@dataclass
class TargetEval:
    """A target's EvalRun plus how it was obtained (launch facts, reuse)."""

    target: Target
    run: EvalRun
    launch: dict[str, Any] = field(default_factory=dict)
    reused: bool = False


# --- resume -------------------------------------------------------------------------------------------------


def fingerprint(target: Target, overrides: list[str], task: TaskSpec, opts: EvalOptions) -> dict[str, Any]:
    """Everything that decides a target's results; --resume reuses a saved run only when it matches exactly."""
    fp: dict[str, Any] = {
        "task": task.name,
        "data_dir": str(task.data_dir) if task.data_dir else None,
        "limit": opts.limit,
        "num_fewshot": opts.num_fewshot,
        "apply_chat_template": opts.apply_chat_template,
        "max_gen_toks": opts.max_gen_toks,
    }
    if target.report is None:
        fp["url"] = target.spec
    else:
        plan = plan_to_dict(target.report.plan)
        plan.get("serve", {}).pop("port", None)  # every launch picks a free port
        fp["plan"] = plan
        fp["overrides"] = list(overrides)
    return json.loads(json.dumps(fp, default=str))


def load_saved(plan_dir: Path, fp: dict[str, Any]) -> TargetEval | None:
    """A finished, successful run saved under plan_dir with the same fingerprint, else None."""
    path = plan_dir / RUN_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        if data.get("settings") != fp:
            return None
        run = EvalRun.from_dict(data["run"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if run.failed or not run.samples:
        return None
    return TargetEval(target=Target(spec="", label=run.label), run=run, launch=data.get("launch", {}), reused=True)


def save_result(plan_dir: Path, fp: dict[str, Any], result: TargetEval) -> None:
    """Write the target's run (with samples) and launch facts at once, so finished targets survive a crash."""
    data = {"settings": fp, "launch": result.launch, "run": result.run.to_dict(with_samples=True)}
    atomic_write_text(plan_dir / RUN_FILE, json.dumps(data, indent=2, default=str) + "\n")


# --- one target ---------------------------------------------------------------------------------------------


def _failure(label: str, reason: str, task: TaskSpec, opts: EvalOptions) -> EvalRun:
    return EvalRun.failure(
        label,
        reason,
        task=task.name,
        dataset=task.display_name,
        n_shot=opts.num_fewshot,
        mode="chat" if opts.apply_chat_template else "completions",
    )


def _run_lm_eval(
    served: Served, label: str, task: TaskSpec, opts: EvalOptions, raw_dir: Path | None, status: Status
) -> EvalRun:
    """lm-eval on the server, its engine stats (when it has them) shown in the status line meanwhile."""
    from evals.lm_eval_runner import run_gsm8k

    healthy = served.time_to_healthy_s
    prefix = f"healthy in {healthy:.1f} s; evaluating" if healthy is not None else "evaluating"
    prefix = f"{prefix} {opts.questions}"

    def show(st: dict[str, Any]) -> None:
        status(
            f"{prefix}: {st.get('generated_tokens')} tokens generated, "
            f"{st.get('running')} running, {st.get('waiting')} waiting"
        )

    status(prefix)
    with StatsWatch(served.base_url, show):
        return run_gsm8k(
            served.base_url,
            None,
            task,
            label=label,
            limit=opts.limit,
            num_fewshot=opts.num_fewshot,
            apply_chat_template=opts.apply_chat_template,
            num_concurrent=opts.num_concurrent,
            max_gen_toks=opts.max_gen_toks,
            output_dir=raw_dir,
        )


def evaluate_target(
    target: Target,
    overrides: list[str],
    task: TaskSpec,
    opts: EvalOptions,
    *,
    plan_dir: Path,
    keep_files: bool,
    status: Status = lambda _msg: None,
    on_server: ServerHook | None = None,
) -> TargetEval:
    """Launch (plans), evaluate and stop; any failure comes back as a failed EvalRun with the reason."""
    raw_dir = plan_dir / "lm_eval" if keep_files else None
    outcome = measure_target(
        target,
        overrides,
        lambda served: _run_lm_eval(served, target.label, task, opts, raw_dir, status),
        activity="eval",
        log_path=plan_dir / "server.log",
        keep_log=keep_files,
        health_timeout_s=opts.health_timeout_s,
        status=status,
        on_server=on_server,
    )
    run = outcome.value
    if run is None:
        run = _failure(target.label, outcome.error or "", task, opts)
    return TargetEval(target=target, run=run, launch=outcome.launch)


# --- every target -------------------------------------------------------------------------------------------


def evaluate_targets(
    targets: list[Target],
    overrides: list[str],
    task: TaskSpec,
    opts: EvalOptions,
    *,
    out_root: Path,
    keep_files: bool,
    resume: bool,
    feed: Feed,
    results: list[TargetEval],
    on_server: ServerHook | None = None,
) -> None:
    """Evaluate (or, with `resume`, reuse) each target in turn, appending to `results` as each finishes (so that
    what finished is there even when a later target is interrupted); saves each run when `keep_files`."""
    for target in targets:
        plan_dir = out_root / target.dir_name
        fp = fingerprint(target, overrides, task, opts)
        progress = feed.target(target.label, total=1)
        saved = load_saved(plan_dir, fp) if resume else None
        if saved is not None:
            saved.target = target
            saved.run.label = target.label
            results.append(saved)
            progress.finish(f"reused from {plan_dir / RUN_FILE}")
            continue
        t0 = time.perf_counter()
        progress.status(f"starting ({opts.questions}, {opts.num_fewshot}-shot)")
        result = evaluate_target(
            target,
            overrides,
            task,
            opts,
            plan_dir=plan_dir,
            keep_files=keep_files,
            status=progress.status,
            on_server=on_server,
        )
        result.launch["total_s"] = round(time.perf_counter() - t0, 2)
        results.append(result)
        if keep_files:
            save_result(plan_dir, fp, result)
        run = result.run
        if run.failed:
            progress.finish(run.error or "", failed=True)
        else:
            acc = ", ".join(f"{f} {m.value:.3f}" for f, m in run.metrics.items())
            progress.finish(f"done, {len(run.samples)} questions ({acc})")

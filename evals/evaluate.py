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

from engine.core.speculative import SpecCounters
from engine.errors import UserError
from engine.io_utils import atomic_write_text
from engine.plan.loader import plan_to_dict
from evals.endpoint import StatsWatch, engine_stats
from evals.launch import DEFAULT_HEALTH_TIMEOUT_S, check_health_timeout
from evals.lifecycle import Feed, QuietFeed, Served, ServerHook, TargetFeed, measure_target
from evals.results import EvalRun
from evals.targets import Target
from evals.tasks import TaskSpec
from evals.traces import TOP_LOGPROBS

DEFAULT_NUM_CONCURRENT = 16
RUN_FILE = "eval_run.json"  # per target: settings fingerprint + the EvalRun with samples + launch facts


@dataclass
class EvalOptions:
    """What every target is evaluated with."""

    task: str = "gsm8k"
    data_dir: Path | None = None
    limit: int | None = None
    num_fewshot: int = 5
    fixed_fewshot: bool = False  # the same shots for every question (see evals.tasks.gsm8k_task)
    apply_chat_template: bool = False
    num_concurrent: int = DEFAULT_NUM_CONCURRENT
    max_gen_toks: int = 256
    health_timeout_s: float = DEFAULT_HEALTH_TIMEOUT_S

    def check(self) -> None:
        """UserError for a value no eval can use."""
        if self.limit is not None and self.limit < 1:
            raise UserError(f"--limit must be at least 1 (got {self.limit})")
        if self.max_gen_toks < 1:
            raise UserError(f"--max-gen-toks must be at least 1 (got {self.max_gen_toks})")
        if self.num_fewshot < 0:
            raise UserError(f"--num-fewshot must be 0 or more (got {self.num_fewshot})")
        check_health_timeout(self.health_timeout_s)

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
        "fixed_fewshot": opts.fixed_fewshot,
        "apply_chat_template": opts.apply_chat_template,
        "max_gen_toks": opts.max_gen_toks,
        "token_traces": TOP_LOGPROBS,  # runs saved without traces can't explain their disagreements
    }
    if target.resolved is None:
        fp["url"] = target.spec
    else:
        plan = plan_to_dict(target.resolved.plan)
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


class _EvalProgress:
    """A target's progress while lm-eval runs: questions answered (from the responses) and generated tokens per
    second (from the engine's stats while it has them, else from the responses' usage)."""

    def __init__(self, feed: TargetFeed, base_url: str) -> None:
        self.feed = feed
        self.t0 = time.perf_counter()
        self.done = self.asked = 0
        self.tokens0 = engine_stats(base_url).get("generated_tokens")
        self.live = False  # the engine's stats drive the rate

    def answer(self, done: int, asked: int, generated_tokens: int) -> None:
        if asked != self.asked:
            self.asked = asked
            self.feed.expect(asked)
        for _ in range(done - self.done):
            self.feed.advance()
        self.done = done
        if not self.live and generated_tokens:
            self.feed.throughput(generated_tokens / (time.perf_counter() - self.t0))

    def stats(self, st: dict[str, Any]) -> None:
        tokens = st.get("generated_tokens")
        if isinstance(tokens, int) and isinstance(self.tokens0, int):
            self.live = True
            self.feed.throughput((tokens - self.tokens0) / (time.perf_counter() - self.t0))


def _run_lm_eval(
    served: Served, label: str, task: TaskSpec, opts: EvalOptions, raw_dir: Path | None, feed: TargetFeed
) -> EvalRun:
    """lm-eval on the server; its answers and engine stats feed the target's progress meanwhile, and the engine's
    speculative counters before and after give the run's acceptance."""
    from evals.lm_eval_runner import run_gsm8k

    healthy = served.time_to_healthy_s
    prefix = f"healthy in {healthy:.1f} s; evaluating" if healthy is not None else "evaluating"
    feed.status(f"{prefix} {opts.questions}")
    progress = _EvalProgress(feed, served.base_url)
    before = engine_stats(served.base_url).get("speculative")
    with StatsWatch(served.base_url, progress.stats):
        run = run_gsm8k(
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
            on_answer=progress.answer,
        )
    after = engine_stats(served.base_url).get("speculative")
    if after is not None:  # the counters move only for this eval's requests: it is the server's one client
        run.speculation = SpecCounters.since(before, after)
    return run


def evaluate_target(
    target: Target,
    overrides: list[str],
    task: TaskSpec,
    opts: EvalOptions,
    *,
    plan_dir: Path,
    keep_files: bool,
    feed: TargetFeed | None = None,
    on_server: ServerHook | None = None,
) -> TargetEval:
    """Launch (plans), evaluate and stop; any failure comes back as a failed EvalRun with the reason."""
    feed = feed or QuietFeed()
    raw_dir = plan_dir / "lm_eval" if keep_files else None
    outcome = measure_target(
        target,
        overrides,
        lambda served: _run_lm_eval(served, target.label, task, opts, raw_dir, feed),
        activity="eval",
        log_path=plan_dir / "server.log",
        keep_log=keep_files,
        health_timeout_s=opts.health_timeout_s,
        status=feed.status,
        on_server=on_server,
    )
    run = outcome.value
    if run is None:
        run = _failure(target.label, outcome.error or "", task, opts)
    run.dtype = target.resolved.dtype if target.resolved is not None else None
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
        progress = feed.target(target.label, total=opts.limit or 0)
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
            feed=progress,
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

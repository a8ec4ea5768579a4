"""`dcpctl eval gsm8k --compare PLAN_OR_URL ...`: lm-eval gsm8k on each plan's server (or endpoint), one table.

Every plan is validated and every URL checked before anything launches. Then, one target at a time: launch the
plan's server (evals.launch), wait for health, run lm-eval (evals.lm_eval_runner), shut it down. A target that
fails (server never healthy, engine crash mid-eval) becomes a FAILED column and the others still run.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.text import Text

from dcpctl.args import split_plans_and_overrides
from engine.errors import UserError
from engine.io_utils import atomic_write_text
from engine.plan.checks import PlanReport, validate_plan_file
from evals.compare import Comparison, compare_runs
from evals.launch import DEFAULT_HEALTH_TIMEOUT_S, PlanServer
from evals.report import plan_dir_names, render_table, write_report
from evals.results import EvalRun, SampleResult
from evals.tasks import SUPPORTED_TASKS, TaskSpec, gsm8k_task

app = typer.Typer(help="Evaluate plans (or OpenAI-compatible endpoints) with lm-eval.", no_args_is_help=True)


@app.callback()
def _group() -> None:
    """Evaluate plans (or OpenAI-compatible endpoints) with lm-eval and compare them."""


DATA_DIR_ENV = "DCPCTL_GSM8K_DIR"
DEFAULT_NUM_CONCURRENT = 16
RUN_FILE = "eval_run.json"  # per target: settings fingerprint + the EvalRun with samples + launch facts
_URL_PREFIXES = ("http://", "https://")


def is_url(spec: str) -> bool:
    """A target given as an endpoint rather than a plan file."""
    return spec.startswith(_URL_PREFIXES)


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


@dataclass
class Target:
    """One column of the comparison: a plan file (validated) or a URL."""

    spec: str
    label: str
    report: PlanReport | None = None
    dir_name: str = ""

    @property
    def is_url(self) -> bool:
        return self.report is None


@dataclass
class TargetResult:
    """A target's EvalRun plus how it was obtained (launch timing, reuse)."""

    target: Target
    run: EvalRun
    launch: dict[str, Any] = field(default_factory=dict)
    reused: bool = False


def make_console() -> Console:
    """A console for comparison output; wide when not a terminal (rich would squeeze the table to 80 columns)."""
    console = Console()
    return console if console.is_terminal else Console(width=200)


# --- data and task -------------------------------------------------------------------------------------------


def resolve_data_dir(option: Path | None) -> Path | None:
    """--data-dir, else $DCPCTL_GSM8K_DIR, else None (lm-eval's hub task)."""
    if option is not None:
        return option
    env = os.environ.get(DATA_DIR_ENV, "").strip()
    return Path(env) if env else None


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """False when HF offline mode is set or huggingface.co:443 does not accept a connection within timeout_s."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return False
    try:
        with socket.create_connection(("huggingface.co", 443), timeout=timeout_s):
            return True
    except OSError:
        return False


def _quiet_libraries(verbose: bool) -> None:
    """Keep lm-eval's and datasets' logs and tqdm bars out of the rich output unless --verbose."""
    if verbose:
        return
    # tqdm reads TQDM_* when it is imported (lm-eval imports it lazily, after this).
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    for name in ("lm_eval", "lm-eval", "datasets", "httpx", "urllib3"):
        logging.getLogger(name).setLevel(logging.ERROR)


def prepare_task(opts: EvalOptions, work_dir: Path) -> TaskSpec:
    """The lm-eval task spec, with its dataset loaded once so that data problems surface before any launch."""
    spec = gsm8k_task(opts.data_dir, work_dir, name=opts.task)
    if spec.data_dir is None and not hub_reachable():
        offline = any(os.environ.get(v) for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
        if not offline:
            raise UserError(
                f"no --data-dir (or ${DATA_DIR_ENV}) and huggingface.co is unreachable, so lm-eval's {opts.task} "
                "data can't be fetched; pass --data-dir DIR with GSM8K test.jsonl/train.jsonl "
                "(or set HF_DATASETS_OFFLINE=1 to use a cached copy)"
            )
    try:
        spec.task_manager().load([spec.name])
    except Exception as exc:  # datasets / lm-eval raise many kinds; the message is what matters
        where = spec.data_dir or "the Hugging Face hub"
        raise UserError(
            f"lm-eval could not load task {spec.name} from {where} ({type(exc).__name__}: {str(exc)[:300]}); "
            "check --data-dir"
        ) from None
    return spec


# --- targets ------------------------------------------------------------------------------------------------


def _unique(labels: list[str]) -> list[str]:
    out: list[str] = []
    for label in labels:
        name, k = label, 2
        while name in out:
            name, k = f"{label} ({k})", k + 1
        out.append(name)
    return out


def resolve_targets(specs: list[str], overrides: list[str], console: Console) -> list[Target]:
    """Validate every plan and check every URL; print all problems and raise UserError if there are any."""
    from evals.lm_eval_runner import check_server, normalize_base_url

    targets: list[Target] = []
    problems: list[str] = []
    reports: list[PlanReport] = []
    for spec in specs:
        if is_url(spec):
            try:
                root = normalize_base_url(spec)
                check_server(root)
            except UserError as exc:
                problems.append(f"{spec}: {exc}")
                root = spec
            targets.append(Target(spec=root, label=root))
            continue
        report = validate_plan_file(spec, overrides)
        reports.append(report)
        if report.valid and report.model is None:
            pull = report.plan.model.path
            problems.append(
                f"plan {report.name}: model folder {report.model_path} not found "
                f"(run `dcpctl model pull {pull}` or fix model.path)"
            )
        problems += [f"plan {report.name}: {e}" for e in report.errors]
        targets.append(Target(spec=spec, label=report.name, report=report))
    if reports:
        from dcpctl.plan_cmd import render_validation

        render_validation(console, reports)
    if problems:
        for p in problems:
            console.print(Text.assemble(("error ", "bold red"), p))
        raise UserError(
            f"{len(problems)} problem(s) in the targets above; fix them (nothing was launched, no eval was run)"
        )
    for t, label, name in zip(
        targets, _unique([t.label for t in targets]), plan_dir_names([t.label for t in targets]), strict=True
    ):
        t.label, t.dir_name = label, name
    return targets


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
        from engine.plan.loader import plan_to_dict

        plan = plan_to_dict(target.report.plan)
        plan.get("serve", {}).pop("port", None)  # every launch picks a free port
        fp["plan"] = plan
        fp["overrides"] = list(overrides)
    return json.loads(json.dumps(fp, default=str))


def _samples_from_dicts(rows: list[dict[str, Any]]) -> list[SampleResult]:
    return [SampleResult(**{k: v for k, v in r.items() if k != "gold"}) for r in rows]


def load_saved(plan_dir: Path, fp: dict[str, Any]) -> TargetResult | None:
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
    return TargetResult(target=Target(spec="", label=run.label), run=run, launch=data.get("launch", {}), reused=True)


def save_result(plan_dir: Path, fp: dict[str, Any], result: TargetResult) -> None:
    """Write the target's run (with samples) and launch facts at once, so finished targets survive a crash."""
    data = {"settings": fp, "launch": result.launch, "run": result.run.to_dict(with_samples=True)}
    atomic_write_text(plan_dir / RUN_FILE, json.dumps(data, indent=2, default=str) + "\n")


# --- one target ---------------------------------------------------------------------------------------------

ServerHook = Callable[[PlanServer], None]


class _StatsWatch:
    """While lm-eval runs, poll the server's GET /v1/engine/stats (if it has one) into the status line."""

    def __init__(self, base_url: str, prefix: str, status: Callable[[str], None], period_s: float = 1.0) -> None:
        self.url, self.prefix, self.status, self.period_s = f"{base_url}/v1/engine/stats", prefix, status, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dcpctl-eval-stats", daemon=True)

    def _run(self) -> None:
        import httpx

        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while not self._stop.wait(self.period_s):
                try:
                    resp = client.get(self.url)
                except httpx.HTTPError:
                    continue
                if resp.status_code == 404:
                    return  # not a dcpctl server (vLLM, ...): nothing to show
                try:
                    st = resp.json()
                    self.status(
                        f"{self.prefix}: {st['generated_tokens']} tokens generated, "
                        f"{st['running']} running, {st['waiting']} waiting"
                    )
                except (ValueError, KeyError, TypeError):
                    return

    def __enter__(self) -> _StatsWatch:
        self.status(self.prefix)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def _eval_on(
    base_url: str,
    label: str,
    task: TaskSpec,
    opts: EvalOptions,
    raw_dir: Path | None,
    status: Callable[[str], None],
    prefix: str = "evaluating",
) -> EvalRun:
    from evals.lm_eval_runner import run_gsm8k

    n = f"{opts.limit} questions" if opts.limit else "all questions"
    with _StatsWatch(base_url, f"{prefix} {n}", status):
        return run_gsm8k(
            base_url,
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


def _failure(label: str, reason: str, task: TaskSpec, opts: EvalOptions) -> EvalRun:
    return EvalRun.failure(
        label,
        reason,
        task=task.name,
        dataset=task.display_name,
        n_shot=opts.num_fewshot,
        mode="chat" if opts.apply_chat_template else "completions",
    )


def evaluate_target(
    target: Target,
    overrides: list[str],
    task: TaskSpec,
    opts: EvalOptions,
    *,
    plan_dir: Path,
    keep_files: bool,
    status: Callable[[str], None] = lambda _msg: None,
    on_server: ServerHook | None = None,
) -> TargetResult:
    """Launch (plans), evaluate and stop; any failure comes back as a failed EvalRun with the reason."""
    raw_dir = plan_dir / "lm_eval" if keep_files else None
    if target.report is None:
        try:
            run = _eval_on(target.spec, target.label, task, opts, raw_dir, status)
        except Exception as exc:
            run = _failure(target.label, _reason(exc), task, opts)
        return TargetResult(target=target, run=run, launch={"url": target.spec})

    serve = target.report.plan.serve
    server = PlanServer(
        target.spec,
        overrides,
        host=serve.host,
        health_timeout_s=opts.health_timeout_s,
        log_path=plan_dir / "server.log",
        label=target.label,
    )
    launch: dict[str, Any] = {"command": server.command, "port": server.port}
    if keep_files:
        launch["log"] = str(server.log_path)
    status(f"launching (world size {target.report.world_size})")
    try:
        server.start()
        try:
            launch["time_to_healthy_s"] = round(server.wait_healthy(), 2)
        except UserError as exc:
            return TargetResult(target=target, run=_failure(target.label, str(exc), task, opts), launch=launch)
        if on_server is not None:
            on_server(server)
        try:
            healthy = f"healthy in {launch['time_to_healthy_s']:.1f} s; evaluating"
            run = _eval_on(server.base_url, target.label, task, opts, raw_dir, status, healthy)
        except Exception as exc:
            run = _failure(target.label, _crash_reason(server) or _reason(exc), task, opts)
        else:
            crashed = server.exit_reason()
            if crashed:  # lm-eval finished, but the server died on the way: don't trust the column
                run = _failure(target.label, f"the server {crashed} during the eval", task, opts)
    finally:
        status("stopping the server")
        launch["exit_code"] = server.stop()
    return TargetResult(target=target, run=run, launch=launch)


def _crash_reason(server: PlanServer, wait_s: float = 15.0) -> str | None:
    """After lm-eval failed: why, if the server is to blame (it exited, or stopped answering /health)."""
    deadline = time.monotonic() + wait_s
    while server.alive() and time.monotonic() < deadline:
        if server.healthy():
            return None  # still serving: the failure was the request's own
        time.sleep(0.2)
    crashed = server.exit_reason()
    if crashed:
        return f"the server {crashed} during the eval"
    return f"the server stopped answering /health during the eval (for {wait_s:.0f} s)"


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return text if isinstance(exc, UserError) else f"{type(exc).__name__}: {text}"


# --- the comparison -----------------------------------------------------------------------------------------


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
) -> tuple[Comparison, list[TargetResult]]:
    """Validate all targets, evaluate each (or reuse it with `resume`), print the table, write the report."""
    console = console or make_console()
    if resume and output is None:
        raise UserError("--resume needs --output DIR (the folder of an earlier run's results)")
    if opts.limit is not None and opts.limit < 1:
        raise UserError(f"--limit must be at least 1 (got {opts.limit})")
    _quiet_libraries(verbose)
    targets = resolve_targets(specs, overrides, console)
    results: list[TargetResult] = []
    with tempfile.TemporaryDirectory(prefix="dcpctl-eval-") as tmp:
        task = prepare_task(opts, Path(tmp) / "task")
        console.print(f"[bold]task[/] {task.name} on {task.display_name}", highlight=False)
        if task.synthetic:
            console.print("[bold yellow]SYNTHETIC data (not GSM8K): accuracies say nothing about GSM8K[/]")
        out_root = output if output is not None else Path(tmp) / "out"
        try:
            _run_targets(
                targets, overrides, task, opts, out_root, output is not None, resume, console, on_server, results
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


def _run_targets(
    targets: list[Target],
    overrides: list[str],
    task: TaskSpec,
    opts: EvalOptions,
    out_root: Path,
    keep_files: bool,
    resume: bool,
    console: Console,
    on_server: ServerHook | None,
    results: list[TargetResult],
) -> None:
    n = f"{opts.limit} questions" if opts.limit else "all questions"
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        for target in targets:
            plan_dir = out_root / target.dir_name
            fp = fingerprint(target, overrides, task, opts)
            bar = progress.add_task(f"{target.label}: waiting", total=1)

            def status(msg: str, bar: Any = bar, label: str = target.label) -> None:
                progress.update(bar, description=escape(f"{label}: {msg}"))

            saved = load_saved(plan_dir, fp) if resume else None
            if saved is not None:
                saved.target = target
                saved.run.label = target.label
                results.append(saved)
                progress.update(
                    bar, completed=1, description=escape(f"{target.label}: reused from {plan_dir / RUN_FILE}")
                )
                continue
            t0 = time.perf_counter()
            status(f"starting ({n}, {opts.num_fewshot}-shot)")
            result = evaluate_target(
                target,
                overrides,
                task,
                opts,
                plan_dir=plan_dir,
                keep_files=keep_files,
                status=status,
                on_server=on_server,
            )
            result.launch["total_s"] = round(time.perf_counter() - t0, 2)
            results.append(result)
            if keep_files:
                save_result(plan_dir, fp, result)
            run = result.run
            if run.failed:
                progress.update(
                    bar, completed=1, description=f"[red]{escape(target.label)}: FAILED[/] — {escape(run.error or '')}"
                )
            else:
                acc = ", ".join(f"{f} {m.value:.3f}" for f, m in run.metrics.items())
                progress.update(
                    bar, completed=1, description=escape(f"{target.label}: done, {len(run.samples)} questions ({acc})")
                )


def _print_launches(console: Console, results: list[TargetResult]) -> None:
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


# --- the command --------------------------------------------------------------------------------------------


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
    verbose: Annotated[bool, typer.Option(help="Show lm-eval's logs and progress bars.")] = False,
) -> None:
    """Run lm-eval gsm8k on each plan (launched in turn) or endpoint, and print one comparison table."""
    del compare  # the targets are always compared; the flag reads well on the command line
    specs, overrides = split_plans_and_overrides(args)
    if num_concurrent < 1:
        raise typer.BadParameter("--num-concurrent must be at least 1")
    if max_gen_toks < 1:
        raise typer.BadParameter("--max-gen-toks must be at least 1")
    opts = EvalOptions(
        task=task,
        data_dir=resolve_data_dir(data_dir),
        limit=limit,
        num_fewshot=num_fewshot,
        apply_chat_template=apply_chat_template,
        num_concurrent=num_concurrent,
        max_gen_toks=max_gen_toks,
        health_timeout_s=health_timeout,
    )
    _, results = run_comparison(specs, overrides, opts, output=output, resume=resume, verbose=verbose)
    failed = [r.target.label for r in results if r.run.failed]
    if failed:
        Console(stderr=True).print(
            f"[bold red]error:[/] {len(failed)} of {len(results)} target(s) failed: {', '.join(failed)} "
            "(reasons in the table caption)",
            highlight=False,
        )
        raise typer.Exit(1)

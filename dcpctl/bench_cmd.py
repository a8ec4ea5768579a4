"""`dcpctl bench PLAN_OR_URL ...`: one fixed workload through the HTTP API of each plan (launched in turn) or
endpoint, optionally HF transformers in-process as a reference column; one table, JSON/Markdown/PNG reports.

Every plan is validated and every URL checked before anything launches (as `dcpctl eval` does). Then, per plan:
launch its server (evals.launch.PlanServer), wait for health, send the warm-up requests, measure, read
/v1/engine/stats, stop. A target that fails (never healthy, crashed, every request failed) becomes a FAILED
column and the others still run.
"""

from __future__ import annotations

import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from dcpctl.args import split_plans_and_overrides
from dcpctl.eval_cmd import Target, make_console, resolve_targets
from engine.errors import UserError
from engine.model_info import weight_elements
from evals.bench.client import RequestRecord, RunResult, run_requests
from evals.bench.metrics import compute_metrics
from evals.bench.report import BenchReport, TargetResult, caption_lines, render_table, roofline_lines, write_report
from evals.bench.roofline import copy_bandwidth_subprocess, decode_roofline
from evals.bench.workload import Workload, build_workload, load_tokenizer
from evals.launch import DEFAULT_HEALTH_TIMEOUT_S, PlanServer

DEFAULT_INPUT_LEN = 512
DEFAULT_CONCURRENCY = 8
WARMUP_OUTPUT_LEN = 16  # warm-up requests: full-length prompts, a few output tokens
HF_LABEL = "hf-transformers"


@dataclass
class BenchOptions:
    """The workload and how it is sent; the same for every target."""

    input_len: int | None = None
    output_len: int = 128
    num_prompts: int = 32
    concurrency: int | None = DEFAULT_CONCURRENCY
    request_rate: float | None = None
    seed: int = 0
    prompts_file: Path | None = None
    warmup: int = 2
    hf: bool = False
    tokenizer: Path | None = None
    health_timeout_s: float = DEFAULT_HEALTH_TIMEOUT_S

    def check(self) -> None:
        """UserError for a value the workload cannot use."""
        for name in ("output_len", "num_prompts"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(self, name)})")
        if self.input_len is not None and self.input_len < 1:
            raise UserError(f"--input-len must be at least 1 (got {self.input_len})")
        if self.concurrency is not None and self.concurrency < 1:
            raise UserError(f"--concurrency must be at least 1 (got {self.concurrency})")
        if self.request_rate is not None and not self.request_rate > 0:
            raise UserError(f"--request-rate must be positive requests/s (got {self.request_rate})")
        if self.warmup < 0:
            raise UserError(f"--warmup must be 0 or more requests (got {self.warmup})")

    @property
    def hf_batch(self) -> int:
        """HF generate's batch: --concurrency, else (a request rate alone) every prompt at once."""
        return min(self.concurrency or self.num_prompts, self.num_prompts)

    def settings(self) -> dict[str, Any]:
        return {
            "input_len": self.input_len,
            "output_len": self.output_len,
            "num_prompts": self.num_prompts,
            "concurrency": self.concurrency,
            "request_rate": self.request_rate,
            "seed": self.seed,
            "prompts_file": str(self.prompts_file) if self.prompts_file else None,
            "warmup": self.warmup,
            "hf": self.hf,
            "hf_batch": self.hf_batch if self.hf else None,
            "ignore_eos": True,
        }


@dataclass
class Context:
    """What the targets share: the workload, the model folder (plans, --hf), measured bandwidth per device."""

    opts: BenchOptions
    overrides: list[str]
    workload: Workload
    model_path: Path | None
    bandwidth: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


# --- checks before anything launches ------------------------------------------------------------------------


def check_plans(targets: list[Target], opts: BenchOptions) -> Path | None:
    """The plans' shared model folder (None without plans); UserError if they differ or --hf has no model."""
    folders = {t.report.model_path.resolve() for t in targets if t.report is not None and t.report.model_path}
    if len(folders) > 1:
        raise UserError(
            f"the plans use different models ({', '.join(sorted(map(str, folders)))}); bench compares layouts of "
            "one model, so give plans with the same model.path (or override it: model.path=...)"
        )
    folder = next(iter(folders), None)
    if folder is None and opts.tokenizer is None:
        raise UserError("with only URL targets, pass --tokenizer MODEL_FOLDER (the served model's tokenizer)")
    if opts.hf and folder is None and not (opts.tokenizer and (opts.tokenizer / "config.json").is_file()):
        raise UserError("--hf needs a model folder: give a plan, or --tokenizer with a full checkpoint folder")
    return folder or opts.tokenizer


def check_lengths(targets: list[Target], workload: Workload) -> None:
    """UserError if a prompt plus its output cannot fit a plan's max_model_len."""
    for t in targets:
        if t.report is None or t.report.max_model_len is None:
            continue
        if workload.max_total_len > t.report.max_model_len:
            raise UserError(
                f"plan {t.label}: prompts of up to {max(workload.input_lens)} tokens + {workload.output_len} output "
                f"tokens exceed model.max_model_len={t.report.max_model_len}; lower --input-len/--output-len or "
                f"raise model.max_model_len (nothing was launched)"
            )


def capacity_notes(targets: list[Target], workload: Workload, opts: BenchOptions) -> list[str]:
    """A note for each plan whose KV cache cannot hold the whole batch at once (preemptions are expected)."""
    batch = min(opts.concurrency or opts.num_prompts, opts.num_prompts)
    need = batch * workload.max_total_len
    notes = []
    for t in targets:
        kv = t.report.kv if t.report is not None else None
        if kv is not None and kv.token_capacity < need:
            notes.append(
                f"{t.label}: its KV cache holds {kv.token_capacity} tokens, less than {batch} requests × "
                f"{workload.max_total_len} tokens = {need}; expect preemptions"
            )
    return notes


# --- measuring one server -----------------------------------------------------------------------------------


class StatsWatch:
    """Poll GET /v1/engine/stats while a run goes on: the progress line, and the mean number of running
    sequences (the decode batch for the roofline). Stops quietly on a server without the endpoint."""

    def __init__(self, base_url: str, status: Any, period_s: float = 0.5) -> None:
        self.url, self.status, self.period_s = f"{base_url}/v1/engine/stats", status, period_s
        self.running: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dcpctl-bench-stats", daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while not self._stop.wait(self.period_s):
                try:
                    resp = client.get(self.url)
                    if resp.status_code == 404:
                        return
                    st = resp.json()
                    running, waiting = int(st["running"]), int(st["waiting"])
                except (httpx.HTTPError, ValueError, KeyError, TypeError):
                    continue
                if running:
                    self.running.append(running)
                self.status(f"{running} running, {waiting} waiting, KV blocks {st.get('used_blocks')} used")

    @property
    def mean_running(self) -> float | None:
        return sum(self.running) / len(self.running) if self.running else None

    def __enter__(self) -> StatsWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def engine_stats(base_url: str) -> dict[str, Any]:
    """The server's /v1/engine/stats, or {} when it has none (not a dcpctl server)."""
    try:
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            resp = client.get(f"{base_url}/v1/engine/stats")
        return resp.json() if resp.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return {}


def served_model(base_url: str) -> str | None:
    """The first model id of GET /v1/models (vLLM requires it in requests), or None."""
    from evals.lm_eval_runner import check_server

    ids = check_server(base_url)
    return ids[0] if ids else None


def _first_error(records: list[RequestRecord]) -> str | None:
    return next((r.error for r in records if r.error), None)


def measure_server(
    base_url: str, ctx: Context, status: Any, on_done: Any
) -> tuple[RunResult, dict[str, Any], dict[str, Any], float | None]:
    """Warm up, then run the workload; (run, stats before, stats after, mean running sequences)."""
    opts, wl = ctx.opts, ctx.workload
    model = served_model(base_url)
    if wl.warmup:
        status(f"warming up ({len(wl.warmup)} requests)")
        warm = run_requests(
            base_url, model, wl.warmup, min(WARMUP_OUTPUT_LEN, wl.output_len), concurrency=opts.concurrency
        )
        error = _first_error(warm.records)
        if error:
            raise UserError(f"a warm-up request failed: {error}")
    before = engine_stats(base_url)
    status("measuring")
    with StatsWatch(base_url, lambda msg: status(f"measuring: {msg}")) as watch:
        run = run_requests(
            base_url,
            model,
            wl.prompts,
            wl.output_len,
            concurrency=opts.concurrency,
            request_rate=opts.request_rate,
            seed=opts.seed,
            on_done=on_done,
        )
    return run, before, engine_stats(base_url), watch.mean_running


def _fill(result: TargetResult, run: RunResult, ctx: Context) -> None:
    result.records = run.records
    result.metrics = compute_metrics(run.records, run.duration_s, ctx.workload.output_len)
    if result.metrics.completed == 0:
        result.error = f"every request failed: {_first_error(run.records)}"
    elif result.metrics.failed:
        ctx.notes.append(f"{result.label}: {result.metrics.failed} request(s) failed: {_first_error(run.records)}")
    if result.metrics.short_requests:
        ctx.notes.append(
            f"{result.label}: {result.metrics.short_requests} request(s) returned fewer than "
            f"{ctx.workload.output_len} tokens (the server did not honour ignore_eos?)"
        )


def _roofline(
    ctx: Context,
    result: TargetResult,
    *,
    dtype: str,
    kv_bytes_per_token: int,
    tp: int,
    dcp: int,
    ranks_per_memory: int,
    device: str,
    batch: float | None,
) -> None:
    from engine.model_info import dtype_bytes

    m = result.metrics
    bw = ctx.bandwidth.get(device)
    if m is None or m.itl.p50 is None or bw is None or ctx.model_path is None:
        return
    lens = ctx.workload.input_lens
    result.roofline = decode_roofline(
        weight_bytes=weight_elements(ctx.model_path) * dtype_bytes(dtype),
        kv_bytes_per_token=kv_bytes_per_token,
        tp=tp,
        dcp=dcp,
        ranks_per_memory=ranks_per_memory,
        batch=batch or float(ctx.opts.hf_batch),
        context_len=sum(lens) / len(lens) + ctx.workload.output_len / 2,
        bandwidth_bytes_s=bw,
        measured_step_s=m.itl.p50,
    )


def bench_plan(
    target: Target, ctx: Context, plan_dir: Path, keep_files: bool, status: Any, on_done: Any
) -> TargetResult:
    """Launch the plan's server, measure it, stop it; failures come back in the result's error."""
    report = target.report
    assert report is not None and report.kv is not None
    result = TargetResult(
        label=target.label,
        kind="plan",
        spec=target.spec,
        world_size=report.world_size,
        kv_bytes_per_rank=report.kv.bytes_per_rank,
        token_capacity=report.kv.token_capacity,
    )
    server = PlanServer(
        target.spec,
        ctx.overrides,
        host=report.plan.serve.host,
        health_timeout_s=ctx.opts.health_timeout_s,
        log_path=plan_dir / "server.log",
        label=target.label,
    )
    result.launch = {"command": server.command, "port": server.port}
    if keep_files:
        result.launch["log"] = str(server.log_path)
    status(f"launching (world size {report.world_size})")
    try:
        server.start()
        result.launch["time_to_healthy_s"] = round(server.wait_healthy(), 2)
        run, before, after, mean_running = measure_server(server.base_url, ctx, status, on_done)
        crashed = server.exit_reason()
        if crashed:
            raise UserError(f"the server {crashed} during the benchmark")
    except Exception as exc:
        crashed = server.exit_reason()
        result.error = f"the server {crashed}" if crashed and not isinstance(exc, UserError) else _reason(exc)
        return result
    finally:
        status("stopping the server")
        result.launch["exit_code"] = server.stop()
    _fill(result, run, ctx)
    result.stats = after
    result.num_blocks = after.get("num_blocks")
    result.peak_kv_blocks = after.get("peak_used_blocks")
    if "preemptions" in after and "preemptions" in before:
        result.preemptions = after["preemptions"] - before["preemptions"]
    p = report.plan
    local_ranks = max(1, (report.world_size or 1) // max(1, p.launch.nnodes))
    _roofline(
        ctx,
        result,
        dtype=report.dtype,
        kv_bytes_per_token=report.kv.bytes_per_token,
        tp=p.parallel.tp,
        dcp=p.parallel.dcp,
        ranks_per_memory=local_ranks if report.device == "cpu" else 1,
        device="cpu" if report.device == "cpu" else "cuda",
        batch=mean_running,
    )
    return result


def bench_url(target: Target, ctx: Context, status: Any, on_done: Any) -> TargetResult:
    """Measure an endpoint as it is (no KV columns; the peak blocks if it is a dcpctl server)."""
    result = TargetResult(label=target.label, kind="url", spec=target.spec)
    try:
        run, before, after, _ = measure_server(target.spec, ctx, status, on_done)
    except Exception as exc:
        result.error = _reason(exc)
        return result
    _fill(result, run, ctx)
    result.stats = after
    result.peak_kv_blocks = after.get("peak_used_blocks")
    result.num_blocks = after.get("num_blocks")
    if "preemptions" in after and "preemptions" in before:
        result.preemptions = after["preemptions"] - before["preemptions"]
    return result


def bench_hf(ctx: Context, plan_report: Any, status: Any, on_done: Any) -> TargetResult:
    """HF transformers `generate` in this process on the plans' model and device, the same prompts."""
    import torch
    from transformers.utils import logging as hf_logging

    from engine.model_info import dtype_bytes, read_model_info
    from evals.bench.hf_reference import load_hf_model, run_hf

    assert ctx.model_path is not None
    if plan_report is not None:
        device, dtype = plan_report.device, plan_report.dtype
    else:
        device = _default_device()
        dtype = "float32" if device == "cpu" else "bfloat16"
    batch = ctx.opts.hf_batch
    hf_logging.disable_progress_bar()
    result = TargetResult(label=HF_LABEL, kind="hf", spec=str(ctx.model_path), world_size=1)
    result.launch = {"device": device, "dtype": dtype, "batch_size": batch, "torch_threads": torch.get_num_threads()}
    try:
        status(f"loading {ctx.model_path.name} ({dtype}, {device})")
        model = load_hf_model(ctx.model_path, dtype, device)
        status(f"generating in batches of {batch}")
        run = run_hf(
            model,
            ctx.workload.prompts,
            ctx.workload.output_len,
            batch_size=batch,
            warmup=ctx.workload.warmup,
            on_done=on_done,
        )
        del model
        if device != "cpu":
            torch.cuda.empty_cache()
    except Exception as exc:
        result.error = _reason(exc)
        return result
    _fill(result, run, ctx)
    info = read_model_info(ctx.model_path)
    _roofline(
        ctx,
        result,
        dtype=dtype,
        kv_bytes_per_token=info.kv_bytes_per_token(1, dtype_bytes(dtype)),
        tp=1,
        dcp=1,
        ranks_per_memory=1,
        device="cpu" if device == "cpu" else "cuda",
        batch=float(batch),
    )
    return result


def _default_device() -> str:
    """Where --hf runs without a plan to say: CUDA if this machine has it."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return text if isinstance(exc, UserError) else f"{type(exc).__name__}: {text}"


# --- the run ------------------------------------------------------------------------------------------------


def measure_bandwidth(targets: list[Target], hf: bool, console: Console) -> dict[str, float]:
    """Copy bandwidth of each device kind the plans (and --hf) run on, measured once before any launch."""
    kinds = {("cpu" if t.report.device == "cpu" else "cuda") for t in targets if t.report is not None}
    if hf and not kinds:
        kinds.add(_default_device())
    out = {}
    for kind in sorted(kinds):
        try:
            out[kind] = copy_bandwidth_subprocess(kind)
        except (RuntimeError, subprocess.TimeoutExpired, ValueError) as exc:
            console.print(f"[yellow]warning[/] no roofline for {kind}: {escape(str(exc))}", highlight=False)
            continue
        console.print(f"memory bandwidth ({kind}, copy): {out[kind] / 1e9:.1f} GB/s", highlight=False)
    return out


def run_bench(
    specs: list[str],
    overrides: list[str],
    opts: BenchOptions,
    *,
    output: Path | None = None,
    console: Console | None = None,
) -> BenchReport:
    """Validate all targets, build the workload, measure each target (and --hf), print the table, write files."""
    console = console or make_console()
    opts.check()
    targets = resolve_targets(specs, overrides, console)
    model_path = check_plans(targets, opts)
    tokenizer = load_tokenizer(model_path)
    workload = build_workload(
        tokenizer,
        num_prompts=opts.num_prompts,
        input_len=opts.input_len,
        output_len=opts.output_len,
        seed=opts.seed,
        num_warmup=opts.warmup,
        prompts_file=opts.prompts_file,
        default_input_len=DEFAULT_INPUT_LEN,
    )
    check_lengths(targets, workload)
    ctx = Context(opts=opts, overrides=overrides, workload=workload, model_path=model_path)
    ctx.notes += capacity_notes(targets, workload, opts)
    if any(t.is_url for t in targets):
        ctx.notes.append(
            "URL targets were sent ignore_eos=true (a vLLM extension); a server without it may stop at EOS, "
            "which shows as fewer output tokens"
        )
    if opts.hf:
        ctx.notes.append(
            f"{HF_LABEL}: transformers generate in-process, sequential left-padded batches of {opts.hf_batch}; "
            "a request's TTFT counts from the start of its batch"
        )
    ctx.bandwidth = measure_bandwidth(targets, opts.hf, console)
    results: list[TargetResult] = []
    with tempfile.TemporaryDirectory(prefix="dcpctl-bench-") as tmp:
        out_root = output if output is not None else Path(tmp)
        report = BenchReport(
            settings=opts.settings(),
            workload=workload.to_dict(),
            targets=results,
            bandwidth_bytes_s=ctx.bandwidth,
            notes=ctx.notes,
        )
        try:
            _run_targets(targets, ctx, out_root, output is not None, console, results)
        finally:
            if results and output is not None:
                write_report(report, output)
    console.print(render_table(report))
    for line in roofline_lines(report):
        console.print(f"roofline {line}", highlight=False, markup=False)
    for line in caption_lines(report):
        console.print(f"note {line}", highlight=False, markup=False, style="red" if ": FAILED" in line else None)
    for r in results:
        tth = r.launch.get("time_to_healthy_s")
        if tth is not None:
            console.print(f"{r.label}: healthy {tth:.1f} s after launch", highlight=False)
    if output is not None:
        console.print(f"report: {output / 'bench.md'} (also bench.json, throughput.png, tpot.png)", highlight=False)
    return report


def _run_targets(
    targets: list[Target], ctx: Context, out_root: Path, keep_files: bool, console: Console, results: list
) -> None:
    n = ctx.opts.num_prompts
    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    first_plan = next((t.report for t in targets if t.report is not None), None)
    jobs: list[Target | None] = [*targets, *([None] if ctx.opts.hf else [])]
    with Progress(*columns, console=console, transient=False) as progress:
        for target in jobs:
            label = target.label if target is not None else HF_LABEL
            bar = progress.add_task(escape(f"{label}: waiting"), total=n)

            def status(msg: str, bar: Any = bar, label: str = label) -> None:
                progress.update(bar, description=escape(f"{label}: {msg}"))

            def on_done(_rec: RequestRecord, bar: Any = bar) -> None:
                progress.advance(bar)

            t0 = time.perf_counter()
            if target is None:
                result = bench_hf(ctx, first_plan, status, on_done)
            elif target.report is None:
                result = bench_url(target, ctx, status, on_done)
            else:
                plan_dir = out_root / target.dir_name
                result = bench_plan(target, ctx, plan_dir, keep_files, status, on_done)
            result.launch["total_s"] = round(time.perf_counter() - t0, 2)
            results.append(result)
            if result.failed:
                progress.update(bar, description=f"[red]{escape(label)}: FAILED[/] — {escape(result.error or '')}")
            else:
                assert result.metrics is not None
                progress.update(
                    bar,
                    completed=n,
                    description=escape(f"{label}: done, {result.metrics.output_throughput:.1f} output tok/s"),
                )


# --- the command --------------------------------------------------------------------------------------------


def bench(
    args: Annotated[
        list[str],
        typer.Argument(help="Plan files and/or http(s):// endpoints, then KEY=VALUE overrides for every plan."),
    ],
    input_len: Annotated[
        int | None,
        typer.Option(help=f"Prompt tokens (random prompts; default {DEFAULT_INPUT_LEN}). With --prompts-file: cut to."),
    ] = None,
    output_len: Annotated[int, typer.Option(help="Output tokens per request (EOS ignored).")] = 128,
    num_prompts: Annotated[int, typer.Option(help="Measured requests per target.")] = 32,
    concurrency: Annotated[
        int | None,
        typer.Option(help=f"Requests in flight at once (default {DEFAULT_CONCURRENCY}; none with --request-rate)."),
    ] = None,
    request_rate: Annotated[
        float | None, typer.Option(help="Poisson arrivals at this many requests/s (capped by --concurrency if given).")
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the random prompts and arrivals.")] = 0,
    prompts_file: Annotated[
        Path | None,
        typer.Option(help="Prompts instead of random ones: lines, or JSONL with 'prompt' / 'prompt_token_ids'."),
    ] = None,
    hf: Annotated[bool, typer.Option("--hf", help="Add HF transformers generate (in-process) as a column.")] = False,
    output: Annotated[
        Path | None, typer.Option(help="Write bench.{json,md}, throughput.png, tpot.png and server logs here.")
    ] = None,
    warmup: Annotated[
        int, typer.Option(help=f"Warm-up requests per target before measuring ({WARMUP_OUTPUT_LEN} output tokens).")
    ] = 2,
    tokenizer: Annotated[
        Path | None, typer.Option(help="Model folder whose tokenizer makes the prompts (needed with only URLs).")
    ] = None,
    health_timeout: Annotated[
        float, typer.Option(help="Seconds to wait for a launched server's /health.")
    ] = DEFAULT_HEALTH_TIMEOUT_S,
) -> None:
    """Throughput, latency and KV capacity of plans (launched in turn) or endpoints under one workload."""
    specs, overrides = split_plans_and_overrides(args)
    if concurrency is None and request_rate is None:
        concurrency = DEFAULT_CONCURRENCY
    opts = BenchOptions(
        input_len=input_len,
        output_len=output_len,
        num_prompts=num_prompts,
        concurrency=concurrency,
        request_rate=request_rate,
        seed=seed,
        prompts_file=prompts_file,
        warmup=warmup,
        hf=hf,
        tokenizer=tokenizer,
        health_timeout_s=health_timeout,
    )
    report = run_bench(specs, overrides, opts, output=output)
    failed = [t.label for t in report.targets if t.failed]
    partial = [t.label for t in report.targets if t.metrics is not None and t.metrics.failed]
    if failed or partial:
        Console(stderr=True).print(
            f"[bold red]error:[/] {len(failed)} target(s) failed, {len(partial)} with failed requests: "
            f"{', '.join(failed + partial)} (reasons in the table caption)",
            highlight=False,
        )
        raise typer.Exit(1)

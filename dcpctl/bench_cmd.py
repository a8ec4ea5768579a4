"""`dcpctl bench PLAN_OR_URL ...`: one fixed workload through the HTTP API of each plan (launched in turn) or
endpoint, optionally HF transformers in-process as a reference column; one table, JSON/Markdown/PNG reports.

The options become evals' BenchOptions. Every plan is validated and every URL checked before anything launches
(as `dcpctl eval` does); evals.bench prepares the workload, probes the memory bandwidth and measures each target
in turn (evals.bench.runner); this module draws the progress, the table, the roofline and the notes.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from dcpctl.args import split_plans_and_overrides
from dcpctl.render import ProgressFeed, checked_targets, make_console
from engine.io_utils import writable_folder
from evals.bench.options import DEFAULT_CONCURRENCY, DEFAULT_INPUT_LEN, BenchOptions, prepare_bench
from evals.bench.report import BenchReport, TargetBench, caption_lines, render_table, roofline_lines, write_report
from evals.bench.runner import WARMUP_OUTPUT_LEN, bench_targets, probe_bandwidth
from evals.launch import DEFAULT_HEALTH_TIMEOUT_S
from evals.targets import Target


def _bandwidth(console: Console, targets: list[Target], hf: bool) -> dict[str, float]:
    """Probe the memory bandwidth of each device kind, printing each figure (or why there is none)."""
    bandwidth, failures = probe_bandwidth(targets, hf)
    for kind in sorted({*bandwidth, *failures}):
        if kind in failures:
            console.print(f"[yellow]warning[/] no roofline for {kind}: {escape(failures[kind])}", highlight=False)
        else:
            console.print(f"memory bandwidth ({kind}, copy): {bandwidth[kind] / 1e9:.1f} GB/s", highlight=False)
    return bandwidth


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
    targets = checked_targets(specs, overrides, console)
    ctx = prepare_bench(targets, overrides, opts)
    ctx.bandwidth = _bandwidth(console, targets, opts.hf)
    results: list[TargetBench] = []
    with tempfile.TemporaryDirectory(prefix="dcpctl-bench-") as tmp:
        report = BenchReport(
            settings=opts.settings(),
            workload=ctx.workload.to_dict(),
            targets=results,
            bandwidth_bytes_s=ctx.bandwidth,
            notes=ctx.notes,
        )
        try:
            with ProgressFeed(console) as feed:
                bench_targets(
                    targets,
                    ctx,
                    out_root=output if output is not None else Path(tmp),
                    keep_files=output is not None,
                    feed=feed,
                    results=results,
                )
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
    if output is not None:
        writable_folder(output, "--output")
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

"""Measuring each target under the bench workload: a plan's server launched, warmed up, measured and stopped (a
URL measured as it is), HF transformers `generate` in-process as the reference, and the memory bandwidth that the
decode roofline divides by. A target that fails (never healthy, crashed, every request failed) keeps its reason
in its result and the others still run."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

from engine.checkpoints.model_info import dtype_bytes, read_model_info, weight_elements
from engine.core.speculative import SpecCounters
from engine.errors import UserError
from engine.placement.weights import weight_bytes
from engine.plan.resolved import ResolvedPlan
from evals.bench.client import RequestRecord, RunResult, run_requests
from evals.bench.metrics import compute_metrics
from evals.bench.options import HF_LABEL, BenchContext
from evals.bench.report import TargetBench
from evals.bench.roofline import copy_bandwidth_subprocess, decode_roofline
from evals.endpoint import StatsWatch, engine_stats, served_model
from evals.lifecycle import Feed, TargetFeed, measure_target, reason
from evals.targets import Target

WARMUP_OUTPUT_LEN = 16  # warm-up requests: full-length prompts, a few output tokens

Measured = tuple[RunResult, dict[str, Any], dict[str, Any]]


def _first_error(records: list[RequestRecord]) -> str | None:
    return next((r.error for r in records if r.error), None)


def measure_server(base_url: str, ctx: BenchContext, feed: TargetFeed) -> Measured:
    """Warm up, then run the workload; (run, stats before, stats after)."""
    opts, wl = ctx.opts, ctx.workload
    model = served_model(base_url)
    if wl.warmup:
        feed.status(f"warming up ({len(wl.warmup)} requests)")
        warm = run_requests(
            base_url, model, wl.warmup, min(WARMUP_OUTPUT_LEN, wl.output_len), concurrency=opts.concurrency
        )
        error = _first_error(warm.records)
        if error:
            raise UserError(f"a warm-up request failed: {error}")
    before = engine_stats(base_url)
    feed.status("measuring")

    def show(st: dict[str, Any]) -> None:
        feed.status(
            f"measuring: {st['running']} running, {st.get('waiting')} waiting, KV blocks {st.get('used_blocks')} used"
        )

    with StatsWatch(base_url, show, period_s=0.5):
        run = run_requests(
            base_url,
            model,
            wl.prompts,
            wl.output_len,
            concurrency=opts.concurrency,
            request_rate=opts.request_rate,
            seed=opts.seed,
            on_done=lambda _rec: feed.advance(),
        )
    return run, before, engine_stats(base_url)


def _fill(result: TargetBench, run: RunResult, ctx: BenchContext) -> None:
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
    ctx: BenchContext,
    result: TargetBench,
    *,
    weight_bytes_per_rank: int,
    kv_bytes_per_token: int,
    dcp: int,
    ranks_per_memory: int,
    device: str,
    batch: float | None,
) -> None:
    m = result.metrics
    bw = ctx.bandwidth.get(device)
    if m is None or m.itl.p50 is None or bw is None or ctx.model_path is None:
        return
    lens = ctx.workload.input_lens
    result.roofline = decode_roofline(
        weight_bytes_per_rank=weight_bytes_per_rank,
        kv_bytes_per_token=kv_bytes_per_token,
        dcp=dcp,
        ranks_per_memory=ranks_per_memory,
        batch=batch or float(ctx.opts.max_batch),
        context_len=sum(lens) / len(lens) + ctx.workload.output_len / 2,
        bandwidth_bytes_s=bw,
        measured_step_s=m.itl.p50,
    )


def device_kind(device: str) -> str:
    """The memory a device reads, as the bandwidth probe names it: cpu, or cuda for any GPU."""
    return "cpu" if device == "cpu" else "cuda"


def bench_target(target: Target, ctx: BenchContext, plan_dir: Path, keep_files: bool, feed: TargetFeed) -> TargetBench:
    """Measure a URL as it is, or launch the plan's server, measure it and stop it; failures come back in the
    result's error. A plan gets its KV columns and the roofline; a dcpctl server its peak blocks."""
    resolved = target.resolved
    result = TargetBench(label=target.label, kind="url" if resolved is None else "plan", spec=target.spec)
    if resolved is not None:
        assert resolved.kv is not None
        result.world_size = resolved.world_size
        result.kv_bytes_per_rank = resolved.kv.bytes_per_rank
        result.token_capacity = resolved.kv.token_capacity
    outcome = measure_target(
        target,
        ctx.overrides,
        lambda served: measure_server(served.base_url, ctx, feed),
        activity="benchmark",
        log_path=plan_dir / "server.log",
        keep_log=keep_files,
        health_timeout_s=ctx.opts.health_timeout_s,
        status=feed.status,
    )
    result.launch = outcome.launch
    if outcome.value is None:
        result.error = outcome.error
        return result
    run, before, after = outcome.value
    _fill(result, run, ctx)
    result.stats = after
    result.num_blocks = after.get("num_blocks")
    result.peak_kv_blocks = after.get("peak_used_blocks")
    if "preemptions" in after and "preemptions" in before:
        result.preemptions = after["preemptions"] - before["preemptions"]
    if "speculative" in after:
        result.speculation = SpecCounters.since(before.get("speculative"), after["speculative"])
    if resolved is not None:
        assert resolved.kv is not None
        device = device_kind(resolved.device)
        _roofline(
            ctx,
            result,
            weight_bytes_per_rank=max(
                weight_bytes(resolved.placement, r, dtype_bytes(resolved.dtype)) for r in range(resolved.world_size)
            ),
            kv_bytes_per_token=resolved.kv.bytes_per_token,
            dcp=resolved.plan.parallel.dcp,
            ranks_per_memory=resolved.local_world_size if device == "cpu" else 1,
            device=device,
            batch=result.metrics.decode_batch,
        )
    return result


def bench_hf(ctx: BenchContext, first_plan: ResolvedPlan | None, feed: TargetFeed) -> TargetBench:
    """HF transformers `generate` in this process on the plans' model and device, the same prompts."""
    import torch
    from transformers.utils import logging as hf_logging

    from evals.bench.hf_reference import load_hf_model, run_hf

    assert ctx.model_path is not None
    if first_plan is not None:
        device, dtype = first_plan.device, first_plan.dtype
    else:
        device = default_device()
        dtype = "float32" if device == "cpu" else "bfloat16"
    batch = ctx.opts.max_batch
    hf_logging.disable_progress_bar()
    result = TargetBench(label=HF_LABEL, kind="hf", spec=str(ctx.model_path), world_size=1)
    result.launch = {"device": device, "dtype": dtype, "batch_size": batch, "torch_threads": torch.get_num_threads()}
    try:
        feed.status(f"loading {ctx.model_path.name} ({dtype}, {device})")
        model = load_hf_model(ctx.model_path, dtype, device)
        feed.status(f"generating in batches of {batch}")
        run = run_hf(
            model,
            ctx.workload.prompts,
            ctx.workload.output_len,
            batch_size=batch,
            warmup=ctx.workload.warmup,
            on_done=lambda _rec: feed.advance(),
        )
        del model
        if device != "cpu":
            torch.cuda.empty_cache()
    except Exception as exc:
        result.error = reason(exc)
        return result
    _fill(result, run, ctx)
    info = read_model_info(ctx.model_path)
    _roofline(
        ctx,
        result,
        weight_bytes_per_rank=weight_elements(ctx.model_path) * dtype_bytes(dtype),
        kv_bytes_per_token=info.kv_bytes_per_token(1, dtype_bytes(dtype)),
        dcp=1,
        ranks_per_memory=1,
        device=device_kind(device),
        batch=float(batch),
    )
    return result


def default_device() -> str:
    """Where --hf runs without a plan to say: CUDA if this machine has it."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def probe_bandwidth(targets: list[Target], hf: bool) -> tuple[dict[str, float], dict[str, str]]:
    """Copy bandwidth (bytes/s) of each device kind the plans (and --hf) run on, measured once before any launch;
    and why it could not be measured, for the kinds that failed."""
    kinds = {device_kind(t.resolved.device) for t in targets if t.resolved is not None}
    if hf and not kinds:
        kinds.add(default_device())
    bandwidth: dict[str, float] = {}
    failures: dict[str, str] = {}
    for kind in sorted(kinds):
        try:
            bandwidth[kind] = copy_bandwidth_subprocess(kind)
        except (RuntimeError, subprocess.TimeoutExpired, ValueError) as exc:
            failures[kind] = str(exc)
    return bandwidth, failures


def bench_targets(
    targets: list[Target],
    ctx: BenchContext,
    *,
    out_root: Path,
    keep_files: bool,
    feed: Feed,
    results: list[TargetBench],
) -> None:
    """Measure each target in turn, then HF (--hf), appending to `results` as each finishes."""
    n = ctx.opts.num_prompts
    first_plan = next((t.resolved for t in targets if t.resolved is not None), None)
    jobs: list[Target | None] = [*targets, *([None] if ctx.opts.hf else [])]
    for target in jobs:
        progress = feed.target(target.label if target is not None else HF_LABEL, total=n)
        t0 = time.perf_counter()
        if target is None:
            result = bench_hf(ctx, first_plan, progress)
        else:
            result = bench_target(target, ctx, out_root / target.dir_name, keep_files, progress)
        result.launch["total_s"] = round(time.perf_counter() - t0, 2)
        results.append(result)
        if result.failed:
            progress.finish(result.error or "", failed=True)
        else:
            assert result.metrics is not None
            progress.finish(f"done, {result.metrics.output_throughput:.1f} output tok/s")

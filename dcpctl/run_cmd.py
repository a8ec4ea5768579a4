"""`dcpctl run PLAN`: serve the plan's engine, or generate offline with --prompt / --prompts-file."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated

import typer

from dcpctl.args import split_plans_and_overrides


def run(
    args: Annotated[list[str], typer.Argument(help="A plan file, then KEY=VALUE overrides.")],
    prompt: Annotated[list[str] | None, typer.Option("--prompt", help="A prompt (repeatable): offline mode.")] = None,
    prompts_file: Annotated[
        Path | None, typer.Option(help="One prompt per line, or JSONL with a 'prompt' field.")
    ] = None,
    max_tokens: Annotated[int, typer.Option(help="New tokens per prompt.")] = 64,
    temperature: Annotated[float, typer.Option(help="0 is greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option()] = 1.0,
    top_k: Annotated[int, typer.Option(help="0: off.")] = 0,
    seed: Annotated[int | None, typer.Option(help="Per-request sampling seed.")] = None,
    stop: Annotated[list[str] | None, typer.Option("--stop", help="Stop string (repeatable).")] = None,
    ignore_eos: Annotated[bool, typer.Option(help="Keep generating past EOS (benchmarks).")] = False,
    logprobs: Annotated[int | None, typer.Option(help="Record top-N logprobs of each generated token.")] = None,
    output: Annotated[Path | None, typer.Option(help="Write one JSON object per prompt (JSONL), in order.")] = None,
    role: Annotated[
        str, typer.Option(help="A P/D plan: all (both instances and the router), prefill, decode or router.")
    ] = "all",
) -> None:
    """Launch the plan's ranks (torchrun for more than one) and serve an OpenAI-compatible API,
    or generate for the given prompts and print a results table. A P/D plan starts its prefill and decode
    instances and serves through a router (or one piece of it, with --role)."""
    from engine.io_utils import writable_file
    from engine.offline import OfflineJob, check_utf8, read_prompts
    from engine.serve_entry import ROLES, launch_ranks, runnable_plan, serve

    plans, overrides = split_plans_and_overrides(args)
    if output is not None:
        writable_file(output, "--output")
    check_utf8(list(prompt or []))
    if seed is not None and seed < 0:
        raise typer.BadParameter(f"--seed must be 0 or more (got {seed})")
    if len(plans) != 1:
        raise typer.BadParameter("dcpctl run takes one plan file")
    if role not in ROLES:
        raise typer.BadParameter(f"--role must be one of {', '.join(ROLES)}")
    resolved = runnable_plan(plans[0], overrides)
    if resolved.plan.engine.name != "dcpctl":
        from engine.errors import UserError

        raise UserError(
            f"plan {resolved.name} names engine.name={resolved.plan.engine.name}, which `dcpctl eval` and "
            f"`dcpctl bench` launch; `dcpctl run` serves with dcpctl's engine: run `dcpctl plan export {plans[0]} "
            "--to vllm` and start that command, or set engine.name=dcpctl"
        )
    prompts = list(prompt or []) + (read_prompts(prompts_file) if prompts_file else [])
    if not prompts:
        return serve(resolved, overrides, role)
    if role != "all":
        raise typer.BadParameter("offline generation (--prompt, --prompts-file) runs the whole plan: drop --role")
    params = {
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "seed": seed,
        "stop": list(stop or []),
        "ignore_eos": ignore_eos,
        "logprobs": logprobs,
    }
    from engine.core.sequence import SamplingParams

    SamplingParams(**params).validate()
    job = OfflineJob(prompts=prompts, params=params, output=str(output) if output else None)
    if resolved.disagg is not None:  # through the deployment's router, as a client would
        from engine.offline import run_offline_over_http
        from engine.serving.deployment import deployment_url

        with deployment_url(resolved.source, resolved.name, overrides, resolved.plan.disagg) as url:
            run_offline_over_http(url, job)
        return None
    if resolved.world_size == 1:
        from engine.llm import LLM
        from engine.offline import run_offline

        with LLM(resolved) as llm:
            run_offline(llm, job)
        return None
    with tempfile.TemporaryDirectory(prefix="dcpctl-job-") as tmp:
        job_file = Path(tmp) / "job.json"
        job.save(job_file)
        stopped_by = launch_ranks(resolved, overrides, ["--job-file", str(job_file)])
    if stopped_by is not None:  # the job did not finish: the shell's status for a signal
        raise typer.Exit(128 + stopped_by)
    return None

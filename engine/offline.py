"""Offline generation jobs: read prompts, generate on rank 0 with a progress bar, write JSONL results."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from engine.core.sequence import SamplingParams, TokenLogprob
from engine.errors import UserError
from engine.io_utils import atomic_write_text
from engine.llm import RequestOutput


@dataclass
class OfflineJob:
    """Prompts and how to generate for them; plain data so it can travel to the ranks as JSON."""

    prompts: list[str | list[int]]
    params: dict = field(default_factory=dict)  # SamplingParams fields
    output: str | None = None
    show_table: bool = True

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(**self.params)

    def save(self, path: Path) -> None:
        atomic_write_text(path, json.dumps(asdict(self)))

    @classmethod
    def load(cls, path: Path) -> OfflineJob:
        return cls(**json.loads(path.read_text()))


def read_prompts(path: Path) -> list[str | list[int]]:
    """One prompt per line, or JSONL objects with a `prompt` (text) or `prompt_token_ids` field; blank lines skip."""
    try:
        lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except FileNotFoundError:
        raise UserError(f"prompts file {path} does not exist") from None
    except IsADirectoryError:
        raise UserError(f"prompts file {path} is a folder: give the file of prompts") from None
    except UnicodeDecodeError:
        raise UserError(f"prompts file {path} is not UTF-8 text") from None
    if not lines:
        raise UserError(f"prompts file {path} has no prompts")
    if not lines[0].lstrip().startswith("{"):
        return lines
    prompts = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{number}: invalid JSON ({exc.msg})") from None
        if isinstance(record, dict) and "prompt" in record and "prompt_token_ids" in record:
            raise UserError(f"{path}:{number}: give either 'prompt' or 'prompt_token_ids', not both")
        if isinstance(record, dict) and isinstance(record.get("prompt"), str):
            prompts.append(record["prompt"])
        elif isinstance(record, dict) and _is_token_list(record.get("prompt_token_ids")):
            prompts.append(record["prompt_token_ids"])
        else:
            raise UserError(
                f"{path}:{number}: each JSONL line needs a string 'prompt' or a list of ints 'prompt_token_ids'"
            )
    return prompts


def _is_token_list(value) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int for t in value)  # not bool: true is 1


def check_utf8(prompts: list[str], option: str = "--prompt") -> None:
    """A UserError when a command-line prompt holds bytes that are not UTF-8 (Python keeps them as surrogates)."""
    for prompt in prompts:
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError:
            raise UserError(f"{option} {prompt!r} is not UTF-8 text; pass the prompt as UTF-8") from None


def _record(output) -> dict:
    record = {
        "prompt": output.prompt if output.prompt is not None else output.prompt_token_ids,
        "text": output.text,
        "token_ids": output.token_ids,
        "finish_reason": output.finish_reason,
        "stop_reason": output.stop_reason,
        "prompt_tokens": len(output.prompt_token_ids),
        "num_preemptions": output.num_preemptions,
        "ttft_s": output.ttft_s,
        "latency_s": output.latency_s,
    }
    if output.error:
        record["error"] = output.error
    if output.speculative is not None:
        record["speculative"] = output.speculative.as_dict()
    if output.logprobs:
        record["logprobs"] = [{"token_id": lp.token_id, "logprob": lp.logprob, "top": lp.top} for lp in output.logprobs]
    return record


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("[bold]generating"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )


def run_offline(llm, job: OfflineJob, console: Console | None = None) -> list[dict]:
    """Generate every prompt of the job with `llm` (an engine.LLM on rank 0); write results if asked."""
    console = console or Console()
    params = job.sampling_params()
    with _progress(console) as progress:
        task = progress.add_task("generate", total=len(job.prompts))
        outputs = llm.generate(job.prompts, params, on_finish=lambda _: progress.advance(task))
    return _report([_record(o) for o in outputs], job, llm.engine.stats(), console)


def run_offline_over_http(url: str, job: OfflineJob, console: Console | None = None) -> list[dict]:
    """The same job through a server's /v1/completions (a P/D deployment's router): every prompt in flight at
    once (up to HTTP_CONCURRENCY), the same records. A per-request preemption count is not in the API (None); the
    time to first token is the server's, from the hand-off's split."""
    console = console or Console()
    with _progress(console) as progress:
        task = progress.add_task("generate", total=len(job.prompts))
        records = asyncio.run(_generate_over_http(url, job, lambda: progress.advance(task)))
    with httpx.Client(timeout=30, trust_env=False) as client:
        stats = client.get(f"{url}/v1/engine/stats").json()
    return _report(records, job, stats, console)


HTTP_CONCURRENCY = 64


async def _generate_over_http(url: str, job: OfflineJob, advance) -> list[dict]:
    params = job.sampling_params()
    gate = asyncio.Semaphore(HTTP_CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, timeout=None, trust_env=False) as client:

        async def one(prompt: str | list[int]) -> dict:
            body = {
                "prompt": prompt,
                "max_tokens": params.max_tokens,
                "temperature": params.temperature,
                "top_p": params.top_p,
                "top_k": params.top_k,
                "seed": params.seed,
                "stop": params.stop or None,
                "ignore_eos": params.ignore_eos,
                "logprobs": params.logprobs,
                "return_token_ids": True,
                "return_tokens_as_token_ids": True,
            }
            async with gate:
                start = time.perf_counter()
                response = await client.post("/v1/completions", json=body)
                latency = time.perf_counter() - start
            advance()
            return _http_record(prompt, response, latency)

        return list(await asyncio.gather(*(one(p) for p in job.prompts)))


def _token_id(name: str) -> int:
    return int(name.removeprefix("token_id:"))


def _http_record(prompt: str | list[int], response: httpx.Response, latency: float) -> dict:
    """A completions response as an offline record (what `_record` writes for an engine's output)."""
    text_prompt = prompt if isinstance(prompt, str) else None
    try:
        body = response.json()
    except ValueError:
        body = {}
    if response.status_code != 200:
        error = (body.get("error") or {}).get("message") if isinstance(body, dict) else None
        record = _record(RequestOutput.rejected(prompt, error or f"HTTP {response.status_code}"))
        record["prompt"] = prompt
        return record
    choice = body["choices"][0]
    logprobs = []
    if choice.get("logprobs"):
        block = choice["logprobs"]
        for token, logprob, top in zip(block["tokens"], block["token_logprobs"], block["top_logprobs"], strict=True):
            logprobs.append(
                TokenLogprob(_token_id(token), logprob, [(_token_id(t), lp) for t, lp in (top or {}).items()])
            )
    split = (body.get("kv_transfer") or [None])[0]
    ttft = None
    if split and "error" not in split:
        parts = ("prefill_s", "claim_s", "queue_s", "transfer_s", "first_decode_s")
        ttft = sum(split.get(k) or 0.0 for k in parts)
    output = RequestOutput(
        request_id=body.get("id", ""),
        prompt=text_prompt,
        prompt_token_ids=choice["prompt_token_ids"],
        text=choice["text"],
        token_ids=choice["token_ids"],
        finish_reason=choice["finish_reason"],
        stop_reason=choice.get("stop_reason"),
        logprobs=logprobs,
        prompt_logprobs=[],
        num_preemptions=None,
        ttft_s=ttft,
        latency_s=latency,
    )
    record = _record(output)
    if split:
        record["kv_transfer"] = split
    return record


def _report(records: list[dict], job: OfflineJob, stats: dict, console: Console) -> list[dict]:
    """Write the records (when the job names a file) and show the table and the engine's counters."""
    if job.output:
        atomic_write_text(job.output, "".join(json.dumps(r) + "\n" for r in records))
    if job.show_table:
        table = Table(title=f"{len(records)} results", header_style="bold", show_lines=True)
        for column in ("#", "prompt", "output", "tokens", "finish"):
            table.add_column(column, overflow="fold")
        for i, r in enumerate(records):
            text = Text(_clip(r["text"])) if "error" not in r else Text(f"error: {r['error']}", style="red")
            table.add_row(str(i), Text(_clip(str(r["prompt"]))), text, str(len(r["token_ids"])), r["finish_reason"])
        console.print(table)
        console.print(
            f"{stats['generated_tokens']} tokens generated in {stats['steps']} steps; "
            f"prefix cache reused {stats['prefix_hit_tokens']} prompt tokens; {stats['preemptions']} preemptions"
            + _speculation_line(stats.get("speculative"))
        )
    return records


def _speculation_line(spec: dict | None) -> str:
    """`; speculation: accepted A of P proposals (R%), L tokens per verification` ('' when speculation is off)."""
    if spec is None:
        return ""
    if not spec["proposed"]:
        return "; speculation: no proposals"
    return (
        f"; speculation: accepted {spec['accepted']} of {spec['proposed']} proposals "
        f"({spec['acceptance_rate']:.0%}), {spec['mean_accepted_length']:.2f} tokens per verification"
    )


def _clip(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"

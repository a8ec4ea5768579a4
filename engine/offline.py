"""Offline generation jobs: read prompts, generate on rank 0 with a progress bar, write JSONL results."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from engine.core.sequence import SamplingParams
from engine.errors import UserError
from engine.io_utils import atomic_write_text


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
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) for t in value)


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
    if output.logprobs:
        record["logprobs"] = [{"token_id": lp.token_id, "logprob": lp.logprob, "top": lp.top} for lp in output.logprobs]
    return record


def run_offline(llm, job: OfflineJob, console: Console | None = None) -> list[dict]:
    """Generate every prompt of the job with `llm` (an engine.LLM on rank 0); write results if asked."""
    console = console or Console()
    params = job.sampling_params()
    with Progress(
        TextColumn("[bold]generating"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as progress:
        task = progress.add_task("generate", total=len(job.prompts))
        outputs = llm.generate(job.prompts, params, on_finish=lambda _: progress.advance(task))
    records = [_record(o) for o in outputs]
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
        stats = llm.engine.stats()
        console.print(
            f"{stats['generated_tokens']} tokens generated in {stats['steps']} steps; "
            f"prefix cache reused {stats['prefix_hit_tokens']} prompt tokens; {stats['preemptions']} preemptions"
        )
    return records


def _clip(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"

"""The Python API: `LLM(plan).generate(prompts, params)`.

A one-rank plan runs in this process. A plan of several ranks runs when this script is itself
started by torchrun (every rank constructs `LLM`; ranks other than 0 serve rank 0 and exit when
it closes); otherwise use `dcpctl run`, which launches the ranks.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine.core.sequence import SamplingParams, Sequence, TokenLogprob
from engine.core.speculative import SpecCounters
from engine.errors import UserError
from engine.plan.checks import resolve_plan
from engine.plan.resolved import ResolvedPlan


@dataclass
class RequestOutput:
    """What one finished request produced."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]  # generated ids only, the EOS id included when generation ended on it
    finish_reason: str
    stop_reason: str | int | None
    logprobs: list[TokenLogprob]
    prompt_logprobs: list[TokenLogprob | None]
    num_preemptions: int
    ttft_s: float | None
    latency_s: float | None
    error: str | None = None  # why the request was rejected or failed (finish_reason "error")
    speculative: SpecCounters | None = None  # speculative decoding's proposals and acceptances (None: off)

    @classmethod
    def rejected(cls, prompt: str | list[int], reason: str) -> RequestOutput:
        text = prompt if isinstance(prompt, str) else None
        ids = [] if isinstance(prompt, str) else list(prompt)
        return cls(
            request_id="",
            prompt=text,
            prompt_token_ids=ids,
            text="",
            token_ids=[],
            finish_reason="error",
            stop_reason=None,
            logprobs=[],
            prompt_logprobs=[],
            num_preemptions=0,
            ttft_s=None,
            latency_s=None,
            error=reason,
        )

    @classmethod
    def from_sequence(cls, seq: Sequence) -> RequestOutput:
        ttft = seq.first_token_time - seq.arrival_time if seq.first_token_time else None
        latency = seq.finish_time - seq.arrival_time if seq.finish_time else None
        return cls(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens],
            text=seq.output_text,
            token_ids=seq.output_token_ids,
            finish_reason=seq.finish_reason or "",
            stop_reason=seq.stop_reason,
            logprobs=seq.logprobs,
            prompt_logprobs=seq.prompt_logprobs,
            num_preemptions=seq.num_preemptions,
            ttft_s=ttft,
            latency_s=latency,
            error=seq.error,
            speculative=seq.spec,
        )


class LLM:
    """Offline generation with a plan."""

    def __init__(self, plan: str | Path | ResolvedPlan, overrides: list[str] | None = None):
        resolved = resolve_plan(plan, overrides)
        if resolved.disagg is not None:
            raise UserError(
                f"plan {resolved.name} is a P/D plan (two instances and a router): run it with "
                f"`dcpctl run {resolved.source}`, or use its prefill or decode plan here"
            )
        if (resolved.world_size or 1) > 1 and "RANK" not in os.environ:
            raise UserError(
                f"plan {resolved.name} needs {resolved.world_size} ranks: run it with "
                f"`dcpctl run {resolved.source}` (or start this script with torchrun)"
            )
        from engine.core.startup import start_engine  # here: RequestOutput's importers talk to servers, no torch

        self.plan = resolved
        engine = start_engine(resolved)
        if engine is None:  # a follower rank: rank 0 has closed its LLM
            sys.exit(0)
        self.engine = engine

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: list[str] | list[list[int]] | str,
        params: SamplingParams | list[SamplingParams] | None = None,
        on_finish: Callable[[RequestOutput], None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs in input order.

        A prompt that cannot run (too long, bad ids, bad parameters), or whose sampling or detokenization
        fails, gets an output with finish_reason "error" and the reason in `error`; the others run.
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise UserError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        results: list[Sequence | RequestOutput] = []
        for prompt, sp in zip(prompts, params_list, strict=True):
            try:
                results.append(self.engine.add_request(prompt, sp))
            except UserError as exc:
                results.append(RequestOutput.rejected(prompt, str(exc)))
        seqs = [r for r in results if isinstance(r, Sequence)]
        pending = {s.seq_id for s in seqs}
        while pending:
            for seq in self.engine.step():
                if seq.is_finished and seq.seq_id in pending:
                    pending.discard(seq.seq_id)
                    if on_finish is not None:
                        on_finish(RequestOutput.from_sequence(seq))
        return [RequestOutput.from_sequence(r) if isinstance(r, Sequence) else r for r in results]

    def close(self) -> None:
        """Stop the other ranks (when there are any)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

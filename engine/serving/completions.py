"""POST /v1/completions: legacy completions, what lm-eval's local-completions uses.

A prompt is text, a list of texts, token ids or a list of token-id lists; each prompt gets `n` choices. `echo`
prepends the prompt, and with `logprobs` its tokens' logprobs too (lm-eval's loglikelihood). Streamed, each choice's
text goes out as it becomes safe to send (nothing that could still turn into a stop string).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request

from engine.errors import UserError
from engine.serving.generation import (
    Choice,
    Generation,
    client_gone,
    event_stream,
    handoff_fields,
    json_response,
    speculative_fields,
    stream_chunk,
)
from engine.serving.protocol import MAX_CHOICES, CompletionRequest
from engine.serving.responses import CompletionLogprobs, ResponseHead, merge_logprobs, new_id, now, usage
from engine.serving.served_model import ServedModel

KIND = "text_completion"


class CompletionsEndpoint:
    """The /v1/completions handler over a served model."""

    def __init__(self, model: ServedModel):
        self.model = model

    async def _prompts(self, prompt, n: int, max_tokens: int) -> list[tuple[list[int], str | None]]:
        """Each prompt's token ids (and text), checked one by one: the first that cannot fit fails the request."""
        if isinstance(prompt, list) and not prompt:
            raise UserError("prompt is an empty list; send a string, a list of strings or token ids", param="prompt")
        if isinstance(prompt, str):
            prompts: list = [prompt]
        elif isinstance(prompt[0], list | str):
            prompts = list(prompt)
        else:
            prompts = [prompt]
        if len(prompts) * n > MAX_CHOICES:
            raise UserError(
                f"n={n} choices for each of {len(prompts)} prompts is more than the {MAX_CHOICES} one request may "
                "ask for; split the request"
            )
        out = []
        for number, p in enumerate(prompts):
            numbered = number if len(prompts) > 1 else None
            if isinstance(p, str):
                ids = await self.model.prompt_ids(p, "prompt", numbered)
            else:
                if not p:
                    where = f"prompt {number}" if len(prompts) > 1 else "the prompt"
                    raise UserError(f"{where} is an empty token list", param="prompt")
                ids = list(p)
                self.model.check_prompt(ids, "prompt", numbered)
            self.model.check_context("max_tokens", max_tokens, ids, numbered)
            out.append((ids, p if isinstance(p, str) else None))
        return out

    async def completions(self, req: CompletionRequest, request: Request):
        """POST /v1/completions (legacy completions, what lm-eval's local-completions uses)."""
        model = self.model
        model.check_model(req.model)
        req.check_supported()
        model.check_healthy()
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        prompts = await self._prompts(req.prompt, req.n, max_tokens)
        if req.logprobs is not None:
            tokens = [max_tokens + (len(ids) if req.echo else 0) for ids, _ in prompts for _ in range(req.n)]
            model.check_logprobs_size("logprobs", req.logprobs, tokens)
        choices, numbers = [], []
        for number, (ids, text) in enumerate(prompts):
            for _ in range(req.n):
                choices.append(Choice(len(choices), ids, text))
                numbers.append(number)
        prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
        gen = await model.generate(req, request, choices, lambda _: max_tokens, req.logprobs, prompt_logprobs, numbers)
        head = ResponseHead(new_id("cmpl"), KIND, now(), model.name)
        prompt_tokens = sum(len(ids) for ids, _ in prompts)
        if req.stream:
            return event_stream(gen, self._chunks(req, gen, head, prompt_tokens))
        if not await gen.run_to_end():
            return client_gone()
        return await json_response(
            lambda: head.body(
                [self._choice(req, c) for c in choices],
                usage=usage(prompt_tokens, sum(len(c.token_ids) for c in choices)),
                **handoff_fields(choices, gen.export_handle),
                **speculative_fields(choices),
            )
        )

    def _logprobs_builder(self, req: CompletionRequest) -> CompletionLogprobs:
        return CompletionLogprobs(self.model.token_text, self.model.token_name(req))

    def _echo_text(self, choice: Choice) -> str:
        if choice.prompt_text is not None:
            return choice.prompt_text
        return self.model.tokenizer.decode(choice.prompt_ids, skip_special_tokens=False)

    @staticmethod
    def _prompt_logprob_block(builder: CompletionLogprobs, choice: Choice) -> dict:
        entries = list(choice.prompt_logprobs or [])
        entries += [None] * (len(choice.prompt_ids) - len(entries))
        return builder.block(entries, choice.prompt_ids)

    def _choice(self, req: CompletionRequest, choice: Choice) -> dict:
        text = (self._echo_text(choice) if req.echo else "") + choice.text
        logprobs = None
        if req.logprobs is not None:
            builder = self._logprobs_builder(req)
            parts = [self._prompt_logprob_block(builder, choice)] if req.echo else []
            parts.append(builder.block(choice.logprobs, choice.token_ids[: len(choice.logprobs)]))
            logprobs = merge_logprobs(parts)
        out = {
            "index": choice.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
        }
        if req.return_token_ids:
            out["prompt_token_ids"] = choice.prompt_ids
            out["token_ids"] = choice.token_ids
        return out

    async def _chunks(
        self, req: CompletionRequest, gen: Generation, head: ResponseHead, prompt_tokens: int
    ) -> AsyncIterator[dict]:
        stops = req.stop_list()
        builders = {c.index: self._logprobs_builder(req) for c in gen.choices}
        sent_logprobs = dict.fromkeys(builders, 0)

        def chunk(index: int, text: str, logprobs: dict | None, finish: str | None) -> dict:
            item = {"index": index, "text": text, "logprobs": logprobs}
            return stream_chunk(head, gen, item, finish, req.include_usage)

        async for choice in gen.updates():
            parts = []
            if not choice.started:
                choice.started = True
                if req.echo:
                    prompt_part = None
                    if req.logprobs is not None:
                        prompt_part = self._prompt_logprob_block(builders[choice.index], choice)
                    yield chunk(choice.index, self._echo_text(choice), prompt_part, None)
            if req.logprobs is not None:
                start = sent_logprobs[choice.index]
                new = choice.logprobs[start:]
                sent_logprobs[choice.index] = len(choice.logprobs)
                if new:
                    parts.append(builders[choice.index].block(new, choice.token_ids[start : start + len(new)]))
            delta = choice.stream_delta(stops)
            if delta or parts or choice.finish_reason:
                lp = merge_logprobs(parts) if req.logprobs is not None else None
                yield chunk(choice.index, delta, lp, choice.finish_reason)
        if req.include_usage:
            yield head.body([], usage=usage(prompt_tokens, sum(len(c.token_ids) for c in gen.choices)))

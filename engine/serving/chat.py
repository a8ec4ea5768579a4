"""POST /v1/chat/completions: the messages through the model's chat template, `n` choices, streamed or whole.

Without `max_tokens` (or `max_completion_tokens`) a choice may run to the context length. Streamed, the role goes
first for every choice, then the content as it becomes safe to send, then a chunk with the finish reason.
"""

from __future__ import annotations

import asyncio
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
from engine.serving.protocol import ChatCompletionRequest
from engine.serving.responses import ResponseHead, chat_logprobs, new_id, now, usage
from engine.serving.served_model import ServedModel


class ChatEndpoint:
    """The /v1/chat/completions handler over a served model."""

    def __init__(self, model: ServedModel):
        self.model = model

    async def _prompt(self, req: ChatCompletionRequest) -> list[int]:
        """The messages' token ids, rendered and tokenized on worker threads."""
        text = await asyncio.to_thread(self._render, req)
        # the template writes the special tokens itself; the tokenizer must not add a second BOS
        return await self.model.prompt_ids(text, "messages", add_special_tokens=False)

    def _render(self, req: ChatCompletionRequest) -> str:
        from jinja2 import TemplateError

        tokenizer = self.model.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise UserError(f"model {self.model.name!r} has no chat template; use /v1/completions with a text prompt")
        messages = [m.as_template_input() for m in req.messages]
        try:
            return tokenizer.apply_chat_template(
                messages, add_generation_prompt=req.add_generation_prompt, tokenize=False
            )
        except (TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            # the template is a function of the messages alone: whatever it raises is about them
            raise UserError(f"the model's chat template rejected the messages: {exc}", param="messages") from None

    def _logprobs(self, req: ChatCompletionRequest, entries: list) -> dict:
        return chat_logprobs(entries, self.model.token_text, self.model.token_name(req))

    async def chat_completions(self, req: ChatCompletionRequest, request: Request):
        """POST /v1/chat/completions: the messages through the model's chat template."""
        model = self.model
        model.check_model(req.model)
        req.check_supported()
        logprobs = req.logprobs_count()
        model.check_healthy()
        ids = await self._prompt(req)
        limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if limit is not None:
            model.check_context(
                "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens", limit, ids
            )
        choices = [Choice(i, ids, None) for i in range(req.n)]

        def max_tokens(_: Choice) -> int:
            return limit if limit is not None else max(1, model.max_model_len - len(ids))

        if logprobs is not None:
            model.check_logprobs_size("top_logprobs", logprobs, [max_tokens(c) for c in choices])

        gen = await model.generate(req, request, choices, max_tokens, logprobs, None, [0] * len(choices))
        rid, created = new_id("chatcmpl"), now()
        if req.stream:
            head = ResponseHead(rid, "chat.completion.chunk", created, model.name)
            return event_stream(gen, self._chunks(req, gen, head, logprobs is not None))
        if not await gen.run_to_end():
            return client_gone()

        def body() -> dict:
            head = ResponseHead(rid, "chat.completion", created, model.name)
            return head.body(
                [
                    {
                        "index": c.index,
                        "message": {"role": "assistant", "content": c.text},
                        "logprobs": self._logprobs(req, c.logprobs) if logprobs is not None else None,
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                    for c in choices
                ],
                usage=usage(len(ids), sum(len(c.token_ids) for c in choices)),
                **handoff_fields(choices, gen.export_handle),
                **speculative_fields(choices),
            )

        return await json_response(body)

    async def _chunks(
        self, req: ChatCompletionRequest, gen: Generation, head: ResponseHead, with_logprobs: bool
    ) -> AsyncIterator[dict]:
        stops = req.stop_list()
        sent_logprobs = {c.index: 0 for c in gen.choices}

        def chunk(index: int, delta: dict, logprobs: dict | None, finish: str | None) -> dict:
            item = {"index": index, "delta": delta, "logprobs": logprobs}
            return stream_chunk(head, gen, item, finish, req.include_usage)

        for choice in gen.choices:  # the role first, as OpenAI sends it
            yield chunk(choice.index, {"role": "assistant", "content": ""}, None, None)
        async for choice in gen.updates():
            logprobs = None
            if with_logprobs:
                new = choice.logprobs[sent_logprobs[choice.index] :]
                sent_logprobs[choice.index] = len(choice.logprobs)
                logprobs = self._logprobs(req, new) if new else None
            delta = choice.stream_delta(stops)
            if delta or logprobs:
                yield chunk(choice.index, {"content": delta}, logprobs, None)
            if choice.finish_reason:
                yield chunk(choice.index, {}, None, choice.finish_reason)
        if req.include_usage:
            prompt_tokens = len(gen.choices[0].prompt_ids)
            yield head.body([], usage=usage(prompt_tokens, sum(len(c.token_ids) for c in gen.choices)))

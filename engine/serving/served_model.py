"""What every OpenAI endpoint asks of the model being served: its name, tokenizer and context length, whether the
engine can take requests, and the checks and sampling parameters a generating request starts with."""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import Callable
from typing import Any, NoReturn

from engine.core.engine import prompt_too_long
from engine.serving.engine_loop import EngineLoop
from engine.serving.generation import Choice, Generation
from engine.serving.handoff import Claimed, PrefillLink, handle_for, own_fingerprint, wants_export
from engine.serving.protocol import MAX_LOGPROB_ENTRIES, context_overflow
from engine.serving.responses import ServerError, now


def _token_id_text(token_id: int) -> str:
    return f"token_id:{token_id}"


class ServedModel:
    """The served model behind an `EngineLoop`, as the endpoints see it."""

    def __init__(self, engine_loop: EngineLoop, name: str):
        self.engine_loop = engine_loop
        self.engine = engine_loop.engine
        self.name = name
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        # no token covers more characters of text than its vocabulary entry has (byte-level or sentencepiece)
        self.longest_token = max(map(len, self.tokenizer.get_vocab()))
        self.created = now()
        self.token_text = functools.lru_cache(maxsize=1 << 17)(self._decode_one)
        handoff = self.engine.handoff
        self.prefill_link = (
            PrefillLink(handoff.role.prefill_url, own_fingerprint(self.engine)) if (handoff.is_decode) else None
        )

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    @staticmethod
    def token_name(req: Any) -> Callable[[int], str] | None:
        """How logprobs name a token: "token_id:<id>" when the request asks so, else its text (None)."""
        return _token_id_text if req.return_tokens_as_token_ids else None

    def check_model(self, name: str | None) -> None:
        """A 404 for a request that names another model."""
        if name is not None and name != self.name:
            raise ServerError(
                404,
                f"model {name!r} does not exist; this server serves {self.name!r}",
                param="model",
                code="model_not_found",
            )

    def check_healthy(self) -> None:
        """A 503 while the server shuts down, a 500 once the engine has failed."""
        if not self.engine_loop.healthy:
            status = 500 if self.engine_loop.error else 503
            raise ServerError(status, self.engine_loop.unavailable_reason())

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The text's token ids, made on a worker thread: a long text must not stall the other clients."""
        return await asyncio.to_thread(lambda: self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    async def prompt_ids(
        self, text: str, param: str, prompt_number: int | None = None, add_special_tokens: bool = True
    ) -> list[int]:
        """A prompt's token ids; a 400 (context_length_exceeded) for a prompt that leaves no room in the context,
        before tokenizing a text too long to fit whatever its tokens."""
        if len(text) > self.longest_token * self.max_model_len:
            at_least = f"at least {math.ceil(len(text) / self.longest_token)}"
            self._too_long(prompt_too_long(at_least, self.max_model_len), param, prompt_number)
        ids = await self.tokenize(text, add_special_tokens)
        self.check_prompt(ids, param, prompt_number)
        return ids

    def check_prompt(self, ids: list[int], param: str, prompt_number: int | None = None) -> None:
        """A 400 (context_length_exceeded) for a prompt that fills the context alone."""
        if len(ids) >= self.max_model_len:
            self._too_long(prompt_too_long(str(len(ids)), self.max_model_len), param, prompt_number)

    def check_context(self, name: str, max_tokens: int, ids: list[int], prompt_number: int | None = None) -> None:
        """A 400 like vLLM's when the prompt and `max_tokens` new tokens do not fit in max_model_len."""
        message = context_overflow(name, max_tokens, len(ids), self.max_model_len)
        if message is not None:
            self._too_long(message, name, prompt_number)

    @staticmethod
    def check_logprobs_size(param: str, top: int, tokens: list[int]) -> None:
        """A 400 when the response would list more logprobs than one response may carry (`tokens`: each choice's
        tokens with logprobs, at most; `top`: the alternatives listed with each)."""
        entries = sum(tokens) * (top + 1)
        if entries > MAX_LOGPROB_ENTRIES:
            raise ServerError(
                400,
                f"{param}={top} for {len(tokens)} choices of up to {max(tokens)} tokens is {entries} logprobs, more "
                f"than the {MAX_LOGPROB_ENTRIES} one response may carry; lower {param}, n or max_tokens, or split "
                "the request",
                param=param,
            )

    @staticmethod
    def _too_long(message: str, param: str, prompt_number: int | None) -> NoReturn:
        prefix = f"prompt {prompt_number}: " if prompt_number is not None else ""
        raise ServerError(400, prefix + message, param=param, code="context_length_exceeded")

    async def generate(
        self,
        req: Any,
        request: Any,
        choices: list[Choice],
        max_tokens: Callable[[Choice], int],
        logprobs: int | None,
        prompt_logprobs: int | None,
        prompt_numbers: list[int],
    ) -> Generation:
        """Start the engine requests of `choices` (one sampling-parameter set each) and return their generation."""
        stop_token_ids = self._stop_token_ids(req.stop_token_ids)
        params = []
        for choice in choices:
            p = req.sampling_params(max_tokens(choice), logprobs, prompt_logprobs, stop_token_ids)
            if req.n > 1 and p.seed is not None:
                p.seed += choice.index % req.n  # n samples of one seeded request differ, reproducibly
            params.append(p)
        kv_params = getattr(req, "kv_transfer_params", None)
        if kv_params is not None:
            await self._hand_off(kv_params, req, choices, prompt_numbers, prompt_logprobs)
        gen = Generation(
            self.engine_loop,
            request,
            choices,
            params,
            prompt_numbers,
            self.prefill_link,
            self.export_handle,
            stream=bool(req.stream),
        )
        try:
            await gen.start()
        except BaseException:
            gen.close()
            raise
        return gen

    def _stop_token_ids(self, ids: list[int] | None) -> frozenset[int]:
        """A request's stop token ids as a set; a 400 for an id outside the vocabulary."""
        held = frozenset(ids or ())
        vocab = self.engine.runner.vocab_size
        if held and (min(held) < 0 or max(held) >= vocab):
            bad = min(held) if min(held) < 0 else max(held)
            raise ServerError(400, f"stop_token_ids must be in 0..{vocab - 1} (got {bad})", param="stop_token_ids")
        return held

    def export_handle(self, export: dict) -> dict:
        """A prefill instance's handle for one kept export."""
        handoff = self.engine.handoff
        return handle_for(export, handoff.info.engine_id, handoff.role.lease_s, handoff.info.tp)

    async def _hand_off(
        self, kv_params: Any, req: Any, choices: list[Choice], prompt_numbers: list[int], prompt_logprobs: int | None
    ) -> None:
        """Mark the choices as exports (a prefill instance) or claim their prompts' exports (a decode instance)."""
        if wants_export(kv_params):
            if req.n != 1:
                raise ServerError(400, "a prefill request for a decode instance takes n=1", param="n")
            for choice in choices:
                choice.export_requested = True
            return
        if self.prefill_link is None:
            raise ServerError(
                400,
                "kv_transfer_params: this instance is not the decode instance of a P/D deployment; "
                "send the request without them",
                param="kv_transfer_params",
            )
        if prompt_logprobs is not None:
            raise ServerError(400, "echo with logprobs needs the prompt computed here; send it without a hand-off")
        prompts = max(prompt_numbers) + 1
        handles = kv_params if isinstance(kv_params, list) else [kv_params]
        if len(handles) != prompts:
            raise ServerError(
                400,
                f"kv_transfer_params has {len(handles)} handles for {prompts} prompts; send one per prompt",
                param="kv_transfer_params",
            )
        claimed: dict[int, Claimed] = {}
        try:
            for choice, number in zip(choices, prompt_numbers, strict=True):
                if number not in claimed:
                    claimed[number] = await self.prefill_link.claim(handles[number], choice.prompt_ids)
                choice.claimed = claimed[number]
        except BaseException:
            for c in claimed.values():
                self.prefill_link.release_later(c.remote.manifest.transfer_id)
            raise

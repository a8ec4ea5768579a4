"""What every OpenAI endpoint asks of the model being served: its name, tokenizer and context length, whether the
engine can take requests, and the checks and sampling parameters a generating request starts with."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from engine.serving.engine_loop import EngineLoop
from engine.serving.generation import Choice, Generation
from engine.serving.protocol import context_overflow
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
        self.created = now()
        self.token_text = functools.lru_cache(maxsize=1 << 17)(self._decode_one)

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

    def check_context(self, name: str, max_tokens: int, ids: list[int], prompt_number: int | None = None) -> None:
        """A 400 like vLLM's when the prompt and `max_tokens` new tokens do not fit in max_model_len."""
        message = context_overflow(name, max_tokens, len(ids), self.max_model_len)
        if message is not None:
            prefix = f"prompt {prompt_number}: " if prompt_number is not None else ""
            raise ServerError(400, prefix + message, param=name, code="context_length_exceeded")

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
        params = []
        for choice in choices:
            p = req.sampling_params(max_tokens(choice), logprobs, prompt_logprobs)
            if req.n > 1 and p.seed is not None:
                p.seed += choice.index % req.n  # n samples of one seeded request differ, reproducibly
            params.append(p)
        gen = Generation(self.engine_loop, request, choices, params, prompt_numbers)
        await gen.start()
        return gen

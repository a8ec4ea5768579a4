"""OpenAI-compatible request models and response pieces for the server (plain data, no threads, no torch).

Requests accept what the OpenAI and vLLM clients send; unknown fields are ignored, but known sampling
options the engine cannot honour (penalties, logit_bias, best_of, ...) are rejected with a 400 rather than
silently changing the results.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from engine.errors import UserError
from engine.sequence import SamplingParams, TokenLogprob

MAX_N = 128  # choices per prompt; more is almost surely a client bug and would flood the batch


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class _Request(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    # vLLM extensions
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:<id>" (distinct ids never collide)
    # known options the engine does not implement: accepted only at their neutral values
    best_of: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = None
    min_p: float | None = None

    def check_supported(self) -> None:
        """UserError for an option set to a value the engine cannot honour."""
        neutral = {
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "repetition_penalty": 1.0,
            "min_tokens": 0,
            "min_p": 0.0,
        }
        for name, value in neutral.items():
            got = getattr(self, name)
            if got is not None and got != value:
                raise UserError(f"{name}={got} is not supported by this server; leave it unset (or {value})")
        if self.best_of is not None and self.best_of != self.n:
            raise UserError(f"best_of={self.best_of} is not supported; leave it unset and use n for several choices")
        if self.logit_bias:
            raise UserError("logit_bias is not supported by this server; leave it unset")
        if not 1 <= self.n <= MAX_N:
            raise UserError(f"n={self.n} must be between 1 and {MAX_N}")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None) -> SamplingParams:
        """The engine's parameters for one choice (validated by the engine when the request is added)."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            seed=self.seed,
            stop=self.stop_list(),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )


class CompletionRequest(_Request):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise UserError("suffix is not supported by this server; leave it unset")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None

    def as_template_input(self) -> dict[str, Any]:
        """The message as a chat template expects it: content a plain string (text parts joined)."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            texts = []
            for part in self.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise UserError(
                        f"message content part of type {part.get('type')!r} is not supported; send text parts only"
                    )
                texts.append(part["text"])
            message["content"] = "".join(texts)
        elif self.content is None:
            message["content"] = ""
        return message


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True  # vLLM extension

    def logprobs_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise UserError("top_logprobs needs logprobs=true")
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


# ---- responses ----


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object."""
    kind = {400: "invalid_request_error", 404: "invalid_request_error", 503: "service_unavailable"}.get(
        status, "invalid_request_error" if status < 500 else "server_error"
    )
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def stop_holdback(text: str, stops: list[str]) -> int:
    """Length of the longest end of `text` that could be the start of a stop string (not yet safe to send)."""
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best


@dataclass
class CompletionLogprobs:
    """The legacy completions `logprobs` object, built incrementally (prompt tokens first with echo).

    `token_text` gives a token's text (for `text_offset`); `token_name` how it is listed (default: its text).
    """

    token_text: Callable[[int], str]
    token_name: Callable[[int], str] | None = None
    offset: int = 0  # text offset of the next token

    def block(self, entries: list[TokenLogprob | None], ids: list[int]) -> dict:
        """`tokens`, `token_logprobs`, `top_logprobs`, `text_offset` for `ids` (entry None: no logprob)."""
        name = self.token_name or self.token_text
        tokens, values, tops, offsets = [], [], [], []
        for token_id, entry in zip(ids, entries, strict=True):
            tokens.append(name(token_id))
            offsets.append(self.offset)
            self.offset += len(self.token_text(token_id))
            if entry is None:
                values.append(None)
                tops.append(None)
                continue
            values.append(entry.logprob)
            # the chosen token is always listed (as vLLM does); ids that decode alike share a key, which keeps
            # the larger logprob: lm-eval's greedy check (chosen == max of top) then stays right
            top: dict[str, float] = {}
            for i, lp in [*entry.top, (token_id, entry.logprob)]:
                key = name(i)
                top[key] = max(lp, top.get(key, lp))
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def merge_logprobs(parts: list[dict]) -> dict | None:
    """Concatenate completions logprobs blocks (prompt part, then generated part)."""
    if not parts:
        return None
    merged: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for part in parts:
        for key, values in merged.items():
            values.extend(part[key])
    return merged


def chat_logprobs(
    entries: list[TokenLogprob], token_text: Callable[[int], str], token_name: Callable[[int], str] | None = None
) -> dict:
    """The chat completions `logprobs` object: `{"content": [...]}`, one item per generated token."""
    name = token_name or token_text

    def item(token_id: int, logprob: float) -> dict:
        return {"token": name(token_id), "logprob": logprob, "bytes": list(token_text(token_id).encode("utf-8"))}

    return {
        "content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(i, lp) for i, lp in e.top]} for e in entries]
    }

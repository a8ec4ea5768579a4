"""The pieces of OpenAI-compatible responses: error bodies (and the error that carries one), ids, usage, logprobs
objects, and how much streamed text to hold back while it could still become a stop string (plain data)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.core.sequence import TokenLogprob


class ServerError(Exception):
    """An error with an HTTP status, sent to the client in OpenAI's error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code
        self.headers = headers  # e.g. a 503's Retry-After


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object."""
    kind = {400: "invalid_request_error", 404: "invalid_request_error", 503: "service_unavailable"}.get(
        status, "invalid_request_error" if status < 500 else "server_error"
    )
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass(frozen=True)
class ResponseHead:
    """The fields every body of one response starts with: its id, object kind, creation time and model."""

    id: str
    object: str
    created: int
    model: str

    def body(self, choices: list[dict], **extra: Any) -> dict:
        head = {"id": self.id, "object": self.object, "created": self.created, "model": self.model}
        return {**head, "choices": choices, **extra}


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
    """Length of the longest end of `text` that could be the start of a stop string (not yet safe to send).

    Only the last len(stop) - 1 characters can start a stop: the places there that hold the stop's first character
    are tried in turn, longest end first, so the work grows with the stops' lengths, not with the text's.
    """
    best = 0
    for stop in stops:
        start = text.find(stop[0], max(0, len(text) - len(stop) + 1))
        while start != -1 and len(text) - start > best:
            if stop.startswith(text[start:]):
                best = len(text) - start
                break
            start = text.find(stop[0], start + 1)
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

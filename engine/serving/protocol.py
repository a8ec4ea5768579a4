"""OpenAI-compatible request models and their validation (plain data, no threads, no torch).

The request models are what FastAPI's OpenAPI document (`/openapi.json`) shows clients. Requests accept what the
OpenAI and vLLM clients send; unknown fields are ignored, but known sampling options the engine cannot honour
(penalties, logit_bias, best_of, ...) are rejected with a 400 rather than silently changing the results. Numbers
must be finite (Python's JSON parser takes NaN and Infinity) and within their documented ranges.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.core.sequence import MAX_LOGPROBS, SEED_RANGE, SamplingParams
from engine.errors import UserError

MAX_N = 128  # choices per prompt; more is almost surely a client bug and would flood the batch
MAX_CHOICES = 4096  # prompts x n of one request: each is a sequence the engine holds until it finishes
MAX_LOGPROB_ENTRIES = 2**21  # choices x tokens x (top logprobs + 1) of a response: ~45 MB of JSON
MAX_STOPS = 64  # stop strings of a request (OpenAI takes 4): every one is looked for after every token
MAX_STOP_CHARS = 256  # characters of one stop string: streaming holds back up to this much text
MAX_BODY_BYTES = 32 * 2**20  # a request body; a max_model_len prompt of token ids is well under 1 MiB
ROLES = ("system", "user", "assistant", "tool", "function", "developer")  # OpenAI's chat roles

# finite numbers only, no coercion between JSON types ("3" is no integer, true no number), unknown fields ignored
_REQUEST_CONFIG = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)


_StopString = Annotated[str, Field(min_length=1)]


def _unsupported(neutral: float, also: str = "") -> Any:
    """A known OpenAI/vLLM option the engine does not implement: documented (and accepted) at its neutral value."""
    note = f"not supported: only {neutral}{' ' + also if also else ''} (or unset)"
    return Field(None, description=note, json_schema_extra={"enum": [neutral, None]})


class StreamOptions(BaseModel):
    model_config = _REQUEST_CONFIG

    include_usage: bool = False


class _Request(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = _REQUEST_CONFIG

    model: str | None = None
    temperature: float | None = Field(None, ge=0, description="0 is greedy (the default is 1)")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="-1 or 0: off")
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: _StopString | list[_StopString] | None = None
    seed: int | None = Field(None, ge=SEED_RANGE[0], lt=SEED_RANGE[1])
    # vLLM extensions
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:<id>" (distinct ids never collide)
    kv_transfer_params: dict[str, Any] | list[dict[str, Any]] | None = Field(
        None,
        description="P/D hand-off: {do_remote_decode: true} asks a prefill instance to keep the prompt's KV; the "
        "handle it answers with (one per prompt) lets its decode instance continue the request",
    )
    # known options the engine does not implement: accepted only at their neutral values
    best_of: int | None = _unsupported(1, "or equal to n")
    presence_penalty: float | None = _unsupported(0)
    frequency_penalty: float | None = _unsupported(0)
    repetition_penalty: float | None = _unsupported(1)
    logit_bias: dict[str, float] | None = Field(
        None, description="not supported: only {} (or unset)", json_schema_extra={"maxProperties": 0}
    )
    min_tokens: int | None = _unsupported(0)
    min_p: float | None = _unsupported(0)

    def check_supported(self) -> None:
        """UserError for an option set to a value the engine cannot honour, or stop strings beyond the limits."""
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
            raise UserError("logit_bias is not supported by this server; leave it unset", param="logit_bias")
        stops = self.stop_list()
        if len(stops) > MAX_STOPS:
            raise UserError(f"stop has {len(stops)} strings; this server takes at most {MAX_STOPS}", param="stop")
        for number, stop in enumerate(stops):
            if len(stop) > MAX_STOP_CHARS:
                where = f"stop.{number}" if isinstance(self.stop, list) else "stop"
                raise UserError(
                    f"{where} has {len(stop)} characters; this server takes stop strings of at most {MAX_STOP_CHARS}",
                    param="stop",
                )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def sampling_params(
        self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None, stop_token_ids: frozenset[int]
    ) -> SamplingParams:
        """The engine's parameters for one choice (validated by the engine when the request is added); the stop token
        ids are the request's, checked against the vocabulary."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            seed=self.seed,
            stop=self.stop_list(),
            stop_token_ids=stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )


class CompletionRequest(_Request):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="text, a list of texts, token ids, or a list of token-id lists"
    )
    max_tokens: int | None = Field(16, ge=0, description="at most the context length minus the prompt's tokens")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    return_token_ids: bool = False  # vLLM extension: the response carries prompt_token_ids and each choice's token_ids
    suffix: str | None = Field(
        None, description="not supported: only empty (or unset)", json_schema_extra={"enum": ["", None]}
    )

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise UserError("suffix is not supported by this server; leave it unset", param="suffix")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)  # extra fields (name, ...) go to the template

    role: Literal[ROLES]
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
    max_tokens: int | None = Field(None, ge=0, description="default: up to the context length")
    max_completion_tokens: int | None = Field(None, ge=0, description="OpenAI's newer name for max_tokens")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True  # vLLM extension

    def logprobs_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise UserError("top_logprobs needs logprobs=true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    model_config = _REQUEST_CONFIG

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = _REQUEST_CONFIG

    model: str | None = None
    tokens: list[int]


class TransferRequest(BaseModel):
    """POST /v1/kv_transfer/claim and /release (a decode instance to its prefill instance)."""

    model_config = _REQUEST_CONFIG

    transfer_id: str = Field(max_length=64)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error shape: the body of every 4xx and 5xx answer."""

    error: ErrorDetail


# ---- request validation ----


def parse_json_body(body: bytes) -> Any:
    """A request body as JSON; UserError (one line) for invalid UTF-8, invalid JSON, nesting too deep to parse, or
    a string that is not valid Unicode."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(
            f"the request body is not UTF-8 (byte {body[exc.start]:#04x} at offset {exc.start}); send UTF-8 JSON"
        ) from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"the request body is not valid JSON ({exc}); send a JSON object") from None
    except RecursionError:
        raise UserError("the request body nests JSON too deeply to parse; send a JSON object of plain fields") from None
    if _ESCAPED_SURROGATE.search(text):  # UTF-8 text has none: only a \u escape can make one
        _check_unicode(value)
    return value


_ESCAPED_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _check_unicode(value: Any) -> None:
    """UserError naming the first string (key or value) with a lone UTF-16 surrogate, which UTF-8 cannot encode."""
    stack: list[tuple[list[str], Any]] = [([], value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, dict):
            for key, child in reversed(item.items()):
                stack.append(([*path, key], key))
                stack.append(([*path, key], child))
        elif isinstance(item, list):
            stack.extend(([*path, str(i)], child) for i, child in reversed(list(enumerate(item))))
        elif isinstance(item, str) and (bad := _SURROGATE.search(item)):
            where = ".".join(path) or "the request body"
            raise UserError(
                f"{where} is not valid Unicode: it has a lone UTF-16 surrogate (\\u{ord(bad.group()):04x} at "
                f"character {bad.start()}), which cannot be encoded as UTF-8; send valid Unicode text",
                param=path[0] if path else None,
            )


_UNION_FIELDS = {  # what to say for a field that takes several forms (pydantic reports one error per form)
    "prompt": "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "stop must be a non-empty string or a list of non-empty strings",
}


def _is_union_tag(part: str) -> bool:
    """pydantic names the member of a union that failed in an error's location ('str', 'list[int]', ...)."""
    return part in ("str", "int", "float", "bool") or "[" in part or "-" in part


def _error_line(err: dict) -> tuple[str | None, str]:
    """(the top-level field, one line) for one pydantic error."""
    path: list[str] = []
    for part in err.get("loc", ()):
        if isinstance(part, int):
            path.append(str(part))
        elif part == "body" and not path:
            continue
        elif _is_union_tag(part):
            break
        else:
            path.append(part)
    if not path:
        if err.get("type") == "missing":
            return None, "the request body is empty; send a JSON object"
        return None, "the request body must be a JSON object (sent with Content-Type: application/json)"
    root, where = path[0], ".".join(path)
    if root in _UNION_FIELDS:
        return root, _UNION_FIELDS[root]
    value = err.get("input")
    if err.get("type") != "missing" and isinstance(value, str | int | float | bool):
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        return root, f"{where}={shown}: {err.get('msg')}"
    return root, f"{where}: {err.get('msg')}"


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """One line from pydantic errors ('invalid request: field=value: problem; ...') and the first field's name."""
    parts: list[str] = []
    roots: list[str | None] = []
    for err in errors:
        root, line = _error_line(err)
        if root in roots:
            continue
        roots.append(root)
        parts.append(line)
    return "invalid request: " + "; ".join(parts[:4]), roots[0] if roots else None


def context_overflow(name: str, max_tokens: int, prompt_tokens: int, max_model_len: int) -> str | None:
    """Why `max_tokens` new tokens cannot follow a prompt of `prompt_tokens` in the context, or None if they fit.

    A prompt that fills the context alone is the engine's to report (its message names both numbers).
    """
    if prompt_tokens >= max_model_len or prompt_tokens + max_tokens <= max_model_len:
        return None
    return (
        f"{name}={max_tokens} is too large: the prompt has {prompt_tokens} token{'s' * (prompt_tokens != 1)} "
        "and the context length "
        f"(max_model_len) is {max_model_len}, so at most {max_model_len - prompt_tokens} new tokens fit; "
        f"lower {name}"
    )

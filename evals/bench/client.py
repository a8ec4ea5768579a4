"""An async streaming client for `/v1/completions`: closed-loop concurrency or Poisson arrivals, timestamps only.

Every request is sent once (no retries) with `stream=true`, greedy, `max_tokens=output_len` and `ignore_eos=true`
(a vLLM extension our server supports; a server that ignores it may stop early at EOS, which shows as fewer
output tokens). A token "arrives" with each streamed chunk that carries text: a server may hold back a token
whose text is incomplete (a partial UTF-8 character) and send it with the next one, so chunks can be fewer than
tokens. The output token count is the server's `usage.completion_tokens` when it reports one.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

DEFAULT_TIMEOUT_S = 600.0  # per read: the longest a request may wait for its next chunk


@dataclass
class RequestRecord:
    """One request's timeline, in seconds on the run's clock (0 = the run's start)."""

    index: int
    prompt_len: int
    send_time: float = 0.0
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # arrival of each chunk with text
    end_time: float | None = None
    output_tokens: int = 0
    error: str | None = None
    kv_transfer: dict[str, Any] | None = None  # a P/D deployment: what the request's hand-off did

    @property
    def ok(self) -> bool:
        return self.error is None and self.first_token_time is not None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.send_time

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "prompt_len": self.prompt_len,
            "send_time": self.send_time,
            "first_token_time": self.first_token_time,
            "token_times": self.token_times,
            "end_time": self.end_time,
            "output_tokens": self.output_tokens,
            "error": self.error,
            "kv_transfer": self.kv_transfer,
        }


@dataclass
class RunResult:
    """All requests of one measured run and its wall time (first send to last response)."""

    records: list[RequestRecord]
    duration_s: float


def arrival_times(num: int, request_rate: float | None, seed: int) -> list[float]:
    """When each request may be sent (seconds after the start): all at 0 without a rate, else a Poisson process."""
    if request_rate is None or request_rate == float("inf"):
        return [0.0] * num
    gaps = np.random.default_rng([seed, 2]).exponential(1.0 / request_rate, size=num)
    gaps[0] = 0.0
    return [float(t) for t in np.cumsum(gaps)]


def completion_body(model: str | None, prompt: list[int], output_len: int, ignore_eos: bool = True) -> dict[str, Any]:
    """The streamed, greedy /v1/completions request for one prompt."""
    body: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True
    if model is not None:
        body["model"] = model
    return body


def _error_text(status: int, body: bytes) -> str:
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode(errors="replace")[:200]
    return f"HTTP {status}: {message}"


async def _one(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], rec: RequestRecord, clock: Callable[[], float]
) -> None:
    chunks = 0
    try:
        rec.send_time = clock()
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                rec.error = _error_text(resp.status_code, await resp.aread())
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.error = f"stream error: {chunk['error'].get('message', chunk['error'])}"
                    return
                t = clock()
                if any(c.get("text") for c in chunk.get("choices") or []):
                    chunks += 1
                    rec.token_times.append(t)
                    if rec.first_token_time is None:
                        rec.first_token_time = t
                if chunk.get("kv_transfer"):  # a P/D deployment's decode side: the hand-off's split
                    rec.kv_transfer = chunk["kv_transfer"][0]
                usage = chunk.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    rec.output_tokens = int(usage["completion_tokens"])
        rec.end_time = clock()
        if rec.output_tokens == 0:
            rec.output_tokens = chunks
        if rec.first_token_time is None:
            rec.error = "the stream ended without any output text"
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as exc:
        rec.error = f"{type(exc).__name__}: {str(exc)[:200]}"


async def run_requests_async(
    base_url: str,
    model: str | None,
    prompts: list[list[int]],
    output_len: int,
    *,
    concurrency: int | None,
    request_rate: float | None = None,
    seed: int = 0,
    ignore_eos: bool = True,
    on_done: Callable[[RequestRecord], None] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    extra_fields: dict[str, Any] | None = None,
) -> RunResult:
    """Send every prompt once; at most `concurrency` in flight (None: no limit), sent at `arrival_times`.
    `extra_fields` go into every request body (e.g. logprobs)."""
    url = f"{base_url.rstrip('/')}/v1/completions"
    limit = concurrency or len(prompts)
    semaphore = asyncio.Semaphore(limit)
    records = [RequestRecord(index=i, prompt_len=len(p)) for i, p in enumerate(prompts)]
    arrivals = arrival_times(len(prompts), request_rate, seed)
    timeout = httpx.Timeout(timeout_s, connect=30.0)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    start = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - start

    async def task(rec: RequestRecord, prompt: list[int], at: float) -> None:
        delay = at - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        async with semaphore:
            body = completion_body(model, prompt, output_len, ignore_eos) | (extra_fields or {})
            await _one(client, url, body, rec, clock)
        if on_done is not None:
            on_done(rec)

    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        await asyncio.gather(*(task(r, p, t) for r, p, t in zip(records, prompts, arrivals, strict=True)))
    ends = [r.end_time for r in records if r.end_time is not None]
    return RunResult(records=records, duration_s=max(ends, default=clock()))


def run_requests(
    base_url: str,
    model: str | None,
    prompts: list[list[int]],
    output_len: int,
    **kwargs: Any,
) -> RunResult:
    """`run_requests_async` on a fresh event loop (the command itself is synchronous)."""
    return asyncio.run(run_requests_async(base_url, model, prompts, output_len, **kwargs))

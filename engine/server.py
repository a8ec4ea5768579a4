"""The OpenAI-compatible HTTP server on rank 0: a FastAPI app, one engine thread, uvicorn.

Threads: uvicorn's event loop runs the request handlers; one engine thread owns the `LLMEngine` (not
thread-safe) and loops `step()` while there is work, sleeping on a condition variable when idle. Handlers hand
requests to the engine thread through `EngineLoop`'s inbox and get per-step updates on an asyncio.Queue that the
engine thread feeds with `loop.call_soon_threadsafe`. All requests in flight share the scheduler's batch.

A handler that ends early (the client disconnected, the task was cancelled) aborts its engine requests, which
frees their KV blocks. A request whose sampling or detokenization fails gets a 500 (an error event when streamed)
and the others go on; an exception in the engine thread itself (a step, a rank, a collective) fails every request
in flight with a 500 and marks the server unhealthy. User errors are 4xx in OpenAI's error shape and never stop
the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import re
import signal
import socket
import sys
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.api_http import ERROR_RESPONSES, BodyLimitMiddleware, JSONRoute, document_400_not_422
from engine.api_protocol import (
    MAX_BODY_BYTES,
    MAX_CHOICES,
    ChatCompletionRequest,
    CompletionLogprobs,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    chat_logprobs,
    context_overflow,
    error_body,
    merge_logprobs,
    new_id,
    now,
    stop_holdback,
    usage,
    validation_message,
)
from engine.errors import UserError
from engine.sequence import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from engine.engine_core import LLMEngine
    from engine.plan.checks import PlanReport

logger = logging.getLogger("dcpctl.server")

SHUTDOWN_GRACE_S = 5  # uvicorn waits this long for connections after in-flight requests were failed


class ServerError(Exception):
    """An error with an HTTP status, sent to the client in OpenAI's error shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code


class _ClientGone(Exception):
    """The HTTP client disconnected before its response was complete."""


_DISCONNECTED = object()


@dataclass
class Update:
    """What one engine request produced since its previous update (sent from the engine thread)."""

    index: int  # the choice index within its HTTP request
    text: str  # the whole output text so far (stop strings already cut off)
    token_ids: list[int]  # new output token ids
    logprobs: list[TokenLogprob]  # logprobs of the new output tokens (when asked for)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # once, with the first update (when asked for)
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    error: ServerError | None = None


class _Sink:
    """Where the engine thread delivers one HTTP request's updates: an asyncio.Queue on the handler's loop."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item: object) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop is already closed (process shutdown)
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def resolve(self, future: asyncio.Future, error: BaseException | None) -> None:
        def _set() -> None:
            if future.done():
                return
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)

        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(_set)


@dataclass
class _Item:
    request_id: str
    index: int  # choice index
    prompt_number: int  # which prompt of the HTTP request (for error messages)
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class _Submission:
    items: list[_Item]
    sink: _Sink
    accepted: asyncio.Future
    numbered: bool  # more than one prompt: errors name the prompt


@dataclass
class _Handle:
    index: int
    sink: _Sink
    sent_tokens: int = 0
    sent_logprobs: int = 0
    sent_prompt: bool = False


class EngineLoop:
    """Owns an `LLMEngine` and drives it from one thread; the thread-safe face the request handlers use."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._cv = threading.Condition()
        self._inbox: list[tuple[str, Any]] = []
        self._stopping = False
        self._closed = False
        self._handles: dict[str, _Handle] = {}  # engine thread only
        self.error: str | None = None  # set when the engine failed
        self.stats: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._run, name="dcpctl-engine", daemon=True)

    # ---- handler side (any thread) ----

    def start(self) -> EngineLoop:
        self._snapshot()
        self._thread.start()
        return self

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread.is_alive() and not self._stopping

    def unavailable_reason(self) -> str:
        if self.error is not None:
            return f"the engine failed ({self.error}); restart the server"
        return "the server is shutting down"

    async def add(self, items: list[_Item], sink: _Sink, numbered: bool) -> None:
        """Queue a group of requests; raises UserError (none of them were added) or ServerError."""
        accepted = sink.loop.create_future()
        with self._cv:
            if self._closed or self._stopping:
                raise ServerError(503, self.unavailable_reason())
            self._inbox.append(("add", _Submission(items, sink, accepted, numbered)))
            self._cv.notify()
        try:
            await accepted
        except BaseException:
            self.abort([item.request_id for item in items])
            raise

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests (finished or unknown ids are ignored); their blocks are freed before the next step."""
        with self._cv:
            if not self._closed:
                self._inbox.append(("abort", list(request_ids)))
                self._cv.notify()

    def begin_shutdown(self) -> None:
        """Fail every request in flight with 503 and stop the engine thread (it then shuts the engine down)."""
        with self._cv:
            self._stopping = True
            self._cv.notify()

    def stop(self, timeout: float = 30.0) -> None:
        """begin_shutdown() and wait for the engine thread; idempotent."""
        self.begin_shutdown()
        if self._thread.is_alive():
            self._thread.join(timeout)
        elif not self._thread.ident:  # never started: shut the engine down here
            self._shutdown_engine()

    # ---- engine thread ----

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (self._inbox or self._stopping or self.engine.has_unfinished()):
                        self._cv.wait()
                    commands, self._inbox = self._inbox, []
                    stopping = self._stopping
                for kind, payload in commands:
                    if kind == "add":
                        self._add(payload)
                    else:
                        for request_id in payload:
                            self.engine.abort(request_id)
                            self._handles.pop(request_id, None)
                if stopping:
                    break
                if self.engine.has_unfinished():
                    self._publish(self.engine.step())
                self._snapshot()
        except Exception as exc:
            logger.exception("the engine failed; failing the requests in flight")
            self.error = f"{type(exc).__name__}: {exc}"
            self._fail_all(ServerError(500, f"the engine failed: {self.error}; see the server log"))
        finally:
            with self._cv:
                self._closed = True
                leftovers, self._inbox = self._inbox, []
            error = ServerError(503 if self.error is None else 500, self.unavailable_reason())
            for kind, payload in leftovers:
                if kind == "add":
                    payload.sink.resolve(payload.accepted, error)
            self._fail_all(error)
            self._shutdown_engine()

    def _add(self, sub: _Submission) -> None:
        added: list[str] = []
        try:
            for item in sub.items:
                self.engine.add_request(item.prompt_ids, item.params, request_id=item.request_id)
                added.append(item.request_id)
                self._handles[item.request_id] = _Handle(item.index, sub.sink)
        except Exception as exc:
            for request_id in added:
                self.engine.abort(request_id)
                self._handles.pop(request_id, None)
            if isinstance(exc, UserError):
                message = f"prompt {item.prompt_number}: {exc}" if sub.numbered else str(exc)
                error: BaseException = UserError(message)
            else:
                logger.exception("adding a request failed")
                error = ServerError(500, f"adding the request failed: {type(exc).__name__}: {exc}")
            sub.sink.resolve(sub.accepted, error)
            return
        sub.sink.resolve(sub.accepted, None)

    def _publish(self, seqs: list) -> None:
        for seq in seqs:
            handle = self._handles.get(seq.request_id)
            if handle is None:
                continue
            new_ids = seq.token_ids[seq.num_prompt_tokens + handle.sent_tokens :]
            handle.sent_tokens += len(new_ids)
            new_logprobs = seq.logprobs[handle.sent_logprobs :]
            handle.sent_logprobs += len(new_logprobs)
            prompt_logprobs = None
            if not handle.sent_prompt:
                handle.sent_prompt = True
                if seq.params.prompt_logprobs is not None:
                    prompt_logprobs = list(seq.prompt_logprobs)
            finish = seq.finish_reason if seq.is_finished else None
            update = Update(handle.index, seq.output_text, new_ids, new_logprobs, prompt_logprobs, finish)
            if finish == "error":
                update.error = ServerError(500, f"the request failed: {seq.error}; the server goes on")
            elif finish is not None:
                update.stop_reason = seq.stop_reason
            handle.sink.put(update)
            if finish is not None:
                del self._handles[seq.request_id]

    def _fail_all(self, error: ServerError) -> None:
        for request_id, handle in list(self._handles.items()):
            with contextlib.suppress(Exception):
                self.engine.abort(request_id)
            handle.sink.put(Update(handle.index, "", [], [], error=error))
        self._handles.clear()

    def _shutdown_engine(self) -> None:
        try:
            self.engine.shutdown()
        except Exception:
            logger.exception("stopping the other ranks failed")
        else:
            logger.info("engine stopped")

    def _snapshot(self) -> None:
        """The engine's stats for the handlers (the engine itself is read on this thread only)."""
        self.stats = {**self.engine.stats(), "requests_in_flight": len(self._handles)}


# ---- one HTTP request's engine requests ----


@dataclass
class _Choice:
    index: int
    prompt_ids: list[int]
    prompt_text: str | None  # what echo prepends
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    sent: int = 0  # characters of text already streamed
    started: bool = False

    def apply(self, update: Update) -> None:
        self.text = update.text
        self.token_ids.extend(update.token_ids)
        self.logprobs.extend(update.logprobs)
        if update.prompt_logprobs is not None:
            self.prompt_logprobs = update.prompt_logprobs
        self.finish_reason = update.finish_reason
        self.stop_reason = update.stop_reason

    def stream_delta(self, stops: list[str]) -> str:
        """New text that is safe to send: all of it once finished, else all but a possible stop-string start."""
        end = len(self.text) if self.finish_reason else len(self.text) - stop_holdback(self.text, stops)
        if end <= self.sent:
            return ""
        delta = self.text[self.sent : end]
        self.sent = end
        return delta


class _Generation:
    """The engine requests behind one HTTP request, and the watch on its client."""

    def __init__(
        self,
        engine_loop: EngineLoop,
        request: Request,
        choices: list[_Choice],
        params: list[SamplingParams],
        prompt_numbers: list[int],
    ):
        self.engine_loop = engine_loop
        self.request = request
        self.choices = choices
        self.items = [
            _Item(new_id("req"), c.index, number, c.prompt_ids, p)
            for c, p, number in zip(choices, params, prompt_numbers, strict=True)
        ]
        self.sink: _Sink | None = None
        self._watch: asyncio.Task | None = None
        self._closed = False

    async def start(self) -> None:
        self.sink = _Sink()
        await self.engine_loop.add(self.items, self.sink, numbered=len(set(i.prompt_number for i in self.items)) > 1)
        self._watch = asyncio.ensure_future(self._watch_disconnect(self.request.receive, self.sink))

    @staticmethod
    async def _watch_disconnect(receive: Callable, sink: _Sink) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                sink.queue.put_nowait(_DISCONNECTED)
                return

    async def updates(self) -> AsyncIterator[_Choice]:
        """Yield the choice each update changed, until all are finished; raises _ClientGone or ServerError."""
        assert self.sink is not None
        pending = len(self.choices)
        while pending:
            update = await self.sink.queue.get()
            if update is _DISCONNECTED:
                raise _ClientGone
            if update.error is not None:
                raise update.error
            choice = self.choices[update.index]
            choice.apply(update)
            if update.finish_reason is not None:
                pending -= 1
            yield choice

    def close(self) -> None:
        """Abort whatever has not finished (synchronous, so it also runs in a cancelled generator's finally)."""
        if self._closed:
            return
        self._closed = True
        if self._watch is not None:
            self._watch.cancel()
        unfinished = [item.request_id for item, c in zip(self.items, self.choices, strict=True) if not c.finish_reason]
        if unfinished:
            self.engine_loop.abort(unfinished)


# ---- the app ----


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


_PARAM_RE = re.compile(r"^([a-z_]+)=")


def _user_error_response(exc: UserError):
    message = str(exc)
    match = _PARAM_RE.match(message)
    code = "context_length_exceeded" if "max_model_len" in message else None
    return JSONResponse(error_body(message, 400, match.group(1) if match else None, code), status_code=400)


def _server_error_response(exc: ServerError):
    return JSONResponse(error_body(str(exc), exc.status, exc.param, exc.code), status_code=exc.status)


class OpenAIServer:
    """The FastAPI app over an `EngineLoop`, with the request handlers."""

    def __init__(self, engine_loop: EngineLoop, model_name: str):
        self.engine_loop = engine_loop
        self.engine = engine_loop.engine
        self.model_name = model_name
        self.tokenizer = self.engine.tokenizer
        self.created = now()
        self._token_text = functools.lru_cache(maxsize=1 << 17)(self._decode_one)
        self.app = self._build_app()

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _token_name(self, req) -> Callable[[int], str] | None:
        return _token_id_text if req.return_tokens_as_token_ids else None

    # ---- plumbing ----

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="dcpctl", version="1", docs_url=None, redoc_url=None)
        app.router.route_class = JSONRoute
        app.add_middleware(BodyLimitMiddleware, limit=MAX_BODY_BYTES)

        @app.exception_handler(UserError)
        async def _user_error(_: Request, exc: UserError):
            return _user_error_response(exc)

        @app.exception_handler(ServerError)
        async def _server_error(_: Request, exc: ServerError):
            return _server_error_response(exc)

        @app.exception_handler(RequestValidationError)
        async def _invalid(_: Request, exc: RequestValidationError):
            message, param = validation_message(exc.errors())
            return JSONResponse(error_body(message, 400, param), status_code=400)

        @app.exception_handler(StarletteHTTPException)
        async def _http_error(_: Request, exc: StarletteHTTPException):
            return JSONResponse(error_body(str(exc.detail), exc.status_code), status_code=exc.status_code)

        @app.exception_handler(Exception)
        async def _unexpected(_: Request, exc: Exception):
            logger.error("unexpected error while handling a request", exc_info=exc)
            return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", 500), status_code=500)

        streamed = {200: {"content": {"text/event-stream": {}}, "description": "JSON, or server-sent events"}}
        app.get("/health")(self.health)
        app.get("/v1/models")(self.models)
        app.get("/v1/engine/stats")(self.engine_stats)
        app.get("/tokenizer_info")(self.tokenizer_info)
        app.post("/tokenize", responses=ERROR_RESPONSES)(self.tokenize)
        app.post("/detokenize", responses=ERROR_RESPONSES)(self.detokenize)
        app.post("/v1/completions", responses={**ERROR_RESPONSES, **streamed})(self.completions)
        app.post("/v1/chat/completions", responses={**ERROR_RESPONSES, **streamed})(self.chat_completions)
        document_400_not_422(app)
        return app

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ServerError(
                404,
                f"model {name!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def _check_healthy(self) -> None:
        if not self.engine_loop.healthy:
            status = 500 if self.engine_loop.error else 503
            raise ServerError(status, self.engine_loop.unavailable_reason())

    def _params(
        self,
        req,
        choices: list[_Choice],
        max_tokens: Callable[[_Choice], int],
        logprobs: int | None,
        prompt_logprobs: int | None,
    ) -> list[SamplingParams]:
        params = []
        for choice in choices:
            p = req.sampling_params(max_tokens(choice), logprobs, prompt_logprobs)
            if req.n > 1 and p.seed is not None:
                p.seed += choice.index % req.n  # n samples of one seeded request differ, reproducibly
            params.append(p)
        return params

    def _check_context(self, name: str, max_tokens: int, ids: list[int], prompt_number: int | None = None) -> None:
        """A 400 like vLLM's when the prompt and `max_tokens` new tokens do not fit in max_model_len."""
        message = context_overflow(name, max_tokens, len(ids), self.engine.max_model_len)
        if message is not None:
            prefix = f"prompt {prompt_number}: " if prompt_number is not None else ""
            raise ServerError(400, prefix + message, param=name, code="context_length_exceeded")

    # ---- small endpoints ----

    async def health(self):
        """200 while the engine runs; 503 after a fatal engine error or during shutdown."""
        if self.engine_loop.healthy:
            return {"status": "ok"}
        return JSONResponse({"status": "unhealthy", "error": self.engine_loop.unavailable_reason()}, status_code=503)

    async def models(self):
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "dcpctl",
                    "root": str(self.engine.config.model_path),
                    "max_model_len": self.engine.max_model_len,
                }
            ],
        }

    async def engine_stats(self):
        """KV blocks (used, free, peak), batch sizes and token counters, as of the engine's last iteration."""
        return {
            "model": self.model_name,
            "healthy": self.engine_loop.healthy,
            "max_model_len": self.engine.max_model_len,
            **self.engine_loop.stats,
        }

    async def tokenizer_info(self):
        """What lm-eval's remote tokenizer backend reads."""
        tok = self.tokenizer
        return {
            "eos_token": tok.eos_token,
            "bos_token": tok.bos_token,
            "pad_token": tok.pad_token,
            "chat_template": getattr(tok, "chat_template", None),
            "model_max_length": self.engine.max_model_len,
        }

    async def tokenize(self, req: TokenizeRequest):
        self._check_model(req.model)
        ids = self.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens).input_ids
        return {"tokens": ids, "count": len(ids), "max_model_len": self.engine.max_model_len}

    async def detokenize(self, req: DetokenizeRequest):
        self._check_model(req.model)
        vocab = len(self.tokenizer)
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise UserError(f"tokens must be in 0..{vocab - 1} (got {bad[0]})")
        return {"prompt": self.tokenizer.decode(req.tokens)}

    # ---- completions ----

    def _completion_prompts(self, prompt, n: int) -> list[tuple[list[int], str | None]]:
        if isinstance(prompt, list) and not prompt:
            raise UserError("prompt is an empty list; send a string, a list of strings or token ids")
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
            if isinstance(p, str):
                out.append((self.engine.tokenize(p), p))
            else:
                if not p:
                    where = f"prompt {number}" if len(prompts) > 1 else "the prompt"
                    raise UserError(f"{where} is an empty token list")
                out.append((list(p), None))
        return out

    async def completions(self, req: CompletionRequest, request: Request):
        """POST /v1/completions (legacy completions, what lm-eval's local-completions uses)."""
        self._check_model(req.model)
        req.check_supported()
        self._check_healthy()
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        prompts = self._completion_prompts(req.prompt, req.n)
        for number, (ids, _) in enumerate(prompts):
            self._check_context("max_tokens", max_tokens, ids, number if len(prompts) > 1 else None)
        choices, numbers = [], []
        for number, (ids, text) in enumerate(prompts):
            for _ in range(req.n):
                choices.append(_Choice(len(choices), ids, text))
                numbers.append(number)
        prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
        params = self._params(req, choices, lambda _: max_tokens, req.logprobs, prompt_logprobs)
        gen = _Generation(self.engine_loop, request, choices, params, numbers)
        await gen.start()
        rid, created = new_id("cmpl"), now()
        if req.stream:
            prompt_tokens = sum(len(ids) for ids, _ in prompts)
            return self._stream(gen, self._completion_chunks(req, gen, rid, created, prompt_tokens))
        try:
            async for _ in gen.updates():
                pass
        except _ClientGone:
            return _gone()
        finally:
            gen.close()
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": self.model_name,
            "choices": [self._completion_choice(req, c) for c in choices],
            "usage": usage(sum(len(ids) for ids, _ in prompts), sum(len(c.token_ids) for c in choices)),
        }

    def _echo_text(self, choice: _Choice) -> str:
        if choice.prompt_text is not None:
            return choice.prompt_text
        return self.tokenizer.decode(choice.prompt_ids, skip_special_tokens=False)

    def _prompt_logprob_block(self, builder: CompletionLogprobs, choice: _Choice) -> dict:
        entries = list(choice.prompt_logprobs or [])
        entries += [None] * (len(choice.prompt_ids) - len(entries))
        return builder.block(entries, choice.prompt_ids)

    def _completion_choice(self, req: CompletionRequest, choice: _Choice) -> dict:
        text = (self._echo_text(choice) if req.echo else "") + choice.text
        logprobs = None
        if req.logprobs is not None:
            builder = CompletionLogprobs(self._token_text, self._token_name(req))
            parts = [self._prompt_logprob_block(builder, choice)] if req.echo else []
            parts.append(builder.block(choice.logprobs, choice.token_ids[: len(choice.logprobs)]))
            logprobs = merge_logprobs(parts)
        return {
            "index": choice.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
        }

    def _stream_chunk(
        self, rid: str, kind: str, created: int, item: dict, gen: _Generation, finish: str | None, include_usage: bool
    ) -> dict:
        """One SSE body with a single choice; `usage` is null on all but the final usage chunk."""
        item["finish_reason"] = finish
        if finish is not None:
            item["stop_reason"] = gen.choices[item["index"]].stop_reason
        body = {"id": rid, "object": kind, "created": created, "model": self.model_name, "choices": [item]}
        if include_usage:
            body["usage"] = None
        return body

    async def _completion_chunks(
        self, req: CompletionRequest, gen: _Generation, rid: str, created: int, prompt_tokens: int
    ):
        stops = req.stop_list()
        builders = {c.index: CompletionLogprobs(self._token_text, self._token_name(req)) for c in gen.choices}
        sent_logprobs = dict.fromkeys(builders, 0)

        def chunk(index: int, text: str, logprobs: dict | None, finish: str | None) -> dict:
            item = {"index": index, "text": text, "logprobs": logprobs}
            return self._stream_chunk(rid, "text_completion", created, item, gen, finish, req.include_usage)

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
            yield {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": [],
                "usage": usage(prompt_tokens, sum(len(c.token_ids) for c in gen.choices)),
            }

    # ---- chat ----

    def _chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        from jinja2 import TemplateError

        if not getattr(self.tokenizer, "chat_template", None):
            raise UserError(f"model {self.model_name!r} has no chat template; use /v1/completions with a text prompt")
        messages = [m.as_template_input() for m in req.messages]
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=req.add_generation_prompt, tokenize=False
            )
        except (TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            # the template is a function of the messages alone: whatever it raises is about them
            raise UserError(f"the model's chat template rejected the messages: {exc}") from None
        # the template writes the special tokens itself; the tokenizer must not add a second BOS
        return self.tokenizer(text, add_special_tokens=False).input_ids

    async def chat_completions(self, req: ChatCompletionRequest, request: Request):
        """POST /v1/chat/completions: the messages through the model's chat template."""
        self._check_model(req.model)
        req.check_supported()
        logprobs = req.logprobs_count()
        self._check_healthy()
        ids = self._chat_prompt(req)
        limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if limit is not None:
            self._check_context(
                "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens", limit, ids
            )
        choices = [_Choice(i, ids, None) for i in range(req.n)]

        def max_tokens(_: _Choice) -> int:
            return limit if limit is not None else max(1, self.engine.max_model_len - len(ids))

        params = self._params(req, choices, max_tokens, logprobs, None)
        gen = _Generation(self.engine_loop, request, choices, params, [0] * len(choices))
        await gen.start()
        rid, created = new_id("chatcmpl"), now()
        if req.stream:
            return self._stream(gen, self._chat_chunks(req, gen, rid, created, logprobs is not None))
        try:
            async for _ in gen.updates():
                pass
        except _ClientGone:
            return _gone()
        finally:
            gen.close()
        return {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": self.model_name,
            "choices": [
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": chat_logprobs(c.logprobs, self._token_text, self._token_name(req))
                    if logprobs is not None
                    else None,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                for c in choices
            ],
            "usage": usage(len(ids), sum(len(c.token_ids) for c in choices)),
        }

    async def _chat_chunks(
        self, req: ChatCompletionRequest, gen: _Generation, rid: str, created: int, with_logprobs: bool
    ):
        stops = req.stop_list()
        sent_logprobs = {c.index: 0 for c in gen.choices}

        def chunk(index: int, delta: dict, logprobs: dict | None, finish: str | None) -> dict:
            item = {"index": index, "delta": delta, "logprobs": logprobs}
            return self._stream_chunk(rid, "chat.completion.chunk", created, item, gen, finish, req.include_usage)

        for choice in gen.choices:  # the role first, as OpenAI sends it
            yield chunk(choice.index, {"role": "assistant", "content": ""}, None, None)
        async for choice in gen.updates():
            logprobs = None
            if with_logprobs:
                new = choice.logprobs[sent_logprobs[choice.index] :]
                sent_logprobs[choice.index] = len(choice.logprobs)
                logprobs = chat_logprobs(new, self._token_text, self._token_name(req)) if new else None
            delta = choice.stream_delta(stops)
            if delta or logprobs:
                yield chunk(choice.index, {"content": delta}, logprobs, None)
            if choice.finish_reason:
                yield chunk(choice.index, {}, None, choice.finish_reason)
        if req.include_usage:
            yield {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.model_name,
                "choices": [],
                "usage": usage(len(gen.choices[0].prompt_ids), sum(len(c.token_ids) for c in gen.choices)),
            }

    # ---- streaming ----

    def _stream(self, gen: _Generation, chunks: AsyncIterator[dict]):
        async def body():
            try:
                async for payload in chunks:
                    yield _sse(payload)
                yield _sse("[DONE]")
            except _ClientGone:
                return
            except ServerError as exc:
                # the 200 status is already sent: report in-band, as vLLM does
                yield _sse(error_body(str(exc), exc.status, exc.param, exc.code))
                yield _sse("[DONE]")
            finally:
                gen.close()

        return StreamingResponse(
            body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )


def _token_id_text(token_id: int) -> str:
    return f"token_id:{token_id}"


def _gone():
    return Response(status_code=499)  # nginx's "client closed request": nobody reads it


# ---- uvicorn ----


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0 picks a free one); UserError if the port is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise UserError(
            f"serve.port={port} on {host} cannot be used ({exc.strerror}); choose another port "
            "(or 0 to pick a free one)"
        ) from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def _uvicorn_server(app: FastAPI, engine_loop: EngineLoop, banner: Callable[[], None] | None):
    import uvicorn

    class _Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started and banner is not None:
                banner()

        async def shutdown(self, sockets=None) -> None:
            logger.info("shutting down")
            # fail the requests in flight first, so that uvicorn's wait for open connections is short
            engine_loop.begin_shutdown()
            await super().shutdown(sockets)
            # join the engine thread (it stops the other ranks) before uvicorn re-raises a captured SIGTERM
            await asyncio.to_thread(engine_loop.stop)

    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
        lifespan="off",
        timeout_keep_alive=30,
    )
    return _Server(config)


class ServerHandle:
    """A running server (in a background thread); for tests and tools that embed the server."""

    def __init__(self, server, thread: threading.Thread, engine_loop: EngineLoop, port: int):
        self._server = server
        self._thread = thread
        self.engine_loop = engine_loop
        self.port = port

    def stop(self, timeout: float = 30.0) -> None:
        """Stop uvicorn and the engine thread (the engine is shut down, so other ranks exit)."""
        self._server.should_exit = True
        self._thread.join(timeout)
        self.engine_loop.stop(timeout)


def start_server(engine: LLMEngine, model_name: str, host: str = "127.0.0.1", port: int = 0) -> ServerHandle:
    """Serve `engine` from a background thread; returns once the server accepts connections."""
    engine_loop = EngineLoop(engine)
    app = OpenAIServer(engine_loop, model_name).app
    sock = bind_socket(host, port)
    ready = threading.Event()
    server = _uvicorn_server(app, engine_loop, ready.set)
    engine_loop.start()
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="dcpctl-uvicorn", daemon=True)
    thread.start()
    if not ready.wait(60):
        server.should_exit = True
        engine_loop.stop()
        raise RuntimeError("the server did not start within 60 s")
    return ServerHandle(server, thread, engine_loop, sock.getsockname()[1])


def serve_engine(engine: LLMEngine, host: str, port: int, model_name: str) -> None:
    """Serve `engine` in this thread until SIGINT/SIGTERM; then shut the engine down (other ranks exit)."""
    engine_loop = EngineLoop(engine)
    try:
        app = OpenAIServer(engine_loop, model_name).app
        sock = bind_socket(host, port)
        bound = sock.getsockname()[1]

        def banner() -> None:
            print(f"serving {model_name} on http://{host}:{bound} (max_model_len {engine.max_model_len})", flush=True)

        server = _uvicorn_server(app, engine_loop, banner)
        engine_loop.start()
        with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises the Ctrl-C it handled: that is our exit
            server.run(sockets=[sock])
    finally:
        engine_loop.stop()


def serve_plan(report: PlanReport) -> None:
    """Every rank of `dcpctl run PLAN`: rank 0 serves the API; the other ranks follow its steps until it stops."""
    from engine.engine_core import LLMEngine, follow, start_rank

    config, par, runner = start_rank(report)
    if not par.is_driver:
        # rank 0 decides when to stop (it tells us after its last step); a signal from torchrun must not kill a
        # follower in the middle of a collective, which would leave rank 0 hanging
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        follow(par, runner)
        return
    engine = LLMEngine(config, par, runner)
    serve = report.plan.serve
    _configure_logging()
    serve_engine(engine, serve.host, serve.port, serve.model_name or report.name)


def _configure_logging() -> None:
    """The server's and the engine's log lines (dcpctl.*) to stderr."""
    root = logging.getLogger("dcpctl")
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)

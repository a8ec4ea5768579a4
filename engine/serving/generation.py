"""One HTTP request's generation: its choices, the engine requests behind them, the watch on its client, and the
server-sent-events stream that carries them.

A handler that ends early (the client disconnected, the task was cancelled) closes its generation, which aborts the
engine requests that have not finished and so frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.core.sequence import SamplingParams, TokenLogprob
from engine.serving.engine_loop import EngineLoop, EngineRequest, Sink, Update
from engine.serving.handoff import Claimed, PrefillLink
from engine.serving.responses import ResponseHead, ServerError, error_body, new_id, stop_holdback

logger = logging.getLogger("dcpctl.server")

_DISCONNECTED = object()


class ClientGone(Exception):
    """The HTTP client disconnected before its response was complete."""


@dataclass
class Choice:
    """One choice of the response (a prompt's n-th sample) as the updates build it."""

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
    export_requested: bool = False  # P/D prefill: keep the prompt's KV for a decode instance
    export: dict | None = None  # P/D prefill: the kept export, once finished
    claimed: Claimed | None = None  # P/D decode: the prompt's claimed export
    kv_transfer: dict | None = None  # P/D decode: what the pull did
    speculative: dict | None = None  # speculative decoding: proposals and acceptances, once finished

    def apply(self, update: Update) -> None:
        if update.export is not None:
            self.export = update.export
        if update.speculative is not None:
            self.speculative = update.speculative
        if update.kv_transfer is not None:
            self.kv_transfer = update.kv_transfer
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


class Generation:
    """The engine requests behind one HTTP request, and the watch on its client."""

    def __init__(
        self,
        engine_loop: EngineLoop,
        request: Request,
        choices: list[Choice],
        params: list[SamplingParams],
        prompt_numbers: list[int],
        link: PrefillLink | None = None,
        export_handle: Callable[[dict], dict] | None = None,
        stream: bool = True,
    ):
        self.engine_loop = engine_loop
        self.request = request
        self.choices = choices
        self.items = [
            EngineRequest(
                new_id("req"),
                c.index,
                number,
                c.prompt_ids,
                p,
                c.export_requested,
                c.claimed and c.claimed.remote,
                stream,
            )
            for c, p, number in zip(choices, params, prompt_numbers, strict=True)
        ]
        self.link = link
        self.export_handle = export_handle  # P/D prefill: a kept export -> the handle the response carries
        self._unpulled: dict[str, set[int]] = {}  # transfer id -> choices that have not pulled yet
        for c in choices:
            if c.claimed is not None:
                self._unpulled.setdefault(c.claimed.remote.manifest.transfer_id, set()).add(c.index)
        self.sink: Sink | None = None
        self._watch: asyncio.Task | None = None
        self._closed = False

    async def start(self) -> None:
        self.sink = Sink()
        await self.engine_loop.add(self.items, self.sink, numbered=len(set(i.prompt_number for i in self.items)) > 1)
        self._watch = asyncio.ensure_future(self._watch_disconnect(self.request.receive, self.sink))

    @staticmethod
    async def _watch_disconnect(receive: Callable, sink: Sink) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                sink.queue.put_nowait(_DISCONNECTED)
                return

    async def updates(self) -> AsyncIterator[Choice]:
        """Yield the choice each update changed, until all are finished; raises ClientGone or ServerError."""
        assert self.sink is not None
        pending = len(self.choices)
        while pending:
            update = await self.sink.queue.get()
            if update is _DISCONNECTED:
                raise ClientGone
            if update.error is not None:
                raise update.error
            choice = self.choices[update.index]
            choice.apply(update)
            if choice.claimed is not None:
                self._pulled(choice)
            if update.finish_reason is not None:
                pending -= 1
            yield choice

    def _pulled(self, choice: Choice) -> None:
        """A choice's pull is over (it got a token or finished): release its export once every choice has pulled."""
        transfer_id = choice.claimed.remote.manifest.transfer_id
        waiting = self._unpulled.get(transfer_id)
        if waiting is None:
            return
        waiting.discard(choice.index)
        if not waiting:
            del self._unpulled[transfer_id]
            self.link.release_later(transfer_id)

    async def run_to_end(self) -> bool:
        """Wait until every choice has finished (False: the client went first); the generation is closed after."""
        try:
            async for _ in self.updates():
                pass
        except ClientGone:
            return False
        finally:
            self.close()
        return True

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
        for transfer_id in self._unpulled:  # a failed or abandoned request: the prefill side may free its export
            self.link.release_later(transfer_id)
        self._unpulled.clear()


def stream_chunk(head: ResponseHead, gen: Generation, item: dict, finish: str | None, include_usage: bool) -> dict:
    """One SSE body with a single choice; `usage` is null on all but the final usage chunk. A choice's finishing
    chunk carries its hand-off fields (P/D) and its speculative counters, as a non-streamed response does."""
    item["finish_reason"] = finish
    extra = {}
    if finish is not None:
        choice = gen.choices[item["index"]]
        item["stop_reason"] = choice.stop_reason
        extra = {**handoff_fields([choice], gen.export_handle), **speculative_fields([choice])}
    body = head.body([item], **extra)
    if include_usage:
        body["usage"] = None
    return body


def handoff_fields(choices: list[Choice], export_handle: Callable[[dict], dict] | None) -> dict:
    """The response's P/D fields: a prefill instance's `kv_transfer_params` (one handle per prompt; a list when
    there are several), a decode instance's `kv_transfer` (per choice: what its pull did, with the TTFT split)."""
    exports = [c.export for c in choices if c.export is not None]
    if exports and export_handle is not None:
        handles = [export_handle(e) for e in exports]
        return {"kv_transfer_params": handles[0] if len(choices) == 1 else handles}
    pulled = [c for c in choices if c.claimed is not None and c.kv_transfer is not None]
    if not pulled:
        return {}
    return {
        "kv_transfer": [
            {"index": c.index, "prefill_s": c.claimed.prefill_s, "claim_s": c.claimed.claim_s, **c.kv_transfer}
            for c in pulled
        ]
    }


def speculative_fields(choices: list[Choice]) -> dict:
    """The response's `speculative` field (per choice: proposed, accepted, acceptance_rate, mean_accepted_length)
    when the plan speculates; not an OpenAI field, like vLLM's extras it sits beside them."""
    counted = [c for c in choices if c.speculative is not None]
    return {"speculative": [{"index": c.index, **c.speculative} for c in counted]} if counted else {}


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def event_stream(gen: Generation, chunks: AsyncIterator[dict]) -> StreamingResponse:
    """The chunks as server-sent events, then `[DONE]`; an error after the 200 is sent goes in-band (an unexpected
    one is logged with its traceback too): a stream ends with `[DONE]` unless its client left."""

    async def body():
        try:
            async for payload in chunks:
                yield _sse(payload)
            yield _sse("[DONE]")
        except ClientGone:
            return
        except ServerError as exc:
            # the 200 status is already sent: report in-band, as vLLM does
            yield _sse(error_body(str(exc), exc.status, exc.param, exc.code))
            yield _sse("[DONE]")
        except Exception as exc:  # a bug: the client still gets an ending, not a connection cut mid-stream
            logger.error("a stream failed unexpectedly; the client gets an error event", exc_info=exc)
            yield _sse(error_body(f"internal error: {type(exc).__name__}: {exc}", 500))
            yield _sse("[DONE]")
        finally:
            gen.close()

    return StreamingResponse(
        body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )


async def json_response(build: Callable[[], dict]) -> JSONResponse:
    """The body `build` makes, built and rendered on a worker thread: a large one must not stall the other clients."""
    return await asyncio.to_thread(lambda: JSONResponse(build()))


def client_gone() -> Response:
    """The answer to a request whose client left: nginx's "client closed request" (nobody reads it)."""
    return Response(status_code=499)

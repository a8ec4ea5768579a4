"""The thread bridge between the server's request handlers and the engine: one engine thread, an inbox, sinks.

Threads: uvicorn's event loop runs the request handlers; one engine thread owns the `LLMEngine` (not
thread-safe) and loops `step()` while there is work, sleeping on a condition variable when idle. Handlers hand
requests to the engine thread through `EngineLoop`'s inbox and get updates on an asyncio.Queue that the engine
thread feeds with `loop.call_soon_threadsafe`: every step's for a streamed response, only the finish (and a P/D pull's
end) for a whole one, so that a batch of whole responses does not wake the server's thread at every token. All
requests in flight share the scheduler's batch. The thread that started the engine gives it up to the engine thread
(`LLMEngine.hand_over_thread`): the process keeps one OpenMP team.

A request whose sampling or detokenization fails gets a 500 (an error event when streamed) and the others go on;
an exception in the engine thread itself (a step, a rank, a collective) fails every request in flight with a 500
and marks the server unhealthy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.core.sequence import SamplingParams, TokenLogprob
from engine.errors import UserError
from engine.kv_transfer.handles import RemotePrefill
from engine.serving.responses import ServerError

if TYPE_CHECKING:
    from engine.core.engine import LLMEngine

logger = logging.getLogger("dcpctl.server")


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
    export: dict | None = None  # P/D prefill: the kept export (transfer id, block ids), with the finish
    kv_transfer: dict | None = None  # P/D decode: what the pull did, once it is done
    speculative: dict | None = None  # speculative decoding: the request's proposals and acceptances, with the finish


class Sink:
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
class EngineRequest:
    """One engine request of an HTTP request: a prompt for one choice."""

    request_id: str
    index: int  # choice index
    prompt_number: int  # which prompt of the HTTP request (for error messages)
    prompt_ids: list[int]
    params: SamplingParams
    export: bool = False  # P/D prefill: keep the prompt's KV for a decode instance
    remote: RemotePrefill | None = None  # P/D decode: pull the prompt's KV from the prefill instance
    stream: bool = True  # an update every step (a streamed response); else the finish, and a P/D pull's end


@dataclass
class _Submission:
    items: list[EngineRequest]
    sink: Sink
    accepted: asyncio.Future
    numbered: bool  # more than one prompt: errors name the prompt


@dataclass
class _Handle:
    index: int
    sink: Sink
    stream: bool
    sent_tokens: int = 0
    sent_logprobs: int = 0
    sent_prompt: bool = False
    sent_kv_transfer: bool = False


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
        """Start the engine thread; from now on the engine is stepped there (the calling thread gives it up)."""
        self._snapshot()
        self.engine.hand_over_thread()
        self._thread.start()
        return self

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread.is_alive() and not self._stopping

    def unavailable_reason(self) -> str:
        if self.error is not None:
            return f"the engine failed ({self.error}); restart the server"
        return "the server is shutting down"

    async def add(self, items: list[EngineRequest], sink: Sink, numbered: bool) -> None:
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

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run `fn(engine)` on the engine thread (the engine is not thread-safe); its result or its exception."""
        sink = Sink()
        done = sink.loop.create_future()
        with self._cv:
            if self._closed or self._stopping:
                raise ServerError(503, self.unavailable_reason())
            self._inbox.append(("call", (fn, sink, done)))
            self._cv.notify()
        return await done

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
                        if not self._cv.wait(self.engine.housekeeping()):
                            break  # a lease ran out while idle
                    commands, self._inbox = self._inbox, []
                    stopping = self._stopping
                for kind, payload in commands:
                    if kind == "add":
                        self._add(payload)
                    elif kind == "call":
                        self._call(*payload)
                    else:
                        for request_id in payload:
                            self.engine.abort(request_id)
                            self._handles.pop(request_id, None)
                if stopping:
                    break
                self.engine.housekeeping()
                outputs = self.engine.step() if self.engine.has_unfinished() else None
                self._snapshot()  # before the outputs go out: a client reading the stats after its answer sees its step
                if outputs is not None:
                    self._publish(outputs)
                    self.stats["requests_in_flight"] = len(self._handles)  # this step's own dict: no copy
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
                elif kind == "call":
                    payload[1].resolve(payload[2], error)
            self._fail_all(error)
            self._shutdown_engine()

    def _call(self, fn: Callable[[LLMEngine], Any], sink: Sink, done: asyncio.Future) -> None:
        try:
            result = fn(self.engine)
        except Exception as exc:
            sink.resolve(done, exc)
            return
        with contextlib.suppress(RuntimeError):
            sink.loop.call_soon_threadsafe(lambda: done.done() or done.set_result(result))

    def _add(self, sub: _Submission) -> None:
        added: list[str] = []
        try:
            for item in sub.items:
                self.engine.add_request(
                    item.prompt_ids, item.params, request_id=item.request_id, export=item.export, remote=item.remote
                )
                added.append(item.request_id)
                self._handles[item.request_id] = _Handle(item.index, sub.sink, item.stream)
        except Exception as exc:
            for request_id in added:
                self.engine.abort(request_id)
                self._handles.pop(request_id, None)
            if isinstance(exc, UserError):
                message = f"prompt {item.prompt_number}: {exc}" if sub.numbered else str(exc)
                error: BaseException = UserError(message, param=exc.param)
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
            finish = seq.finish_reason if seq.is_finished else None
            pulled = seq.kv_transfer is not None and not handle.sent_kv_transfer
            if finish is None and not (handle.stream or pulled):
                # a whole response waits for the end: no wake-up of the server's thread per token, whose GIL and
                # core time the engine thread would wait for
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
            update = Update(handle.index, seq.output_text, new_ids, new_logprobs, prompt_logprobs, finish)
            if pulled:
                handle.sent_kv_transfer = True
                update.kv_transfer = seq.kv_transfer
            if finish == "error":
                if seq.kv_transfer is not None and "error" in seq.kv_transfer:  # the prefill side failed
                    update.error = ServerError(502, f"the request failed: {seq.error}")
                else:
                    update.error = ServerError(500, f"the request failed: {seq.error}; the server goes on")
            elif finish is not None:
                update.stop_reason = seq.stop_reason
                if seq.spec is not None:
                    update.speculative = seq.spec.as_dict()
                if seq.transfer_id is not None:
                    update.export = {"transfer_id": seq.transfer_id, "block_ids": list(seq.block_table)}
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

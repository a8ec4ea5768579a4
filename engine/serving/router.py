"""The P/D router: one OpenAI-compatible URL in front of a prefill instance and a decode instance (HTTP only).

A generating request is validated here with the instances' own request models (the same 400s, naming the same
field), and only what was validated goes on: to the prefill instance first as a one-token, non-streamed request
marked `kv_transfer_params: {do_remote_decode: true}` (vLLM's proxy protocol); the handle it answers with, plus
the time the prefill took, is added to the request, which then goes to the decode instance, whose answer (streamed
or not) is passed back. A request that needs the whole prompt on one side (max_tokens 0, echo with logprobs) goes
to the decode instance alone. Both instances' /health are polled: a request while one is down gets a 503 with
Retry-After naming it, and the router's own /health says which one is down. A new process behind an instance's URL
(its health's instance_id changed) counts as a restart. A stream the decode instance breaks off ends with an error
event, and the router logs why.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.serving.background import ServerHandle, serve_in_background, uvicorn_server
from engine.serving.http import (
    ERROR_RESPONSES,
    BodyLimitMiddleware,
    JSONRoute,
    document_400_not_422,
    install_error_handlers,
)
from engine.serving.protocol import (
    MAX_BODY_BYTES,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    TokenizeRequest,
)
from engine.serving.responses import ServerError, error_body

logger = logging.getLogger("dcpctl.router")

HEALTH_POLL_S = 1.0
HEALTH_TIMEOUT_S = 3.0
PREFILL_TIMEOUT_S = 600.0  # one prompt's prefill (a long prompt on busy CPU cores takes a while)
RETRY_AFTER_S = 5  # what a 503 asks a client to wait while an instance is down (a tiny model restarts in about that)
# The router's connections to the instances are dropped after this long idle, well before the instances' servers
# close them (SERVER_KEEP_ALIVE_S): the pool never reuses a connection its server is closing.
POOL_KEEPALIVE_S = 5.0
_PREFILL_DROPS = ("stream", "stream_options", "logprobs", "top_logprobs", "echo", "n", "best_of", "min_tokens")
_PASSED_HEADERS = ("content-type", "cache-control", "x-accel-buffering")
_ROUTER_ERRORS = {
    **ERROR_RESPONSES,
    502: {"model": ErrorResponse, "description": "an instance failed the request or could not be reached"},
    503: {"model": ErrorResponse, "description": "an instance is down (see Retry-After), or the router shuts down"},
}
_STREAMED = {200: {"content": {"text/event-stream": {}}, "description": "JSON, or server-sent events"}}


@dataclass
class Instance:
    """One side of the deployment as the router sees it."""

    role: str  # "prefill" | "decode"
    url: str
    healthy: bool = False
    reason: str = "not checked yet"
    instance_id: str | None = None  # the process that answered the last health check (a new one: a restart)
    restarts: int = 0

    def unavailable(self) -> ServerError:
        return ServerError(
            503,
            f"the {self.role} instance {self.url} is unhealthy ({self.reason}); retry later",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )

    def set_down(self, reason: str) -> None:
        if self.healthy:
            logger.warning("the %s instance %s is down: %s", self.role, self.url, reason)
        self.healthy, self.reason = False, reason

    def set_up(self, instance_id: str | None) -> None:
        if instance_id is not None and self.instance_id is not None and instance_id != self.instance_id:
            self.restarts += 1
            logger.warning("the %s instance %s restarted (restart %d seen)", self.role, self.url, self.restarts)
        elif not self.healthy and self.reason != "not checked yet":
            logger.warning("the %s instance %s is healthy again", self.role, self.url)
        self.instance_id = instance_id or self.instance_id
        self.healthy, self.reason = True, "ok"


@dataclass
class RouterStats:
    requests: int = 0
    handed_off: int = 0
    failed_prefill: int = 0
    failed_decode: int = 0
    streams_broken: int = 0  # streams the decode instance broke off (the client got an error event)
    prefill_s: float = 0.0


class Router:
    """The router's FastAPI app over two instance URLs."""

    def __init__(self, prefill_url: str, decode_url: str):
        self.prefill = Instance("prefill", prefill_url.rstrip("/"))
        self.decode = Instance("decode", decode_url.rstrip("/"))
        self.stats = RouterStats()
        self._client: httpx.AsyncClient | None = None
        self._poller: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        self.app = self._build_app()

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="dcpctl P/D router", version="1", docs_url=None, redoc_url=None)
        app.router.route_class = JSONRoute
        app.add_middleware(BodyLimitMiddleware, limit=MAX_BODY_BYTES)
        install_error_handlers(app)
        for path, handler in (("/health", self.health), ("/v1/models", self._passthrough("/v1/models"))):
            app.get(path)(handler)
            app.head(path, include_in_schema=False)(handler)  # what load balancers probe with
        app.get("/v1/engine/stats")(self.engine_stats)
        app.get("/tokenizer_info")(self._passthrough("/tokenizer_info"))
        app.post("/tokenize", responses=_ROUTER_ERRORS)(self.tokenize)
        app.post("/detokenize", responses=_ROUTER_ERRORS)(self.detokenize)
        app.post("/v1/completions", responses={**_ROUTER_ERRORS, **_STREAMED})(self.completions)
        app.post("/v1/chat/completions", responses={**_ROUTER_ERRORS, **_STREAMED})(self.chat_completions)
        document_400_not_422(app)
        return app

    # ---- instances ----

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(None, connect=10.0),
                limits=httpx.Limits(max_connections=None, keepalive_expiry=POOL_KEEPALIVE_S),
                trust_env=False,
            )
            self._poller = asyncio.get_running_loop().create_task(self._poll_health())
        return self._client

    async def _check(self, instance: Instance) -> None:
        try:
            response = await self.client.get(f"{instance.url}/health", timeout=HEALTH_TIMEOUT_S)
        except httpx.HTTPError as exc:
            instance.set_down(_describe(exc))
            return
        if response.status_code != 200:
            instance.set_down(_error_text(response))
            return
        with contextlib.suppress(ValueError, AttributeError):
            instance.set_up(response.json().get("instance_id"))
            return
        instance.set_up(None)

    async def _poll_health(self) -> None:
        while True:
            await asyncio.gather(self._check(self.prefill), self._check(self.decode))
            await asyncio.sleep(HEALTH_POLL_S)

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        if self._client is not None:
            await self._client.aclose()

    async def wait_healthy(self, timeout_s: float) -> bool:
        """Poll both instances until healthy (True) or `timeout_s` passes (False)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            await asyncio.gather(self._check(self.prefill), self._check(self.decode))
            if self.prefill.healthy and self.decode.healthy:
                return True
            await asyncio.sleep(0.2)
        return False

    # ---- routes ----

    async def health(self):
        """200 while both instances are healthy; 503 (with Retry-After) naming the one that is not."""
        if self._poller is None:  # the first call: start the poller and check both now, not "not checked yet"
            self.client  # noqa: B018
            await asyncio.gather(self._check(self.prefill), self._check(self.decode))
        down = [i for i in (self.prefill, self.decode) if not i.healthy]
        if not down:
            return {"status": "ok", "prefill": self.prefill.url, "decode": self.decode.url}
        error = "; ".join(f"the {i.role} instance {i.url} is unhealthy ({i.reason})" for i in down)
        return JSONResponse(
            {"status": "unhealthy", "error": error},
            status_code=503,
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )

    async def engine_stats(self):
        """The decode instance's stats (as a colocated server's), plus the prefill instance's and the router's."""
        decode = await self._get_json(self.decode, "/v1/engine/stats")
        prefill = await self._get_json(self.prefill, "/v1/engine/stats")
        s = self.stats
        return {
            **decode,
            "prefill": prefill,
            "router": {
                "requests": s.requests,
                "handed_off": s.handed_off,
                "failed_prefill": s.failed_prefill,
                "failed_decode": s.failed_decode,
                "streams_broken": s.streams_broken,
                "prefill_s": s.prefill_s,
                "healthy": {"prefill": self.prefill.healthy, "decode": self.decode.healthy},
                "restarts": {"prefill": self.prefill.restarts, "decode": self.decode.restarts},
            },
        }

    async def _get_json(self, instance: Instance, path: str) -> dict:
        try:
            response = await self.client.get(instance.url + path, timeout=HEALTH_TIMEOUT_S)
            return response.json() if response.status_code == 200 else {"error": _error_text(response)}
        except (httpx.HTTPError, ValueError) as exc:
            return {"error": _describe(exc)}

    def _passthrough(self, path: str):
        async def forward(request: Request):
            """Forwarded to the decode instance unchanged."""
            response = await self._send(self.decode, request.method, path)
            return Response(response.content, response.status_code, media_type="application/json")

        forward.__name__ = path.strip("/").replace("/", "_")
        return forward

    async def tokenize(self, req: TokenizeRequest):
        """POST /tokenize on the decode instance (it has the same tokenizer as the prefill one)."""
        return await self._forward_json("/tokenize", req.model_dump(mode="json", exclude_unset=True))

    async def detokenize(self, req: DetokenizeRequest):
        """POST /detokenize on the decode instance."""
        return await self._forward_json("/detokenize", req.model_dump(mode="json", exclude_unset=True))

    async def _forward_json(self, path: str, body: dict) -> Response:
        response = await self._send(self.decode, "POST", path, json=body)
        return Response(response.content, response.status_code, media_type="application/json")

    async def _send(self, instance: Instance, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One request to an instance; a 503 (Retry-After) when it cannot be connected to (nothing was sent), a 502
        when it failed while the request was on its way."""
        try:
            return await self.client.request(method, instance.url + path, **kwargs)
        except httpx.HTTPError as exc:
            raise self._unreachable(instance, exc, f"{method} {path}") from None

    def _unreachable(self, instance: Instance, exc: httpx.HTTPError, what: str) -> ServerError:
        instance.set_down(_describe(exc))
        if isinstance(exc, httpx.ConnectError):
            return instance.unavailable()
        logger.warning("%s on the %s instance %s failed: %s", what, instance.role, instance.url, _describe(exc))
        return ServerError(502, f"the {instance.role} instance {instance.url} cannot be reached ({_describe(exc)})")

    async def completions(self, req: CompletionRequest, request: Request):
        """POST /v1/completions through the hand-off."""
        req.check_supported()
        limit = 16 if req.max_tokens is None else req.max_tokens
        whole_prompt_here = limit == 0 or (req.echo and req.logprobs is not None)
        return await self._generate(req, "/v1/completions", chat=False, whole_prompt_here=whole_prompt_here)

    async def chat_completions(self, req: ChatCompletionRequest, request: Request):
        """POST /v1/chat/completions through the hand-off."""
        req.check_supported()
        req.logprobs_count()  # top_logprobs without logprobs: the instances' 400
        limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        return await self._generate(req, "/v1/chat/completions", chat=True, whole_prompt_here=limit == 0)

    async def _generate(
        self, req: CompletionRequest | ChatCompletionRequest, path: str, chat: bool, whole_prompt_here: bool
    ) -> Response:
        if req.kv_transfer_params is not None:
            raise ServerError(
                400,
                "kv_transfer_params are the router's to set (the hand-off between its instances); send the request "
                "without them",
                param="kv_transfer_params",
            )
        # what goes on is what was validated: the fields the client set, as parsed (unknown ones dropped)
        body = req.model_dump(mode="json", exclude_unset=True)
        self.stats.requests += 1
        for instance in (self.prefill, self.decode):
            if not instance.healthy:
                await self._check(instance)
                if not instance.healthy:
                    raise instance.unavailable()
        handles: list[dict] = []
        if not whole_prompt_here:
            params, prefill_s = await self._prefill(path, body, chat)
            if isinstance(params, Response):
                return params
            handles = params if isinstance(params, list) else [params]
            body = {**body, "kv_transfer_params": params}
            self.stats.handed_off += 1
            self.stats.prefill_s += prefill_s
        return await self._decode(path, body, handles)

    async def _prefill(self, path: str, body: dict, chat: bool) -> tuple[Any, float]:
        """Run the prompt on the prefill instance; (the handles with the prefill time added, seconds), or the
        prefill instance's own 4xx answer (a bad request) to pass back."""
        prefill_body = {k: v for k, v in body.items() if k not in _PREFILL_DROPS}
        prefill_body["max_tokens"] = 1
        if chat:
            prefill_body["max_completion_tokens"] = 1
        prefill_body["kv_transfer_params"] = {"do_remote_decode": True}
        start = time.perf_counter()
        try:
            response = await self._send(self.prefill, "POST", path, json=prefill_body, timeout=PREFILL_TIMEOUT_S)
        except ServerError:
            self.stats.failed_prefill += 1
            raise
        prefill_s = time.perf_counter() - start
        if 400 <= response.status_code < 500:
            return Response(response.content, response.status_code, media_type="application/json"), prefill_s
        if response.status_code != 200:
            self.stats.failed_prefill += 1
            message = f"the prefill instance {self.prefill.url} failed the request: {_error_text(response)}"
            logger.warning("%s", message)
            raise ServerError(502, message)
        try:
            params = response.json().get("kv_transfer_params")
        except (ValueError, AttributeError):
            params = None
        handles = params if isinstance(params, list) else [params]
        if not handles or not all(isinstance(h, dict) for h in handles):
            self.stats.failed_prefill += 1
            raise ServerError(502, f"the prefill instance {self.prefill.url} answered without kv_transfer_params")
        handles = [{**h, "prefill_s": prefill_s} for h in handles]
        return (handles if isinstance(params, list) else handles[0]), prefill_s

    async def _decode(self, path: str, body: dict, handles: list[dict]) -> Response:
        """Pass the request to the decode instance and its answer back. When the decode side does not take the
        request, the prefill side's exports are released at once rather than held until their lease ends."""
        client = self.client
        try:
            response = await client.send(client.build_request("POST", self.decode.url + path, json=body), stream=True)
        except httpx.HTTPError as exc:
            self.stats.failed_decode += 1
            self._release(handles)
            raise self._unreachable(self.decode, exc, f"POST {path}") from None
        headers = {k: v for k, v in response.headers.items() if k.lower() in _PASSED_HEADERS}
        if response.status_code != 200 or not body.get("stream"):
            try:
                content = await response.aread()
            except httpx.HTTPError as exc:
                self.stats.failed_decode += 1
                self._release(handles)
                raise self._unreachable(self.decode, exc, f"reading the answer to POST {path}") from None
            finally:
                await response.aclose()
            if response.status_code != 200:
                if response.status_code >= 500:
                    self.stats.failed_decode += 1
                self._release(handles)
            return Response(content, response.status_code, headers=headers)
        return StreamingResponse(self._relay(response, handles), 200, headers=headers)

    async def _relay(self, response: httpx.Response, handles: list[dict]) -> AsyncIterator[bytes]:
        """The decode instance's events, passed on whole; a stream it breaks off (it died, the connection dropped)
        ends with an error event and [DONE] instead of a cut connection, and the reason is logged."""
        pending = b""
        try:
            async for data in response.aiter_raw():
                pending += data
                end = pending.rfind(b"\n\n")
                if end >= 0:  # only whole events: a broken-off stream must not end inside one
                    yield pending[: end + 2]
                    pending = pending[end + 2 :]
            if pending:
                yield pending
        except httpx.HTTPError as exc:
            self.stats.failed_decode += 1
            self.stats.streams_broken += 1
            self._release(handles)
            reason = _describe(exc)
            logger.warning(
                "a stream from the decode instance %s broke off (%s); the client gets an error event",
                self.decode.url,
                reason,
            )
            message = f"the decode instance {self.decode.url} broke off the stream ({reason}); retry the request"
            yield f"data: {json.dumps(error_body(message, 502))}\n\ndata: [DONE]\n\n".encode()
        finally:
            await response.aclose()

    def _release(self, handles: list[dict]) -> None:
        """Ask the prefill instance to free the exports of a request the decode side did not take (best effort in
        the background: an export nobody releases is freed when its lease ends)."""
        for handle in handles:
            transfer_id = handle.get("remote_request_id")
            if isinstance(transfer_id, str):
                task = asyncio.get_running_loop().create_task(self._release_one(transfer_id))
                self._background.add(task)
                task.add_done_callback(self._background.discard)

    async def _release_one(self, transfer_id: str) -> None:
        with contextlib.suppress(httpx.HTTPError):
            url = f"{self.prefill.url}/v1/kv_transfer/release"
            await self.client.post(url, json={"transfer_id": transfer_id}, timeout=HEALTH_TIMEOUT_S)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _error_text(response: httpx.Response) -> str:
    with contextlib.suppress(ValueError, KeyError, TypeError):
        body = response.json()
        return body["error"]["message"] if isinstance(body.get("error"), dict) else str(body["error"])
    return f"HTTP {response.status_code}"


def router_server(router: Router, banner: Any = None) -> Any:
    """A uvicorn server for the router; `banner()` is called once it listens."""
    return uvicorn_server(router.app, banner, after_shutdown=router.close, timeout_graceful_shutdown=5)


def start_router(router: Router, sock: socket.socket) -> ServerHandle:
    """Serve the router on a bound socket from a background thread; returns once it accepts connections."""
    return serve_in_background(lambda banner: router_server(router, banner), sock, "dcpctl-router")

"""The P/D router: one OpenAI-compatible URL in front of a prefill instance and a decode instance (HTTP only).

A generating request goes to the prefill instance first as a one-token, non-streamed request marked
`kv_transfer_params: {do_remote_decode: true}` (vLLM's proxy protocol); the handle it answers with, plus the time
the prefill took, is added to the original request, which then goes to the decode instance, whose answer (streamed
or not) is passed back unchanged. A request that needs the whole prompt on one side (max_tokens 0, echo with
logprobs) goes to the decode instance alone. Both instances' /health are polled: a request while one is unhealthy
gets a 503 naming it, and the router's own /health says which one is down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.errors import UserError
from engine.serving.background import ServerHandle, serve_in_background, uvicorn_server
from engine.serving.http import BodyLimitMiddleware, install_error_handlers
from engine.serving.protocol import MAX_BODY_BYTES, parse_json_body
from engine.serving.responses import ServerError

logger = logging.getLogger("dcpctl.router")

HEALTH_POLL_S = 1.0
HEALTH_TIMEOUT_S = 3.0
PREFILL_TIMEOUT_S = 600.0  # one prompt's prefill (a long prompt on busy CPU cores takes a while)
_PREFILL_DROPS = ("stream", "stream_options", "logprobs", "top_logprobs", "echo", "n", "best_of", "min_tokens")
_PASSED_HEADERS = ("content-type", "cache-control", "x-accel-buffering")


@dataclass
class Instance:
    """One side of the deployment as the router sees it."""

    role: str  # "prefill" | "decode"
    url: str
    healthy: bool = False
    reason: str = "not checked yet"

    def unavailable(self) -> ServerError:
        return ServerError(503, f"the {self.role} instance {self.url} is unhealthy ({self.reason}); retry later")


@dataclass
class RouterStats:
    requests: int = 0
    handed_off: int = 0
    failed_prefill: int = 0
    failed_decode: int = 0
    prefill_s: float = 0.0


class Router:
    """The router's FastAPI app over two instance URLs."""

    def __init__(self, prefill_url: str, decode_url: str):
        self.prefill = Instance("prefill", prefill_url.rstrip("/"))
        self.decode = Instance("decode", decode_url.rstrip("/"))
        self.stats = RouterStats()
        self._client: httpx.AsyncClient | None = None
        self._poller: asyncio.Task | None = None
        self.app = self._build_app()

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="dcpctl P/D router", version="1", docs_url=None, redoc_url=None)
        app.add_middleware(BodyLimitMiddleware, limit=MAX_BODY_BYTES)
        install_error_handlers(app)
        app.get("/health")(self.health)
        app.get("/v1/engine/stats")(self.engine_stats)
        app.post("/v1/completions")(self.completions)
        app.post("/v1/chat/completions")(self.chat_completions)
        for path in ("/v1/models", "/tokenizer_info"):
            app.get(path)(self._passthrough(path))
        for path in ("/tokenize", "/detokenize"):
            app.post(path)(self._passthrough(path))
        return app

    # ---- instances ----

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0), trust_env=False)
            self._poller = asyncio.get_running_loop().create_task(self._poll_health())
        return self._client

    async def _check(self, instance: Instance) -> None:
        try:
            response = await self.client.get(f"{instance.url}/health", timeout=HEALTH_TIMEOUT_S)
        except httpx.HTTPError as exc:
            instance.healthy, instance.reason = (
                False,
                f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__,
            )
            return
        instance.healthy = response.status_code == 200
        instance.reason = "ok" if instance.healthy else _error_text(response)

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
        """200 while both instances are healthy; 503 naming the one that is not."""
        if self._poller is None:  # the first call: start the poller and check both now, not "not checked yet"
            self.client  # noqa: B018
            await asyncio.gather(self._check(self.prefill), self._check(self.decode))
        down = [i for i in (self.prefill, self.decode) if not i.healthy]
        if not down:
            return {"status": "ok", "prefill": self.prefill.url, "decode": self.decode.url}
        error = "; ".join(f"the {i.role} instance {i.url} is unhealthy ({i.reason})" for i in down)
        return JSONResponse({"status": "unhealthy", "error": error}, status_code=503)

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
                "prefill_s": s.prefill_s,
                "healthy": {"prefill": self.prefill.healthy, "decode": self.decode.healthy},
            },
        }

    async def _get_json(self, instance: Instance, path: str) -> dict:
        try:
            response = await self.client.get(instance.url + path, timeout=HEALTH_TIMEOUT_S)
            return response.json() if response.status_code == 200 else {"error": _error_text(response)}
        except (httpx.HTTPError, ValueError) as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}

    def _passthrough(self, path: str):
        async def forward(request: Request):
            """Forwarded to the decode instance unchanged."""
            body = await request.body() if request.method == "POST" else None
            response = await self._send(self.decode, request.method, path, content=body)
            return Response(response.content, response.status_code, media_type="application/json")

        forward.__name__ = path.strip("/").replace("/", "_")
        return forward

    async def _send(self, instance: Instance, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            return await self.client.request(method, instance.url + path, **kwargs)
        except httpx.HTTPError as exc:
            instance.healthy, instance.reason = False, type(exc).__name__
            raise ServerError(502, f"the {instance.role} instance {instance.url} cannot be reached ({exc})") from None

    async def completions(self, request: Request):
        """POST /v1/completions through the hand-off."""
        return await self._generate(request, "/v1/completions", chat=False)

    async def chat_completions(self, request: Request):
        """POST /v1/chat/completions through the hand-off."""
        return await self._generate(request, "/v1/chat/completions", chat=True)

    async def _generate(self, request: Request, path: str, chat: bool):
        try:
            body = parse_json_body(await request.body())
        except UserError as exc:
            raise ServerError(400, str(exc), param=exc.param) from None
        if not isinstance(body, dict):
            raise ServerError(400, "the request body must be a JSON object")
        self.stats.requests += 1
        for instance in (self.prefill, self.decode):
            if not instance.healthy:
                await self._check(instance)
                if not instance.healthy:
                    raise instance.unavailable()
        limit = body.get("max_completion_tokens", body.get("max_tokens")) if chat else body.get("max_tokens", 16)
        whole_prompt_here = limit == 0 or (not chat and body.get("echo") and body.get("logprobs") is not None)
        if not whole_prompt_here:
            params, prefill_s = await self._prefill(path, body, chat)
            if isinstance(params, Response):
                return params
            body = {**body, "kv_transfer_params": params}
            self.stats.handed_off += 1
            self.stats.prefill_s += prefill_s
        return await self._decode(path, body)

    async def _prefill(self, path: str, body: dict, chat: bool) -> tuple[Any, float]:
        """Run the prompt on the prefill instance; (the handles with the prefill time added, seconds), or the
        prefill instance's own 4xx answer (a bad request) to pass back."""
        prefill_body = {k: v for k, v in body.items() if k not in _PREFILL_DROPS}
        prefill_body["max_tokens"] = 1
        if chat:
            prefill_body["max_completion_tokens"] = 1
        prefill_body["kv_transfer_params"] = {"do_remote_decode": True}
        start = time.perf_counter()
        response = await self._send(self.prefill, "POST", path, json=prefill_body, timeout=PREFILL_TIMEOUT_S)
        prefill_s = time.perf_counter() - start
        if 400 <= response.status_code < 500:
            return Response(response.content, response.status_code, media_type="application/json"), prefill_s
        if response.status_code != 200:
            self.stats.failed_prefill += 1
            raise ServerError(
                502, f"the prefill instance {self.prefill.url} failed the request: {_error_text(response)}"
            )
        params = response.json().get("kv_transfer_params")
        handles = params if isinstance(params, list) else [params]
        if not handles or not all(isinstance(h, dict) for h in handles):
            self.stats.failed_prefill += 1
            raise ServerError(502, f"the prefill instance {self.prefill.url} answered without kv_transfer_params")
        handles = [{**h, "prefill_s": prefill_s} for h in handles]
        return (handles if isinstance(params, list) else handles[0]), prefill_s

    async def _decode(self, path: str, body: dict) -> Response:
        client = self.client
        try:
            response = await client.send(client.build_request("POST", self.decode.url + path, json=body), stream=True)
        except httpx.HTTPError as exc:
            self.stats.failed_decode += 1
            self.decode.healthy, self.decode.reason = False, type(exc).__name__
            raise ServerError(502, f"the decode instance {self.decode.url} cannot be reached ({exc})") from None
        if response.status_code >= 500:
            self.stats.failed_decode += 1
        headers = {k: v for k, v in response.headers.items() if k.lower() in _PASSED_HEADERS}
        if not body.get("stream"):
            content = await response.aread()
            await response.aclose()
            return Response(content, response.status_code, headers=headers)

        async def relay():
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
            finally:
                await response.aclose()

        return StreamingResponse(relay(), response.status_code, headers=headers)


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

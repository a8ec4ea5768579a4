"""HTTP plumbing of the OpenAI app: a request body size limit, the JSON parsing of request bodies, the handlers
that turn every error into OpenAI's error shape, and the error responses its OpenAPI document declares.

The guards answer in OpenAI's error shape through the app's HTTPException handler: a body over the limit is a 413
before the app reads it, and a body that is not UTF-8 JSON (or nests too deeply to parse) is a 400 that says why.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.errors import UserError
from engine.serving.protocol import ErrorResponse, parse_json_body, validation_message
from engine.serving.responses import ServerError, error_body

logger = logging.getLogger("dcpctl.server")
_PARAM_RE = re.compile(r"^([a-z_]+)=")


def _too_large(limit: int) -> str:
    return f"the request body is larger than this server's limit of {limit} bytes; send a smaller request"


class _BodyTooLarge(HTTPException):
    """Raised from `receive` once a body sent without a Content-Length passes the limit (FastAPI re-raises it)."""

    def __init__(self, limit: int):
        super().__init__(413, _too_large(limit))


class BodyLimitMiddleware:
    """ASGI middleware: request bodies over `limit` bytes are refused with a 413."""

    def __init__(self, app: ASGIApp, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            await JSONResponse(error_body(_too_large(self.limit), 413), status_code=413)(scope, receive, send)
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise _BodyTooLarge(self.limit)
            return message

        await self.app(scope, limited, send)


class _BadBody(HTTPException):
    """A body that cannot be read as the request's JSON (FastAPI re-raises HTTPExceptions from `json()`)."""

    def __init__(self, error: UserError):
        super().__init__(400, str(error))
        self.param = error.param


class _JSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            try:
                self._json = parse_json_body(await self.body())
            except UserError as exc:
                raise _BadBody(exc) from None
        return self._json


class JSONRoute(APIRoute):
    """A route whose JSON body goes through `parse_json_body`, so that any unparsable body is a 400 saying why."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            return await handler(_JSONRequest(request.scope, request.receive))

        return route


def install_error_handlers(app: FastAPI) -> None:
    """Every error a handler raises answers in OpenAI's error shape: user errors 400 (naming the field the message
    starts with), ServerError its own status, validation errors 400 (not FastAPI's 422), anything unexpected 500."""

    @app.exception_handler(UserError)
    async def _user_error(_: Request, exc: UserError):
        message = str(exc)
        match = _PARAM_RE.match(message)
        param = exc.param or (match.group(1) if match else None)
        code = "context_length_exceeded" if "max_model_len" in message else None
        return JSONResponse(error_body(message, 400, param, code), status_code=400)

    @app.exception_handler(ServerError)
    async def _server_error(_: Request, exc: ServerError):
        body = error_body(str(exc), exc.status, exc.param, exc.code)
        return JSONResponse(body, status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        message, param = validation_message(exc.errors())
        return JSONResponse(error_body(message, 400, param), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, exc: HTTPException):
        param = getattr(exc, "param", None)
        body = error_body(str(exc.detail), exc.status_code, param)
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)  # a 405's Allow among them

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):
        logger.error("unexpected error while handling a request", exc_info=exc)
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", 500), status_code=500)


_ERROR_STATUSES = {  # what each error status means, for /openapi.json
    400: "an invalid request (the message names the field)",
    404: "an unknown model",
    413: "a request body over the size limit",
    500: "the request failed in the engine",
    503: "the server is shutting down or the engine failed",
}


def document_400_not_422(app: FastAPI) -> None:
    """FastAPI documents its validation errors as 422; this server answers them with 400 (OpenAI's status)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            for operations in schema["paths"].values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
        return app.openapi_schema

    app.openapi = openapi


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": text} for status, text in _ERROR_STATUSES.items()
}

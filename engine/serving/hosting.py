"""Hosting the OpenAI app: uvicorn on a bound socket, the engine thread, and an orderly shutdown.

Rank 0 of a served plan serves here (`engine/serving/ranks.py`);
`serve_engine` serves an engine in this thread until SIGINT/SIGTERM; `start_server` serves one from a background
thread (tests and tools that embed the server). Shutting down fails the requests in flight first, then stops the
engine thread, which tells the other ranks to stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING

from fastapi import FastAPI

from engine.serving.background import ServerHandle, bind_socket, serve_in_background, uvicorn_server
from engine.serving.engine_loop import EngineLoop
from engine.serving.openai_app import OpenAIServer

if TYPE_CHECKING:
    from engine.core.engine import LLMEngine

logger = logging.getLogger("dcpctl.server")

SHUTDOWN_GRACE_S = 5  # uvicorn waits this long for connections after in-flight requests were failed


def _uvicorn_server(app: FastAPI, engine_loop: EngineLoop, banner: Callable[[], None] | None):
    async def before_shutdown() -> None:
        logger.info("shutting down")
        # fail the requests in flight first, so that uvicorn's wait for open connections is short
        engine_loop.begin_shutdown()

    async def after_shutdown() -> None:
        # join the engine thread (it stops the other ranks) before uvicorn re-raises a captured SIGTERM
        await asyncio.to_thread(engine_loop.stop)

    return uvicorn_server(
        app,
        banner,
        before_shutdown,
        after_shutdown,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
    )


def start_server(engine: LLMEngine, model_name: str, host: str = "127.0.0.1", port: int = 0) -> ServerHandle:
    """Serve `engine` from a background thread; returns once the server accepts connections. Stopping the handle
    stops the engine thread too (the engine is shut down, so other ranks exit)."""
    engine_loop = EngineLoop(engine)
    app = OpenAIServer(engine_loop, model_name).app
    sock = bind_socket(host, port)
    engine_loop.start()
    return serve_in_background(
        lambda banner: _uvicorn_server(app, engine_loop, banner), sock, "dcpctl-uvicorn", engine_loop.stop
    )


class _Terminated(Exception):
    """SIGTERM, as uvicorn re-raises it once it has shut down: the stop that was asked for."""


def _terminated(*_) -> None:
    raise _Terminated


def serve_engine(engine: LLMEngine, host: str, port: int, model_name: str) -> None:
    """Serve `engine` in this thread until SIGINT/SIGTERM (a clean stop: this returns); then shut the engine down
    (other ranks exit)."""
    engine_loop = EngineLoop(engine)
    try:
        app = OpenAIServer(engine_loop, model_name).app
        sock = bind_socket(host, port)
        bound = sock.getsockname()[1]

        def banner() -> None:
            print(f"serving {model_name} on http://{host}:{bound} (max_model_len {engine.max_model_len})", flush=True)

        server = _uvicorn_server(app, engine_loop, banner)
        engine_loop.start()
        previous = signal.signal(signal.SIGTERM, _terminated)
        try:
            # uvicorn re-raises the SIGINT or SIGTERM it handled (with this process's own handlers): our exit
            with contextlib.suppress(KeyboardInterrupt, _Terminated):
                server.run(sockets=[sock])
        finally:
            signal.signal(signal.SIGTERM, previous)
    finally:
        engine_loop.stop()

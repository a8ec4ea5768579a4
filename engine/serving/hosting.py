"""Hosting the OpenAI app: a listening socket, uvicorn, the engine thread, and an orderly shutdown.

`serve_plan` is what every rank of a served plan runs (rank 0 serves, the others follow its steps);
`serve_engine` serves an engine in this thread until SIGINT/SIGTERM; `start_server` serves one from a background
thread (tests and tools that embed the server). Shutting down fails the requests in flight first, then stops the
engine thread, which tells the other ranks to stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from fastapi import FastAPI

from engine.errors import UserError
from engine.serving.engine_loop import EngineLoop
from engine.serving.openai_app import OpenAIServer

if TYPE_CHECKING:
    from engine.core.engine import LLMEngine
    from engine.plan.resolved import ResolvedPlan

logger = logging.getLogger("dcpctl.server")

SHUTDOWN_GRACE_S = 5  # uvicorn waits this long for connections after in-flight requests were failed


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


def serve_plan(resolved: ResolvedPlan) -> None:
    """Every rank of `dcpctl run PLAN`: rank 0 serves the API; the other ranks follow its steps until it stops."""
    from engine.core.startup import start_engine

    engine = start_engine(resolved, shield_followers=True)
    if engine is None:
        return
    serve = resolved.plan.serve
    _configure_logging()
    serve_engine(engine, serve.host, serve.port, serve.model_name or resolved.name)


def _configure_logging() -> None:
    """The server's and the engine's log lines (dcpctl.*) to stderr."""
    root = logging.getLogger("dcpctl")
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)

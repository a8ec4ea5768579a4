"""Uvicorn servers as the engine's servers and the router use them (`uvicorn_server`), and one run from a background
thread (tests, tools and offline runs that embed a server or the router): started on a bound socket, returned once
it accepts connections, stopped on request. The listening socket (`bind_socket`) and the log lines
(`configure_logging`) of every server, without the engine's imports (the router and a P/D supervisor have none)."""

from __future__ import annotations

import logging
import socket
import sys
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from engine.errors import UserError

START_TIMEOUT_S = 60.0
# How long a server keeps an idle keep-alive connection open: longer than common clients keep one in their pools
# (httpx 5 s, aiohttp 15 s, a cloud load balancer 60 s). A server that closes first races the client's next
# request on that connection: the request meets a closing socket, and the client sees "connection reset by peer"
# with nothing logged anywhere (issue 33).
SERVER_KEEP_ALIVE_S = 75


def uvicorn_server(
    app: Any,
    banner: Callable[[], None] | None = None,
    before_shutdown: Callable[[], Awaitable[None]] | None = None,
    after_shutdown: Callable[[], Awaitable[None]] | None = None,
    **config: Any,
) -> Any:
    """A quiet uvicorn server for `app` (no lifespan, no access log, idle connections kept SERVER_KEEP_ALIVE_S) that
    calls `banner()` once it listens and awaits `before_shutdown()` / `after_shutdown()` around its own shutdown;
    `config`: further uvicorn.Config options."""
    import uvicorn

    config.setdefault("timeout_keep_alive", SERVER_KEEP_ALIVE_S)

    class _Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started and banner is not None:
                banner()

        async def shutdown(self, sockets=None) -> None:
            if before_shutdown is not None:
                await before_shutdown()
            await super().shutdown(sockets)
            if after_shutdown is not None:
                await after_shutdown()

    return _Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", **config))


class ServerHandle:
    """A server running in a background thread, and whatever must stop after it (`on_stop`)."""

    def __init__(self, server: Any, thread: threading.Thread, port: int, on_stop: Callable[[float], None] | None):
        self._server = server
        self._thread = thread
        self._on_stop = on_stop
        self.port = port

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the server to exit, wait for its thread, then run `on_stop`."""
        self._server.should_exit = True
        self._thread.join(timeout)
        if self._on_stop is not None:
            self._on_stop(timeout)


def serve_in_background(
    make_server: Callable[[Callable[[], None]], Any],
    sock: socket.socket,
    name: str,
    on_stop: Callable[[float], None] | None = None,
) -> ServerHandle:
    """`make_server(banner)` builds a uvicorn server that calls `banner()` once it listens; run it on `sock` from a
    daemon thread and return once it accepts connections (RuntimeError, after `on_stop`, if it does not in time)."""
    ready = threading.Event()
    server = make_server(ready.set)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name=name, daemon=True)
    thread.start()
    if not ready.wait(START_TIMEOUT_S):
        server.should_exit = True
        if on_stop is not None:
            on_stop(START_TIMEOUT_S)
        raise RuntimeError(f"{name} did not start within {START_TIMEOUT_S:.0f} s")
    return ServerHandle(server, thread, sock.getsockname()[1], on_stop)


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


def configure_logging() -> None:
    """The server's and the engine's log lines (dcpctl.*) to stderr."""
    root = logging.getLogger("dcpctl")
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)

"""A P/D plan as one service: its prefill and decode instances (each under torchrun as any plan) and the router on
the plan's serve.port. `dcpctl run` starts all three on one node (`--role all`), or one piece at a time for several
nodes (`--role prefill|decode|router`, with `disagg.prefill_url` / `disagg.decode_url` saying where the others are).

The instances are subprocesses of this one (`python -m engine.serve_entry PLAN --role ...`), their output in a log
each; the router runs here. An instance that dies is reported by the router's health (and its log's error); the
router stays up. Stopping this process stops both instances.
"""

from __future__ import annotations

import contextlib
import socket
import tempfile
from pathlib import Path
from types import TracebackType

from engine.errors import UserError
from engine.runtime.launcher import free_port
from engine.serving.hosting import bind_socket
from engine.serving.plan_server import PlanServer, connect_host, sigterm_interrupts
from engine.serving.router import Router, router_server, start_router

INSTANCE_ROLES = ("prefill", "decode")


class Deployment:
    """The prefill and decode instances of a P/D plan on this node, started and stopped together."""

    def __init__(self, source: str, name: str, overrides: list[str], prefill_port: int, decode_port: int):
        self.run_dir = Path(tempfile.mkdtemp(prefix="dcpctl-pd-"))
        prefill_port = prefill_port or free_port()
        decode_port = decode_port or free_port()
        self.prefill = PlanServer(
            source,
            overrides,
            port=prefill_port,
            port_key="disagg.prefill_port",
            args=["--role", "prefill"],
            label=f"{name} (prefill)",
            log_path=self.run_dir / "prefill.log",
        )
        self.decode = PlanServer(
            source,
            [*overrides, f"disagg.prefill_url={self.prefill.base_url}"],
            port=decode_port,
            port_key="disagg.decode_port",
            args=["--role", "decode"],
            label=f"{name} (decode)",
            log_path=self.run_dir / "decode.log",
        )

    def start(self) -> Deployment:
        """Start both instances and wait until both are healthy; a UserError names the one that failed."""
        with sigterm_interrupts():
            try:
                self.prefill.start()
                self.decode.start()
                self.prefill.wait_healthy()
                self.decode.wait_healthy()
            except BaseException:
                self.stop()
                raise
        return self

    def stop(self) -> None:
        for server in (self.decode, self.prefill):
            with contextlib.suppress(Exception):
                server.stop()

    def router(self) -> Router:
        return Router(self.prefill.base_url, self.decode.base_url)

    def __enter__(self) -> Deployment:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def serve_router(router: Router, sock: socket.socket, name: str, where: str) -> None:
    """Serve the router on a bound socket in this thread until SIGINT/SIGTERM."""
    host, bound = sock.getsockname()[:2]

    def banner() -> None:
        print(f"serving {name} on http://{host}:{bound} ({where})", flush=True)

    with contextlib.suppress(KeyboardInterrupt):
        router_server(router, banner).run(sockets=[sock])


def serve_deployment(source: str, name: str, overrides: list[str], section, serve) -> None:
    """`--role all`: both instances on this node and the router on serve.port, until SIGINT/SIGTERM.

    The router's port is bound before the instances start (which takes a while), so that nothing else takes it
    meanwhile; it answers once both instances are healthy."""
    sock = bind_socket(serve.host, serve.port)
    with Deployment(source, name, overrides, section.prefill_port, section.decode_port) as deployment:
        where = (
            f"prefill {deployment.prefill.base_url}, decode {deployment.decode.base_url}; logs in {deployment.run_dir}"
        )
        serve_router(deployment.router(), sock, serve.model_name or name, where)


def serve_router_role(name: str, section, serve) -> None:
    """`--role router`: the router alone, in front of instances started elsewhere."""
    missing = [k for k in ("prefill_url", "decode_url") if not getattr(section, k)]
    if missing:
        raise UserError(
            f"--role router needs {' and '.join('disagg.' + k for k in missing)} (where the instances answer)"
        )
    where = f"prefill {section.prefill_url}, decode {section.decode_url}"
    serve_router(Router(section.prefill_url, section.decode_url), bind_socket(serve.host, serve.port), name, where)


@contextlib.contextmanager
def deployment_url(source: str, name: str, overrides: list[str], section):
    """Both instances and a router on a free port for the duration (offline runs over a P/D plan)."""
    with Deployment(source, name, overrides, section.prefill_port, section.decode_port) as deployment:
        handle = start_router(deployment.router(), bind_socket("127.0.0.1", 0))
        try:
            yield f"http://{connect_host('127.0.0.1')}:{handle.port}"
        finally:
            handle.stop()

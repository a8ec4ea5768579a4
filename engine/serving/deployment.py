"""A P/D plan as one service: its prefill and decode instances (each under torchrun as any plan) and the router on
the plan's serve.port. `dcpctl run` starts all three on one node (`--role all`), or one piece at a time for several
nodes (`--role prefill|decode|router`, with `disagg.prefill_url` / `disagg.decode_url` saying where the others are).

With `--role all` the three are subprocesses of this one (`python -m engine.serve_entry PLAN --role ...`), their
output in a log each, and this process supervises them (`supervision.py`): a dead instance is reported and
restarted, a dead router ends the run. Stopping this process stops all three; should it die outright, they notice
and stop themselves (`parent_watch`).
"""

from __future__ import annotations

import contextlib
import socket
import tempfile
import threading
from pathlib import Path
from types import TracebackType

from engine.errors import UserError
from engine.runtime.launcher import free_port
from engine.serving.background import bind_socket, configure_logging
from engine.serving.plan_server import PlanServer, connect_host, sigterm_interrupts
from engine.serving.router import Router, router_server, start_router
from engine.serving.supervision import RESTART_WINDOW_S, Supervisor

INSTANCE_ROLES = ("prefill", "decode")


class Deployment:
    """The prefill and decode instances of a P/D plan on this node (and, given `router_at` (host, port), the router
    in a process of its own), started and stopped together."""

    def __init__(
        self,
        source: str,
        name: str,
        overrides: list[str],
        prefill_port: int,
        decode_port: int,
        router_at: tuple[str, int] | None = None,
    ):
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
        self.router_process: PlanServer | None = None
        if router_at is not None:
            urls = [f"disagg.prefill_url={self.prefill.base_url}", f"disagg.decode_url={self.decode.base_url}"]
            self.router_process = PlanServer(
                source,
                [*overrides, *urls],
                host=router_at[0],
                port=router_at[1] or free_port(connect_host(router_at[0])),
                args=["--role", "router"],
                label=f"{name} (router)",
                log_path=self.run_dir / "router.log",
            )

    @property
    def processes(self) -> list[PlanServer]:
        return [s for s in (self.prefill, self.decode, self.router_process) if s is not None]

    def start(self) -> Deployment:
        """Start the processes and wait until all are healthy; a UserError names the one that failed."""
        with sigterm_interrupts():
            try:
                for server in self.processes:
                    server.start()
                for server in self.processes:
                    server.wait_healthy()
            except BaseException:
                self.stop()
                raise
        return self

    def stop(self) -> None:
        """Stop the router and both instances at once: each may take its grace period, and none waits on another."""
        threads = [threading.Thread(target=_stop_quietly, args=(server,)) for server in self.processes]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def router(self) -> Router:
        return Router(self.prefill.base_url, self.decode.base_url)

    def __enter__(self) -> Deployment:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _stop_quietly(server: PlanServer) -> None:
    with contextlib.suppress(Exception):
        server.stop()


def serve_router(router: Router, sock: socket.socket, name: str, where: str) -> None:
    """Serve the router on a bound socket in this thread until SIGINT/SIGTERM."""
    host, bound = sock.getsockname()[:2]

    def banner() -> None:
        print(f"serving {name} on http://{host}:{bound} ({where})", flush=True)

    configure_logging()
    with contextlib.suppress(KeyboardInterrupt):
        router_server(router, banner).run(sockets=[sock])


def serve_deployment(source: str, name: str, overrides: list[str], section, serve) -> None:
    """`--role all`: both instances and the router on serve.port, supervised until SIGINT/SIGTERM (a clean stop:
    this returns); a UserError when the deployment cannot go on (a dead router, an instance out of restarts)."""
    with sigterm_interrupts(), contextlib.suppress(KeyboardInterrupt):
        router_at = (serve.host, serve.port)
        with Deployment(source, name, overrides, section.prefill_port, section.decode_port, router_at) as deployment:
            router = deployment.router_process
            restarts = (
                f"up to {section.max_restarts} restarts of each within {RESTART_WINDOW_S / 60:.0f} minutes"
                if section.max_restarts
                else "a dead instance ends the run"
            )
            print(
                f"serving {name} on http://{serve.host}:{router.port} (prefill {deployment.prefill.base_url}, decode "
                f"{deployment.decode.base_url}; {restarts}; logs in {deployment.run_dir})",
                flush=True,
            )
            instances = {"prefill": deployment.prefill, "decode": deployment.decode}
            Supervisor(instances, router, section.max_restarts, deployment.run_dir).run()


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

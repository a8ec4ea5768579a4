"""`dcpctl run` keeping a P/D deployment alive: it watches the prefill, decode and router processes of this node.

A dead instance (its process exited, or its /health says its engine failed) is reported at once on the terminal
(which one, its exit code or signal, its log), then restarted on the same port after a backoff (1 s, doubling, at
most 30 s), its output to a new log. `disagg.max_restarts` bounds the restarts of one instance within
RESTART_WINDOW_S: one death more ends the run with an error (so does any death with 0). Meanwhile the router answers
503 with Retry-After and turns healthy again once the new instance is. The router is the deployment's front door: a
dead router ends the run. The terminal lines carry the times an operator asks for: died, healthy again, how long.
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from engine.errors import UserError
from engine.serving.plan_server import PlanServer

RESTART_WINDOW_S = 600.0
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0
POLL_S = 0.2
LIVENESS_EVERY_S = 2.0  # how often a running instance's /health is asked whether its engine failed
ENGINE_FAILED = "the engine failed"  # how an instance's /health starts its error once its engine has failed


def report(message: str) -> None:
    """One line on the terminal (stderr), with the time of day."""
    print(f"{time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)


@dataclass
class Watched:
    """One instance as the supervisor follows it."""

    role: str  # "prefill" | "decode"
    server: PlanServer
    deaths: list[float] = field(default_factory=list)  # monotonic times, within the restart window
    restarts: int = 0
    down_since: float | None = None  # when the current outage was detected
    restart_at: float | None = None  # the backoff: when the next process starts
    starting_since: float | None = None  # a new process that is not healthy yet
    next_liveness: float = 0.0

    @property
    def name(self) -> str:
        return f"the {self.role} instance {self.server.base_url}"


class Supervisor:
    """Watch a started deployment's processes until SIGINT/SIGTERM (KeyboardInterrupt, for the caller); a UserError
    says why the run cannot go on (a dead router, an instance out of restarts)."""

    def __init__(self, instances: dict[str, PlanServer], router: PlanServer, max_restarts: int, run_dir: Path):
        self.watched = [Watched(role, server) for role, server in instances.items()]
        self.router = router
        self.max_restarts = max_restarts
        self.run_dir = run_dir

    def run(self) -> None:
        while True:
            self.check_router()
            now = time.monotonic()
            for w in self.watched:
                self._tick(w, now)
            time.sleep(POLL_S)

    def check_router(self) -> None:
        reason = self.router.exit_reason()
        if reason is not None:
            raise UserError(
                f"the router {self.router.base_url} (pid {self.router.pid}) {reason} (log: {self.router.log_path}); "
                "the deployment stops with it: run `dcpctl run` again"
            )

    def _tick(self, w: Watched, now: float) -> None:
        if w.restart_at is not None:
            if now >= w.restart_at:
                self._start(w, now)
            return
        reason = w.server.exit_reason()
        if reason is None and w.starting_since is None and now >= w.next_liveness:
            w.next_liveness = now + LIVENESS_EVERY_S
            reason = _engine_failure(w.server)
        if reason is not None:
            self._died(w, now, reason)
        elif w.starting_since is not None:
            if w.server.healthy(timeout_s=1.0):
                self._healthy(w, now)
            elif now - w.starting_since > w.server.health_timeout_s:
                self._died(w, now, f"was not healthy within {w.server.health_timeout_s:.0f} s of its restart")

    def _died(self, w: Watched, now: float, reason: str) -> None:
        pid, log = w.server.pid, w.server.log_path
        which = f", restart {w.restarts}, before it was healthy" if w.starting_since is not None else ""
        report(f"{w.name} (pid {pid}{which}) {reason}; log: {log}")
        w.server.stop()  # the rest of its process tree, if any: the port must be free for the next one
        w.deaths = [t for t in w.deaths if now - t < RESTART_WINDOW_S] + [now]
        w.down_since = w.down_since if w.down_since is not None else now
        w.starting_since = None
        if self.max_restarts == 0:
            raise UserError(f"{w.name} {reason} (log: {log}); disagg.max_restarts=0, so the deployment stops")
        if len(w.deaths) > self.max_restarts:
            raise UserError(
                f"{w.name} died {len(w.deaths)} times within {RESTART_WINDOW_S / 60:.0f} minutes, the last time "
                f"{reason} (log: {log}); its disagg.max_restarts={self.max_restarts} restarts are used up, so the "
                "deployment stops: fix the cause its log shows, or raise disagg.max_restarts"
            )
        delay = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (len(w.deaths) - 1))
        w.restart_at = now + delay
        report(
            f"restarting {w.name} in {delay:g} s (restart {len(w.deaths)} of at most {self.max_restarts} within "
            f"{RESTART_WINDOW_S / 60:.0f} minutes); the router answers 503 meanwhile"
        )

    def _start(self, w: Watched, now: float) -> None:
        w.restarts += 1
        w.restart_at = None
        w.starting_since = now
        w.server.restart(self.run_dir / f"{w.role}.restart-{w.restarts}.log")

    def _healthy(self, w: Watched, now: float) -> None:
        w.server.processes()  # remember its ranks, for stop()
        report(
            f"{w.name} (pid {w.server.pid}) is healthy again: {now - w.down_since:.1f} s after it was found dead, "
            f"{now - w.starting_since:.1f} s to start (restart {w.restarts}); log: {w.server.log_path}"
        )
        w.down_since = w.starting_since = None


def _engine_failure(server: PlanServer) -> str | None:
    """'its engine failed: ...' when the server's /health says so (a server whose engine failed answers, but serves
    nothing until it is restarted); None otherwise, including when it does not answer in time (busy is not dead)."""
    with contextlib.suppress(httpx.HTTPError, ValueError, AttributeError, TypeError):
        response = httpx.get(f"{server.base_url}/health", timeout=LIVENESS_EVERY_S, trust_env=False)
        error = response.json().get("error", "") if response.status_code == 503 else ""
        if error.startswith(ENGINE_FAILED):
            return f"is alive but unusable: {error}"
    return None

"""A target's life, as a library: a URL is measured as it is; a plan's server is launched, waited for until
healthy, measured and stopped, whatever happens. A failure anywhere comes back as a one-line reason that blames
the server when it died or stopped answering, rather than the request that noticed.

Progress goes to a `Feed`: one `TargetFeed` per target (status lines, requests done, the end), drawn by the CLI.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from engine.errors import UserError
from evals.launch import PlanServer, ServerStartError, sigterm_interrupts
from evals.targets import Target

Status = Callable[[str], None]
ServerHook = Callable[[PlanServer], None]
T = TypeVar("T")


def reason(exc: BaseException) -> str:
    """One line for a failure: a UserError's own message, else the exception's type and first line."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return text if isinstance(exc, UserError) else f"{type(exc).__name__}: {text}"


class TargetFeed(Protocol):
    """Progress of one target."""

    def status(self, message: str) -> None:
        """What the target is doing now."""

    def expect(self, total: int) -> None:
        """The target's work has `total` units (questions, requests), when that is known only once it starts."""

    def advance(self) -> None:
        """One more unit of work done."""

    def throughput(self, tokens_per_s: float) -> None:
        """Generated tokens per second so far."""

    def finish(self, message: str, *, failed: bool = False) -> None:
        """The target is done: a summary, or (failed) the reason."""


class Feed(Protocol):
    """Whoever shows a run over targets: hands out one TargetFeed per target, in order."""

    def target(self, label: str, total: int) -> TargetFeed:
        """Start showing a target with `total` units of work (0: not known yet)."""


class QuietFeed:
    """A Feed that shows nothing."""

    def target(self, label: str, total: int) -> QuietFeed:
        return self

    def status(self, message: str) -> None:
        pass

    def expect(self, total: int) -> None:
        pass

    def advance(self) -> None:
        pass

    def throughput(self, tokens_per_s: float) -> None:
        pass

    def finish(self, message: str, *, failed: bool = False) -> None:
        pass


@dataclass(frozen=True)
class Served:
    """The server a measurement talks to."""

    base_url: str
    time_to_healthy_s: float | None = None  # None: a URL target, not launched here


class Launched:
    """`with Launched(target, overrides, ...) as launched:` the plan's server, healthy, for the span of the block;
    stopped when it ends. Entering raises ServerStartError (the server exited or never became healthy) after
    stopping it. `launch` records the command, port, log (when kept), time to healthy and exit code."""

    def __init__(
        self,
        target: Target,
        overrides: list[str],
        *,
        log_path: Path,
        keep_log: bool,
        health_timeout_s: float,
        status: Status,
    ) -> None:
        assert target.resolved is not None, "a URL target is not launched"
        self.world_size = target.resolved.world_size
        server_class = PlanServer
        if target.resolved.plan.engine.name == "vllm":
            from engine.peers.vllm_server import VllmServer as server_class
        self.server = server_class(
            target.spec,
            overrides,
            host=target.resolved.plan.serve.host,
            health_timeout_s=health_timeout_s,
            log_path=log_path,
            label=target.label,
        )
        self.status = status
        self._signals = contextlib.ExitStack()
        self.launch: dict[str, Any] = {"command": self.server.command, "port": self.server.port}
        if keep_log:
            self.launch["log"] = str(self.server.log_path)

    def __enter__(self) -> Launched:
        self.status(f"launching (world size {self.world_size})")
        self._signals.enter_context(sigterm_interrupts())
        try:
            self.server.start()
            self.launch["time_to_healthy_s"] = round(self.server.wait_healthy(), 2)
            self.launch |= {"command": self.server.command, "port": self.server.port}  # a retried port's
        except BaseException:
            self._stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop()

    def _stop(self) -> None:
        self.status("stopping the server")
        try:
            self.launch["exit_code"] = self.server.stop()
        finally:
            self._signals.close()

    @property
    def served(self) -> Served:
        return Served(self.server.base_url, self.launch.get("time_to_healthy_s"))

    def crash(self, activity: str) -> str | None:
        """'the server exited with code N: <its error> during the <activity>' once it has exited, else None."""
        crashed = self.server.exit_reason()
        return f"the server {crashed} during the {activity}" if crashed else None

    def blame(self, exc: BaseException, activity: str, wait_s: float = 15.0) -> str:
        """Why `activity` failed with `exc`: the server, if it exits or stops answering /health within `wait_s`;
        else the exception (the server still serves: the failure was the request's own)."""
        deadline = time.monotonic() + wait_s
        while self.server.alive() and time.monotonic() < deadline:
            if self.server.healthy():
                return reason(exc)
            time.sleep(0.2)
        crashed = self.crash(activity)
        return crashed or f"the server stopped answering /health during the {activity} (for {wait_s:.0f} s)"


@dataclass
class Outcome(Generic[T]):
    """What measuring a target gave (or why it failed), and the facts of its launch."""

    value: T | None = None
    error: str | None = None
    launch: dict[str, Any] = field(default_factory=dict)


def measure_target(
    target: Target,
    overrides: list[str],
    measure: Callable[[Served], T],
    *,
    activity: str,
    log_path: Path,
    keep_log: bool,
    health_timeout_s: float,
    status: Status,
    on_server: ServerHook | None = None,
) -> Outcome[T]:
    """Run `measure` on the target: a URL as it is; a plan's server launched, healthy, then stopped.

    A failure of the target comes back as the outcome's error: the server never healthy, `measure` raising (the
    crash blamed on the server when it died), or the server gone by the time `measure` returned. `activity`
    ("eval", "benchmark") names the measurement in those reasons. `on_server` sees a launched server once it is
    healthy (tests: an engine crash).
    """
    if target.resolved is None:
        try:
            return Outcome(measure(Served(target.spec)), launch={"url": target.spec})
        except Exception as exc:
            return Outcome(error=reason(exc), launch={"url": target.spec})
    launched = Launched(
        target, overrides, log_path=log_path, keep_log=keep_log, health_timeout_s=health_timeout_s, status=status
    )
    try:
        with launched:
            if on_server is not None:
                on_server(launched.server)
            try:
                value = measure(launched.served)
            except Exception as exc:
                return Outcome(error=launched.blame(exc, activity), launch=launched.launch)
            crashed = launched.crash(activity)  # it returned, but the server died on the way: don't trust it
            return Outcome(None if crashed else value, crashed, launched.launch)
    except ServerStartError as exc:
        return Outcome(error=str(exc), launch=launched.launch)

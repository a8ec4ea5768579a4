"""Start a plan's OpenAI-compatible server as a subprocess (the engine's entry point, `python -m
engine.serve_entry PLAN`, which `dcpctl run PLAN` also serves through), wait for health, stop it.

evals launches the plans it measures with it, and a P/D deployment its prefill and decode instances. The server
runs in its own session. torchrun puts each rank in a session of its own, so the process tree is remembered
(psutil) and whatever of it outlives the server process is killed on stop. The server is told which process
started it (SUPERVISOR_ENV) and stops itself once that process is gone: an eval or a bench killed outright
(SIGKILL, the OOM killer), which runs no clean-up, leaves no server behind.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from engine.errors import UserError
from engine.runtime.launcher import free_port
from engine.serving.parent_watch import SUPERVISOR_ENV

DEFAULT_HEALTH_TIMEOUT_S = 600.0
_POLL_S = 0.2
PORT_RACE_RETRIES = 2  # new ports tried when another process took the free port this one picked before the bind


class ServerStartError(UserError):
    """The server did not become healthy (it exited, or timed out); the message carries its last log lines."""


_EXC_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b(:|$)")


def log_tail(path: Path | None) -> str:
    """The server's last error: from its last 'error:' line on (rich may wrap it), else a traceback's last
    exception line, else ''."""
    if path is None or not path.is_file():
        return ""
    body = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    starts = [i for i, ln in enumerate(body) if ln.lower().startswith("error:")]
    if starts:
        return " ".join(body[starts[-1] : starts[-1] + 6])
    raised = [ln for ln in body if _EXC_LINE.match(ln)]
    return raised[-1] if raised else ""


def last_line(path: Path | None) -> str:
    """The log's last non-empty line ('' if none)."""
    if path is None or not path.is_file():
        return ""
    body = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    return body[-1] if body else ""


def _default_sigint() -> None:
    # A parent started in the background (nohup, `cmd &` in a script) ignores SIGINT and children inherit that;
    # the server must see SIGINT to shut down cleanly.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """SIGTERM is a KeyboardInterrupt for the span of the block, so that servers started in it are stopped by the
    same clean-up as on Ctrl-C rather than orphaned (they run in sessions of their own, so the signal that ends
    this process never reaches them). Outside the main thread (no signal handlers there) it changes nothing.

    SIGINT gets the same handler (unless it is ignored): with Python's default one, `asyncio.run` (lm-eval's
    requests) turns Ctrl-C into a cancellation that a library can swallow, and the run then finished as if never
    interrupted; a handler of our own makes asyncio leave SIGINT alone, so it always raises."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    signals = [signal.SIGTERM] + ([signal.SIGINT] if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN else [])
    previous = {sig: signal.signal(sig, interrupt) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def connect_host(host: str) -> str:
    """The address to reach a server bound to `host` (a wildcard bind is reached on loopback)."""
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


class PlanServer:
    """`python -m engine.serve_entry PLAN [overrides] serve.port=PORT` as a subprocess; a context manager that
    waits for health.

    `time_to_healthy_s` is measured from process start to the first 200 from GET /health.
    """

    def __init__(
        self,
        plan: str | os.PathLike,
        overrides: list[str] | None = None,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        health_timeout_s: float = DEFAULT_HEALTH_TIMEOUT_S,
        log_path: Path | None = None,
        env: dict[str, str] | None = None,
        label: str | None = None,
        args: list[str] | None = None,
        port_key: str = "serve.port",
    ) -> None:
        self.plan = str(plan)
        self.overrides = list(overrides or [])
        self.args = list(args or [])  # options of engine.serve_entry (e.g. a P/D instance's --role)
        self.port_key = port_key  # the plan field the port goes to
        self.host = host
        self.port_picked = not port  # picked here: another free one may be tried (`wait_healthy`)
        self.port = port or free_port(connect_host(host))
        self.health_timeout_s = health_timeout_s
        self.label = label or Path(self.plan).stem
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkdtemp(prefix="dcpctl-serve-")) / "server.log"
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at: float | None = None
        self.time_to_healthy_s: float | None = None
        self.returncode: int | None = None
        self._tree: dict[int, Any] = {}  # pid -> psutil.Process of every descendant seen

    @property
    def base_url(self) -> str:
        """Server root, e.g. http://127.0.0.1:8123."""
        return f"http://{connect_host(self.host)}:{self.port}"

    @property
    def command(self) -> list[str]:
        """The command line: this interpreter's `engine.serve_entry`, with the port last so it wins."""
        port = f"{self.port_key}={self.port}"
        return [sys.executable, "-m", "engine.serve_entry", *self.args, self.plan, *self.overrides, port]

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        """True while the server process has not exited."""
        return self.proc is not None and self.proc.poll() is None

    def exit_reason(self) -> str | None:
        """None while running; else 'exited with code N: <its error>' or 'was killed by SIGKILL'."""
        if self.proc is None or self.proc.poll() is None:
            return None
        code = self.proc.returncode
        if code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
        else:
            how = f"exited with code {code}"
        tail = log_tail(self.log_path)
        return f"{how}: {tail}" if tail else how

    def healthy(self, timeout_s: float = 2.0) -> bool:
        """True if GET /health answers 200 now."""
        try:
            with httpx.Client(timeout=timeout_s, trust_env=False) as client:
                return client.get(f"{self.base_url}/health").status_code == 200
        except httpx.HTTPError:
            return False

    def start(self) -> PlanServer:
        """Start the process (output to log_path) and return at once."""
        if self.proc is not None:
            raise RuntimeError("server already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ if self.env is None else self.env, PYTHONUNBUFFERED="1")
        env[SUPERVISOR_ENV] = str(os.getpid())
        env["COLUMNS"] = "200"  # rich wraps at 80 columns when writing to a file
        with self.log_path.open("wb") as log:
            self.started_at = time.perf_counter()
            self.proc = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=_default_sigint,
            )
        return self

    def restart(self, log_path: Path) -> PlanServer:
        """Start a new process in place of one that has exited (the same command, its output to `log_path`: another
        path keeps the old log as it was); whatever of the old process tree is left is killed first."""
        assert self.proc is not None and self.proc.poll() is not None, "restart() replaces an exited server"
        self.stop()
        self.proc, self._tree = None, {}
        self.started_at = self.time_to_healthy_s = self.returncode = None
        self.log_path = Path(log_path)
        return self.start()

    def wait_healthy(self) -> float:
        """Poll GET /health until 200; return seconds since start. ServerStartError if the process exits or times
        out. A port picked here is free when picked, but the server binds it seconds later: if another process took
        it meanwhile (the server exits saying so), the server starts again on another free port."""
        retries = PORT_RACE_RETRIES if self.port_picked else 0
        while True:
            try:
                return self._wait_healthy_once()
            except ServerStartError:
                if retries == 0 or not self._port_taken():
                    raise
            retries -= 1
            self.port = free_port(connect_host(self.host))
            self.restart(self.log_path)

    def _port_taken(self) -> bool:
        """Whether the exited server's log says its port was in use when it bound it (`ensure_port_free`'s or
        `bind_socket`'s line)."""
        text = self.log_path.read_text(errors="replace") if self.log_path.is_file() else ""
        taken = re.compile(
            rf"{re.escape(self.port_key)}={self.port} on \S+ (is already in use|cannot be used \(.*in use)"
        )
        return any(taken.search(line) for line in text.splitlines())

    def _wait_healthy_once(self) -> float:
        assert self.proc is not None and self.started_at is not None, "start() first"
        deadline = self.started_at + self.health_timeout_s
        url = f"{self.base_url}/health"
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while True:
                reason = self.exit_reason()
                if reason is not None:
                    raise ServerStartError(
                        f"plan {self.label}: the server {reason} before it was healthy (log: {self.log_path})"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(url).status_code == 200:
                        self.time_to_healthy_s = time.perf_counter() - self.started_at
                        self.processes()  # the ranks exist now: remember them
                        return self.time_to_healthy_s
                if time.perf_counter() > deadline:
                    self.stop()
                    raise ServerStartError(
                        f"plan {self.label}: the server was not healthy at {url} within {self.health_timeout_s:.0f} s "
                        f"(last log line: {last_line(self.log_path) or 'none'}); raise the health timeout "
                        f"or check {self.log_path}"
                    )
                time.sleep(_POLL_S)

    def processes(self) -> list[Any]:
        """psutil.Process of every live descendant (torchrun, ranks), also remembering them for stop()."""
        try:
            import psutil
        except ImportError:  # accelerate brings psutil; without it only the process group is reached
            return []
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(psutil.Error):
                for child in psutil.Process(self.proc.pid).children(recursive=True):
                    self._tree.setdefault(child.pid, child)
        alive = []
        for child in self._tree.values():
            with contextlib.suppress(psutil.Error):
                if child.is_running() and child.status() != psutil.STATUS_ZOMBIE:
                    alive.append(child)
        return alive

    def _signal_group(self, sig: int) -> bool:
        """Send `sig` to the server's process group; False if nothing is left in it."""
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def _kill_leftovers(self) -> None:
        leftovers = self.processes()
        for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            for child in leftovers:
                with contextlib.suppress(Exception):
                    child.send_signal(sig)
            deadline = time.monotonic() + wait_s
            while leftovers and time.monotonic() < deadline:
                leftovers = self.processes()
                time.sleep(0.1)
            if not leftovers:
                return

    def stop(self, grace_s: float = 30.0) -> int | None:
        """SIGINT (clean shutdown), then SIGTERM, then SIGKILL; then kill any rank left behind. Return the code."""
        if self.proc is None:
            return None
        self.processes()
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGINT)  # the server forwards it to torchrun and the ranks
            for sig, wait_s in ((None, grace_s), (signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
                if sig is not None:
                    self._signal_group(sig)
                try:
                    self.proc.wait(timeout=wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if self._signal_group(0):
            self._signal_group(signal.SIGKILL)
        self._kill_leftovers()
        self.returncode = self.proc.returncode
        return self.returncode

    def kill(self) -> None:
        """SIGKILL the whole process tree at once (tests: an engine crash)."""
        if self.proc is None:
            return
        tree = self.processes()
        self._signal_group(signal.SIGKILL)
        for child in tree:
            with contextlib.suppress(Exception):
                child.kill()
        self.proc.wait()

    def __enter__(self) -> PlanServer:
        self.start()
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

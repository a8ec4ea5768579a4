"""Start a plan's ranks with torchrun (torch.distributed.run) and report the root error of a failed run."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from engine.errors import UserError
from engine.plan.checks import PlanReport


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def ensure_port_free(host: str, port: int, what: str) -> None:
    """UserError when `port` on `host` is already taken."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            raise UserError(
                f"{what}={port} on {host} is already in use; choose another port (or 0 to pick a free one)"
            ) from None


def torchrun_command(report: PlanReport, worker_args: list[str]) -> list[str]:
    """The torchrun command line for this node of the plan."""
    launch = report.plan.launch
    local = report.world_size // launch.nnodes
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={launch.nnodes}",
        f"--nproc-per-node={local}",
        f"--node-rank={launch.node_rank}",
        "--max-restarts=0",
        "--monitor-interval=0.5",
    ]
    if launch.rdzv_endpoint:
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={launch.rdzv_endpoint}"]
    else:
        port = launch.master_port or free_port()
        if launch.master_port and launch.node_rank == 0 and launch.nnodes == 1:
            ensure_port_free(launch.master_addr, port, "launch.master_port")
        cmd += [f"--master-addr={launch.master_addr}", f"--master-port={port}"]
    return [*cmd, "-m", "engine.worker", *worker_args]


_ROOT_CAUSE = re.compile(r"Root Cause \(first observed failure\):.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.S)


def _root_error(error_dir: Path, log_text: str) -> str | None:
    """The failing rank's own message, or how it died.

    torchrun names the first rank it saw fail, but a peer's connection error can reach it before the rank that
    raised has exited; the earliest error a rank wrote is the cause whenever there is one.
    """
    errors: dict[int, dict] = {}
    for file in error_dir.glob("rank*.json"):
        try:
            record = json.loads(file.read_text())
        except (OSError, ValueError):
            continue
        errors[record["rank"]] = record
    match = _ROOT_CAUSE.search(log_text)
    if match:
        rank, code = int(match.group(1)), int(match.group(2))
        if rank not in errors:
            return f"rank {rank} " + (
                f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
            )
    if errors:
        first = min(errors.values(), key=lambda e: e["time"])
        return f"rank {first['rank']}: {first['message']}"
    return None


def plan_args(report: PlanReport, overrides: list[str]) -> list[str]:
    """Worker arguments that reproduce this plan (file + overrides) on every rank."""
    args = ["--plan", report.source]
    for item in overrides:
        args += ["--set", item]
    if report.kv_budget_bytes is not None and report.device == "cpu":
        args += ["--set", f"cache.memory={report.kv_budget_bytes}B"]  # every rank sizes the same cache
    return args


def launch(report: PlanReport, overrides: list[str], job_args: list[str]) -> None:
    """Run the plan's ranks to completion; a UserError names the root cause if any rank fails."""
    run_dir = Path(tempfile.mkdtemp(prefix="dcpctl-run-"))
    log = run_dir / "torchrun.log"
    cmd = torchrun_command(report, [*plan_args(report, overrides), "--error-dir", str(run_dir), *job_args])
    env = dict(os.environ, LOGLEVEL=os.environ.get("LOGLEVEL", "ERROR"), PYTHONUNBUFFERED="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    with log.open("wb") as log_file:
        proc = subprocess.Popen(cmd, env=env, stderr=log_file)
        # SIGTERM to this process alone must still stop torchrun and its ranks (Ctrl-C reaches them anyway)
        previous = signal.signal(signal.SIGTERM, lambda *_: proc.send_signal(signal.SIGTERM))
        try:
            code = proc.wait()
        except KeyboardInterrupt:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
        finally:
            signal.signal(signal.SIGTERM, previous)
    if code == 0:
        shutil.rmtree(run_dir, ignore_errors=True)
        return
    log_text = log.read_text(errors="replace") if log.exists() else ""
    tail = log_text.strip().splitlines()[-1:]
    reason = _root_error(run_dir, log_text) or (tail[0] if tail else f"torchrun exited with {code}")
    raise UserError(f"the run failed: {reason} (full log: {log})")

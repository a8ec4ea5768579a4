"""Start a plan's ranks with torchrun (torch.distributed.run) and report the root error of a failed run."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from engine.errors import UserError
from engine.plan.schema import LaunchSection

_LOWEST_PICKED_PORT = 10000


def ephemeral_port_range() -> tuple[int, int]:
    """The ports the kernel hands to outgoing connections (Linux's default where /proc does not say)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now, below the ephemeral range when there is room.

    A server binds the port seconds after it is picked; an ephemeral port could meanwhile become the local end of
    an outgoing connection (gloo's, torchrun's, an HTTP client's) and the bind would fail.
    """
    low, _ = ephemeral_port_range()
    ports = list(range(_LOWEST_PICKED_PORT, low))
    random.shuffle(ports)
    for port in [*ports[:64], 0]:  # 0: the kernel's pick, when nothing below the range is free
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return sock.getsockname()[1]
    raise UserError(f"no free TCP port on {host}")


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


def torchrun_command(launch: LaunchSection, ranks_per_node: int, worker_args: list[str]) -> list[str]:
    """The torchrun command line for this node of a plan's launch section."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={launch.nnodes}",
        f"--nproc-per-node={ranks_per_node}",
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


_FAILURE = re.compile(r"^\s*rank\s*:\s*(\d+).*\n\s*exitcode\s*:\s*(-?\d+)", re.M)
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "gloo/transport")


def _root_error(error_dir: Path, log_text: str) -> str | None:
    """The rank that caused the failure: its own message, or how it died.

    A rank that loses a peer fails with a connection error, and torchrun may observe that first; so the cause is the
    earliest error a rank wrote that is not a lost peer, else a rank that died without writing one, else any error.
    """
    errors: dict[int, dict] = {}
    for file in error_dir.glob("rank*.json"):
        try:
            record = json.loads(file.read_text())
        except (OSError, ValueError):
            continue
        errors[record["rank"]] = record
    own = [e for e in errors.values() if not any(s in e["message"] for s in _PEER_LOST)]
    if own:
        return _earliest(own)
    # torchrun lists the other failures (e.g. the ranks it then stopped with SIGTERM) before its root cause
    others, _, root_cause = log_text.rpartition("Root Cause")
    for rank, code in ((int(r), int(c)) for r, c in _FAILURE.findall(root_cause) + _FAILURE.findall(others)):
        if rank not in errors:
            return f"rank {rank} " + (
                f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
            )
    return _earliest(list(errors.values())) if errors else None


def _earliest(records: list[dict]) -> str:
    first = min(records, key=lambda e: e["time"])
    return f"rank {first['rank']}: {first['message']}"


def launch(
    section: LaunchSection, ranks_per_node: int, plan_file: str, overrides: list[str], job_args: list[str]
) -> None:
    """Run this node's ranks of a plan to completion, each loading `plan_file` with `overrides`; a UserError names
    the root cause if any rank fails."""
    run_dir = Path(tempfile.mkdtemp(prefix="dcpctl-run-"))
    log = run_dir / "torchrun.log"
    plan_args = ["--plan", plan_file, *(arg for item in overrides for arg in ("--set", item))]
    worker_args = [*plan_args, "--error-dir", str(run_dir), *job_args]
    cmd = torchrun_command(section, ranks_per_node, worker_args)
    env = dict(os.environ, LOGLEVEL=os.environ.get("LOGLEVEL", "ERROR"), PYTHONUNBUFFERED="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    # started in the background (nohup, `&`) SIGINT arrives ignored, and torchrun would inherit that: `kill -INT`
    # must still stop every rank, as it stops a one-rank server
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
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
            signal.signal(signal.SIGINT, previous_int)
    if code == 0:
        shutil.rmtree(run_dir, ignore_errors=True)
        return
    log_text = log.read_text(errors="replace") if log.exists() else ""
    tail = log_text.strip().splitlines()[-1:]
    reason = _root_error(run_dir, log_text) or (tail[0] if tail else f"torchrun exited with {code}")
    raise UserError(f"the run failed: {reason} (full log: {log})")

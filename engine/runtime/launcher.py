"""Start a plan's ranks with torchrun (torch.distributed.run) and report the root error of a failed run.

Every rank's stderr goes to its own file under the run's folder and, prefixed with its rank, to the run's
`torchrun.log`; rank 0's also comes to this process's stderr, as a one-rank run prints it.
"""

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
import threading
from pathlib import Path
from typing import BinaryIO

from engine.errors import PEER_LOST, UserError
from engine.plan.schema import LaunchSection

_LOWEST_PICKED_PORT = 10000
_RANK_PREFIX = "[rank${rank}]:"  # torchrun's prefix for the stderr lines of each rank it tees
_ECHOED = b"[rank0]:"


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


def torchrun_command(launch: LaunchSection, ranks_per_node: int, worker_args: list[str], log_dir: Path) -> list[str]:
    """The torchrun command line for this node of a plan's launch section; each rank's stderr goes to a file under
    `log_dir` and, prefixed with the rank, to torchrun's stderr."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={launch.nnodes}",
        f"--nproc-per-node={ranks_per_node}",
        f"--node-rank={launch.node_rank}",
        "--max-restarts=0",
        "--monitor-interval=0.5",
        f"--log-dir={log_dir}",
        "--tee=2",
    ]
    if launch.rdzv_endpoint:
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={launch.rdzv_endpoint}"]
        cmd += [f"--rdzv-conf=join_timeout={launch.rdzv_timeout_s}"]
    else:
        cmd += [f"--rdzv-conf=timeout={launch.rdzv_timeout_s}"]
        port = launch.master_port or free_port()
        if launch.master_port and launch.node_rank == 0 and launch.nnodes == 1:
            ensure_port_free(launch.master_addr, port, "launch.master_port")
        cmd += [f"--master-addr={launch.master_addr}", f"--master-port={port}"]
    return [*cmd, "-m", "engine.worker", *worker_args]


_FAILURE = re.compile(r"^\s*rank\s*:\s*(\d+).*\n\s*exitcode\s*:\s*(-?\d+)", re.M)


_LOST_PEER_AT = re.compile(r"\[([^\]]+)\]:(\d+)")  # gloo names the peer it lost as [host]:port


def _rendezvous_failure(section: LaunchSection, log_text: str) -> str | None:
    """What to do when the nodes never met (no rank started): which node waited for which, and what to start."""
    timeout = f"launch.rdzv_timeout_s={section.rdzv_timeout_s} s"
    where = f"{section.master_addr}:{section.master_port}"
    if joined := re.search(r"waiting for clients\. (\d+)/(\d+) clients joined", log_text):
        return (
            f"node 0 waited {timeout} for the other nodes at {where} and {joined[1]} of {joined[2]} joined; start "
            f"every node with launch.nnodes={section.nnodes}, its own launch.node_rank and the same "
            "launch.master_addr and launch.master_port"
        )
    if "trying to connect to" in log_text and "DistNetworkError" in log_text:
        return (
            f"node {section.node_rank} found no node 0 at {where} within {timeout}; start node 0 "
            "(launch.node_rank=0) there, or point launch.master_addr and launch.master_port at it"
        )
    if "RendezvousTimeoutError" in log_text:
        return (
            f"not all launch.nnodes={section.nnodes} nodes joined the rendezvous at {section.rdzv_endpoint} within "
            f"{timeout}; start every node with the same launch.rdzv_endpoint"
        )
    return None


def _lost_to_another_node(section: LaunchSection, records: list[dict]) -> str | None:
    """Every rank here failed only because it lost a peer, and the peers are on other nodes: the cause is there."""
    if section.nnodes < 2 or not records or not all(any(s in r["message"] for s in PEER_LOST) for r in records):
        return None
    first = min(records, key=lambda e: e["time"])
    node = f"node {1 - section.node_rank}" if section.nnodes == 2 else "a rank on another node"
    lost = next(s for s in PEER_LOST if s in first["message"])
    at = _LOST_PEER_AT.search(first["message"])
    peer = f" at {at[1]}:{at[2]}" if at else ""
    return f"{node} went away (rank {first['rank']} lost its peer{peer}: {lost}); that node's own log says why"


def _root_error(error_dir: Path, log_text: str, section: LaunchSection | None = None) -> str | None:
    """The rank that caused the failure: its own message, or how it died.

    A rank that loses a peer fails with a connection error, and torchrun may observe that first; so the cause is the
    earliest error a rank wrote that is not a lost peer, else a rank that died without writing one, else (ranks here
    that only lost peers on other nodes) the other node, else any error. No rank ran: why the nodes never met.
    """
    errors: dict[int, dict] = {}
    for file in error_dir.glob("rank*.json"):
        try:
            record = json.loads(file.read_text())
        except (OSError, ValueError):
            continue
        errors[record["rank"]] = record
    own = [e for e in errors.values() if not any(s in e["message"] for s in PEER_LOST)]
    if own:
        return _earliest(own)
    # torchrun lists the other failures (e.g. the ranks it then stopped with SIGTERM) before its root cause
    others, _, root_cause = log_text.rpartition("Root Cause")
    for rank, code in ((int(r), int(c)) for r, c in _FAILURE.findall(root_cause) + _FAILURE.findall(others)):
        if rank not in errors:
            return f"rank {rank} " + (
                f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
            )
    if section is not None and (elsewhere := _lost_to_another_node(section, list(errors.values()))):
        return elsewhere
    if errors:
        return _earliest(list(errors.values()))
    return _rendezvous_failure(section, log_text) if section is not None and section.nnodes > 1 else None


def _earliest(records: list[dict]) -> str:
    first = min(records, key=lambda e: e["time"])
    return f"rank {first['rank']}: {first['message']}"


def _copy_stderr(stream: BinaryIO, log_file: BinaryIO) -> None:
    """torchrun's stderr into the log, and rank 0's lines (without their prefix) to this process's stderr too."""
    echo = True
    for line in stream:
        log_file.write(line)
        log_file.flush()
        if echo and line.startswith(_ECHOED):
            try:
                sys.stderr.buffer.write(line[len(_ECHOED) :].removeprefix(b" "))
                sys.stderr.flush()
            except (OSError, ValueError):  # nobody reads this process's stderr any more
                echo = False


def launch(
    section: LaunchSection, ranks_per_node: int, plan_file: str, overrides: list[str], job_args: list[str]
) -> signal.Signals | None:
    """Run this node's ranks of a plan to completion, each loading `plan_file` with `overrides`; a UserError names
    the root cause if any rank fails.

    SIGINT or SIGTERM to this process stops the ranks (torchrun passes it on); returns that signal once they have
    stopped cleanly (None: they ran to completion).
    """
    run_dir = Path(tempfile.mkdtemp(prefix="dcpctl-run-"))
    log = run_dir / "torchrun.log"
    plan_args = ["--plan", plan_file, *(arg for item in overrides for arg in ("--set", item))]
    worker_args = [*plan_args, "--error-dir", str(run_dir), *job_args]
    cmd = torchrun_command(section, ranks_per_node, worker_args, run_dir / "ranks")
    env = dict(os.environ, LOGLEVEL=os.environ.get("LOGLEVEL", "ERROR"), PYTHONUNBUFFERED="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = _RANK_PREFIX
    stopped_by: list[signal.Signals] = []

    def stop(signum: int) -> None:
        stopped_by.append(signal.Signals(signum))
        proc.send_signal(signum)

    # started in the background (nohup, `&`) SIGINT arrives ignored, and torchrun would inherit that: `kill -INT`
    # must still stop every rank, as it stops a one-rank server
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    with log.open("wb") as log_file:
        proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE)
        copier = threading.Thread(target=_copy_stderr, args=(proc.stderr, log_file), daemon=True)
        copier.start()
        # SIGTERM to this process alone must still stop torchrun and its ranks (Ctrl-C reaches them anyway)
        previous = signal.signal(signal.SIGTERM, lambda signum, _: stop(signum))
        try:
            code = proc.wait()
        except KeyboardInterrupt:
            stop(signal.SIGINT)
            try:
                code = proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
        finally:
            signal.signal(signal.SIGTERM, previous)
            signal.signal(signal.SIGINT, previous_int)
        copier.join()
    # torchrun fails itself when it is signalled; the ranks stopped cleanly if none of them reported an error
    if code == 0 or (stopped_by and not any(run_dir.glob("rank*.json"))):
        shutil.rmtree(run_dir, ignore_errors=True)
        return stopped_by[0] if stopped_by else None
    log_text = log.read_text(errors="replace") if log.exists() else ""
    tail = log_text.strip().splitlines()[-1:]
    reason = _root_error(run_dir, log_text, section) or (tail[0] if tail else f"torchrun exited with {code}")
    raise UserError(f"the run failed: {reason} (full log: {log})")

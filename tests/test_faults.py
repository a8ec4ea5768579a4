"""Faults in a multi-rank run: a dead or raising rank ends all ranks with the root error; Ctrl-C; busy ports."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.oracle import write_plan

pytestmark = pytest.mark.multiproc

# Loaded into every rank through sitecustomize: each step waits STEP_DELAY_S (so a run lasts long enough to be
# killed mid-generation however fast the machine), and rank 1 raises at step FAULT_AT_STEP when it is set.
STEP_HOOK = """
import os, time
if "RANK" in os.environ:
    from engine.runtime.model_runner import ModelRunner
    original, calls = ModelRunner.execute, [0]
    def execute(self, plan):
        calls[0] += 1
        if os.environ["RANK"] == "1" and str(calls[0]) == os.environ.get("FAULT_AT_STEP"):
            raise RuntimeError("injected fault on rank 1")
        time.sleep(float(os.environ.get("STEP_DELAY_S", "0")))
        return original(self, plan)
    ModelRunner.execute = execute
"""


def workers(marker: str) -> dict[int, int]:
    """rank -> pid of the engine.worker processes whose command line contains `marker`."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            if "engine.worker" not in cmdline or marker not in cmdline or "torch.distributed.run" in cmdline:
                continue
            env = dict(
                item.split("=", 1) for item in (proc / "environ").read_bytes().decode().split("\0") if "=" in item
            )
            found[int(env["RANK"])] = int(proc.name)
        except (OSError, ValueError, KeyError):
            continue
    return found


def start_run(tmp_path, tiny_models, extra_env=None, settings=None):
    folder = tiny_models("deepseek_v2")
    plan = write_plan(tmp_path, folder, {"parallel.tp": 2, "parallel.dcp": 2, **(settings or {})})
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello world\nthe quick brown fox\n")
    stats = tmp_path / "stats"
    hook = tmp_path / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(STEP_HOOK)
    pythonpath = os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")])
    env = dict(
        os.environ, DCPCTL_RANK_STATS_DIR=str(stats), PYTHONPATH=pythonpath, STEP_DELAY_S="0.02", **(extra_env or {})
    )
    cmd = [
        sys.executable,
        "-m",
        "dcpctl.cli",
        "run",
        str(plan),
        "--prompts-file",
        str(prompts),
        "--max-tokens",
        "480",
        "--ignore-eos",
    ]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    return proc, str(plan), stats


def wait_for_ranks(proc, stats: Path, count: int = 2, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while len(list(stats.glob("rank*.json"))) < count:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "ranks did not start"
        time.sleep(0.2)
    time.sleep(0.5)  # let generation get going (each step takes 20+ ms: 480 steps outlast the test)


def finish(proc, timeout: float) -> tuple[int, str, float]:
    start = time.monotonic()
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, " ".join(err.split()), time.monotonic() - start


def shm_segments(pids) -> list[str]:
    """Shared-memory segments the ranks made (named after their creator's pid) still linked in /dev/shm."""
    return [p.name for pid in pids for p in Path("/dev/shm").glob(f"dcpctl-{pid}-*")]


def test_killed_rank_ends_every_rank_with_the_root_cause(tmp_path, tiny_models):
    proc, marker, stats = start_run(tmp_path, tiny_models)
    wait_for_ranks(proc, stats)
    ranks = workers(marker)
    assert set(ranks) == {0, 1}
    # the survivor waits in a shared-memory collective (the default on one node), not in gloo
    assert json.loads((stats / "rank0.json").read_text())["collectives"].startswith("shared memory")
    os.kill(ranks[1], signal.SIGKILL)
    code, err, took = finish(proc, timeout=30)
    assert code == 1 and took < 15
    assert "error: the run failed: rank 1 was killed by SIGKILL" in err
    assert "Traceback" not in err
    assert workers(marker) == {}
    assert shm_segments(ranks.values()) == []


def test_raising_rank_reports_its_own_error(tmp_path, tiny_models):
    proc, marker, _ = start_run(tmp_path, tiny_models, extra_env={"FAULT_AT_STEP": "3"})
    code, err, _ = finish(proc, timeout=120)
    assert code == 1
    assert "error: the run failed: rank 1: RuntimeError: injected fault on rank 1" in err
    assert workers(marker) == {}


def test_ctrl_c_stops_every_rank(tmp_path, tiny_models):
    proc, marker, stats = start_run(tmp_path, tiny_models)
    wait_for_ranks(proc, stats)
    ranks = workers(marker)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
    code, _, took = finish(proc, timeout=30)
    assert code != 0 and took < 15
    assert workers(marker) == {}
    assert shm_segments(ranks.values()) == []


def test_busy_master_port_is_a_clear_error(tmp_path, tiny_models):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        proc, _, _ = start_run(tmp_path, tiny_models, settings={"launch.master_port": port})
        code, err, _ = finish(proc, timeout=60)
    assert code == 1
    assert f"error: launch.master_port={port} on 127.0.0.1 is already in use" in err


def _torchrun_failure(rank: int, exitcode: int) -> str:
    return f"[1]:\n  rank      : {rank} (local_rank: {rank})\n  exitcode  : {exitcode} (pid: 7)\n"


def _torchrun_root_cause(rank: int, exitcode: int) -> str:
    return "Root Cause (first observed failure):\n" + _torchrun_failure(rank, exitcode)


def test_root_error_prefers_the_earliest_error_a_rank_wrote(tmp_path):
    import json

    from engine.runtime.launcher import _root_error

    (tmp_path / "rank0.json").write_text(json.dumps({"rank": 0, "time": 2.0, "message": "Connection closed by peer"}))
    (tmp_path / "rank1.json").write_text(json.dumps({"rank": 1, "time": 1.0, "message": "RuntimeError: boom"}))
    # torchrun saw rank 0's lost-peer error first; rank 1's own error is the cause
    assert _root_error(tmp_path, _torchrun_root_cause(0, 1)) == "rank 1: RuntimeError: boom"
    (tmp_path / "rank1.json").unlink()
    # rank 1 was killed (no error of its own): rank 0's lost peer is only the symptom
    log = _torchrun_root_cause(0, 1) + _torchrun_root_cause(1, -9)
    assert _root_error(tmp_path, log) == "rank 1 was killed by SIGKILL"
    (tmp_path / "rank0.json").unlink()
    # neither wrote an error: torchrun lists the rank it stopped (SIGTERM) first, then the root cause
    log = "Failures:\n" + _torchrun_failure(0, -15) + _torchrun_root_cause(1, -9)
    assert _root_error(tmp_path, log) == "rank 1 was killed by SIGKILL"
    assert _root_error(tmp_path, _torchrun_root_cause(1, 3)) == "rank 1 exited with code 3"
    assert _root_error(tmp_path, "") is None


def test_free_port_is_bindable_and_outside_the_ephemeral_range():
    """Outgoing connections (gloo, torchrun, clients) cannot take the picked port before the server binds it."""
    from engine.runtime.launcher import ephemeral_port_range, free_port

    low, high = ephemeral_port_range()
    for _ in range(20):
        port = free_port()
        assert not low <= port <= high
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))

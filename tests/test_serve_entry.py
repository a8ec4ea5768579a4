"""`python -m engine.serve_entry PLAN`: the engine's own way to serve a plan behaves as `dcpctl run PLAN` does
(same error lines and exit codes), and serves the plan until SIGINT or SIGTERM (a clean stop: exit 0, with the
server's log on the terminal, whatever the number of ranks)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from engine.runtime.launcher import free_port
from evals.launch import PlanServer
from tests.oracle import write_plan
from tests.test_server import _dcpctl_run, _wait_for_banner

ENTRY = [sys.executable, "-m", "engine.serve_entry"]
DCPCTL_RUN = [sys.executable, "-m", "dcpctl.cli", "run"]


def _run(cmd: list[str]) -> tuple[int, str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    return proc.returncode, " ".join(proc.stderr.split())  # rich wraps dcpctl's error line


@pytest.fixture
def tiny_llama(tiny_models) -> Path:
    return tiny_models("llama", num_layers=1)


def test_missing_model_is_the_same_error_as_dcpctl_run(tmp_path):
    plan = str(write_plan(tmp_path, tmp_path / "no-such-model", name="nomodel.yaml"))
    code, err = _run([*ENTRY, plan])
    assert code == 1
    assert err.startswith("error: plan nomodel: model folder") and "no-such-model not found" in err
    assert "dcpctl model pull" in err and "Traceback" not in err
    assert _run([*DCPCTL_RUN, plan]) == (code, err)


def test_invalid_plan_and_busy_port_fail_as_dcpctl_run(tmp_path, tiny_llama):
    bad = str(write_plan(tmp_path, tiny_llama, {"parallel.interleave": 3}, name="bad.yaml"))
    code, err = _run([*ENTRY, bad])
    assert code == 1 and err.startswith("error: plan bad is invalid:") and "interleave" in err
    assert _run([*DCPCTL_RUN, bad]) == (code, err)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = f"serve.port={busy.getsockname()[1]}"
        plan = str(write_plan(tmp_path, tiny_llama))
        code, err = _run([*ENTRY, plan, taken])
        assert code == 1 and f"error: {taken} on 127.0.0.1 is already in use" in err
        assert _run([*DCPCTL_RUN, plan, taken]) == (code, err)


def test_the_launching_process_resolves_a_plan_without_torch(tmp_path, tiny_llama):
    """`dcpctl run` checks the plan and starts torchrun without importing torch: its ranks pay for that, and an
    import of seconds on the launch's critical path would only delay them."""
    plan = write_plan(tmp_path, tiny_llama, {"parallel.dcp": 2})
    code = (
        "import sys\n"
        "from engine.serve_entry import launch_ranks, runnable_plan\n"
        f"resolved = runnable_plan({str(plan)!r}, [])\n"
        "assert resolved.world_size == 2\n"
        "from engine.runtime import launcher\n"
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_pd_supervisor_its_router_and_an_http_client_run_without_torch():
    """`dcpctl run` of a P/D plan supervises two instances and a router, and `--prompt` sends the prompts over HTTP:
    none of that imports the engine (a P/D run's launching process imported torch for a socket helper: ~2 s of CPU
    on the critical path)."""
    code = (
        "import sys\n"
        "import dcpctl.run_cmd, engine.offline, engine.serve_entry, engine.serving.deployment, engine.serving.router\n"
        "print(sorted(m for m in ('torch', 'transformers', 'engine.core.engine') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert done.stdout.strip() == "[]", done.stdout


def test_usage_errors_exit_2():
    assert _run(ENTRY)[0] == 2
    assert _run(DCPCTL_RUN)[0] == 2


def test_serves_the_plan_until_sigint(tmp_path, tiny_llama):
    plan = write_plan(tmp_path, tiny_llama, {"serve.model_name": "tiny"})
    with PlanServer(plan, log_path=tmp_path / "server.log") as server:
        assert server.command[1:3] == ["-m", "engine.serve_entry"]
        models = httpx.get(f"{server.base_url}/v1/models", trust_env=False).json()["data"]
        assert [m["id"] for m in models] == ["tiny"]
    assert server.returncode == 0
    assert f"serving tiny on {server.base_url}" in (tmp_path / "server.log").read_text()


@pytest.mark.parametrize("dcp", [1, pytest.param(2, marks=[pytest.mark.slow, pytest.mark.multiproc])])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_the_server_cleanly_with_its_log_on_the_terminal(tmp_path, tiny_llama, dcp, sig):
    runs = tmp_path / "tmp"  # where a run of several ranks keeps its folder
    runs.mkdir()
    log = tmp_path / "run.log"
    plan = write_plan(tmp_path, tiny_llama, {"parallel.dcp": dcp})
    proc = _dcpctl_run(plan, [f"serve.port={free_port()}"], log, {"TMPDIR": str(runs)})
    try:
        _wait_for_banner(proc, log, timeout=240)
        proc.send_signal(sig)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = log.read_text()
    assert code == 0, out[-3000:]
    assert "dcpctl.server: shutting down" in out and "dcpctl.server: engine stopped" in out, out[-3000:]
    assert "the run failed" not in out and "Traceback" not in out, out[-3000:]
    assert not list(runs.glob("dcpctl-run-*"))

"""A plan served by vLLM (`engine.name: vllm`) as an eval / bench target: every reason it cannot be launched is one
line before anything launches (fast), and with an installed vLLM (slow): a server that never becomes healthy and a
vLLM that dies mid-measurement each end in one line, with no process of it left behind."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import psutil
import pytest

from engine.checkpoints.pull import pull_model
from engine.peers.vllm_check import SHIM
from evals.launch import ServerStartError
from evals.lifecycle import Launched, measure_target
from evals.synthetic import write_synthetic_gsm8k
from evals.targets import resolve_targets
from tests.test_eval_cmd import invoke
from tests.test_vllm_check import installed_vllm

ROOT = Path(__file__).resolve().parents[1]
VLLM_PLAN = str(ROOT / "plans/cpu/smollm2_tp1_dcp1_vllm.yaml")


def test_an_unknown_engine_is_a_plan_error():
    check = resolve_targets([VLLM_PLAN], ["engine.name=tgi"])
    assert check.problems == ["plan smollm2_tp1_dcp1_vllm: command line: engine.name='tgi' is not one of dcpctl, vllm"]


def test_a_layout_vllm_cannot_run_fails_before_launching_with_the_exports_reason():
    check = resolve_targets([str(ROOT / "plans/cpu/smollm2_tp1_dcp2_i16.yaml")], ["engine.name=vllm"])
    assert check.problems == [
        "plan smollm2_tp1_dcp2_i16: vLLM cannot run it (vLLM runs DCP inside the TP group: tensor_parallel_size "
        "must be divisible by decode_context_parallel_size (tp=1, dcp=2); dcpctl's replica ranks (world size 2) have "
        "no vLLM equivalent [vLLM docs/serving/context_parallel_deployment.md; vLLM ParallelConfig ('tp_size must be "
        "divisible by dcp_size')]); use engine.name=dcpctl for this layout"
    ]


def test_a_pd_plan_vllm_could_run_is_refused_before_launching_with_what_to_do_instead(make_plan, tmp_path):
    from tests.conftest import mla_fields, write_config

    mla = write_config(tmp_path / "mla", **mla_fields(num_attention_heads=8))
    make_plan(f"model: {{path: {mla}}}\nparallel: {{tp: 4}}\ncache: {{block_size: 16}}\n", "p.yaml")
    decode = make_plan("base: p.yaml\nname: d\nparallel: {tp: 4, dcp: 4, interleave: 16}\ndisagg: {prefill: p.yaml}\n")
    assert resolve_targets([str(decode)], ["engine.name=vllm"]).problems == [
        "plan d: dcpctl launches one `vllm serve` per target, and vLLM's P/D needs 2 instances joined by NIXL and a "
        f"proxy of its own; start those from `dcpctl plan export {decode} --to vllm` and give eval their URL, or use "
        "engine.name=dcpctl"
    ]


def test_no_vllm_or_a_venv_without_it_is_one_line(monkeypatch, tmp_path):
    monkeypatch.delenv("DCPCTL_VLLM_PYTHON", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    (problem,) = resolve_targets([VLLM_PLAN], []).problems
    assert problem == (
        "plan smollm2_tp1_dcp1_vllm: engine.name=vllm but no vLLM was found; set engine.python or "
        "$DCPCTL_VLLM_PYTHON to the python of a venv with vllm, or put its `vllm` on PATH"
    )
    (problem,) = resolve_targets([VLLM_PLAN], ["engine.python=/usr/bin/python3"]).problems
    assert problem.startswith("plan smollm2_tp1_dcp1_vllm: /usr/bin/python3 does not import vllm (")


def measure(target, overrides: list[str], timeout_s: float, measure_fn, tmp_path: Path, on_server=None):
    return measure_target(
        target,
        overrides,
        measure_fn,
        activity="eval",
        log_path=tmp_path / "vllm.log",
        keep_log=True,
        health_timeout_s=timeout_s,
        status=lambda _: None,
        on_server=on_server,
    )


def group_alive(pgid: int) -> list[int]:
    """Live (not zombie: a killed child not yet reaped by init runs nothing) processes of group `pgid`."""
    return [
        p.pid
        for p in psutil.process_iter(["pid", "status"])
        if _pgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE
    ]


def shim_processes() -> list[int]:
    """Live processes started through the vLLM shim's `serve` (vLLM's API server, EngineCore and workers are its
    children: they carry its command line or are in its group); the shim's short `check` runs of
    tests/test_vllm_check.py, which may run beside these tests, are not servers."""
    alive = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        server = str(SHIM) in cmdline and f"{SHIM} check " not in cmdline
        if server and proc.info["status"] != psutil.STATUS_ZOMBIE:
            alive.append(proc.info["pid"])
    return alive


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


@pytest.mark.slow
def test_never_healthy_then_a_crash_mid_eval_leave_no_process(tmp_path):
    installed_vllm()
    never = ["engine.startup_timeout_s=3"]  # vLLM-CPU needs a minute or more
    (target,) = resolve_targets([VLLM_PLAN], never).targets
    launched = Launched(
        target, never, log_path=tmp_path / "never.log", keep_log=True, health_timeout_s=600, status=lambda _: None
    )
    with pytest.raises(ServerStartError) as err, launched:
        pass
    assert str(err.value).startswith("plan smollm2_tp1_dcp1_vllm: the server was not healthy at http://127.0.0.1:")
    assert "within 3 s" in str(err.value)
    assert group_alive(launched.server.pid) == [] and shim_processes() == []
    eager = ["model.enforce_eager=true"]  # what is checked is the cleanup: vLLM starts faster without torch.compile
    (target,) = resolve_targets([VLLM_PLAN], eager).targets
    servers = {}

    def crash_mid_eval(served):
        with httpx.Client(timeout=120, trust_env=False) as client:
            body = {"model": "smollm2_tp1_dcp1_vllm", "prompt": "The capital of France is", "max_tokens": 4}
            reply = client.post(f"{served.base_url}/v1/completions", json=body)
            servers["text"] = reply.json()["choices"][0]["text"]
        server = servers["server"]
        engine_core = [
            p for p in server.processes() if "EngineCore" in " ".join(p.cmdline()) or p.name() == "VLLM::EngineCore"
        ]
        assert engine_core, [p.cmdline() for p in server.processes()]
        for proc in engine_core:
            proc.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 60
        while server.alive() and time.monotonic() < deadline:
            time.sleep(0.5)
        raise RuntimeError("the request after the crash failed")

    outcome = measure(target, eager, 600, crash_mid_eval, tmp_path, lambda s: servers.update(server=s))
    assert servers["text"].strip(), servers
    assert outcome.error.startswith(("the server exited with code", "the server was killed by"))
    assert outcome.error.endswith("during the eval")
    assert group_alive(servers["server"].pid) == [] and shim_processes() == []


@pytest.mark.slow  # the plan must be runnable first: needs the SmolLM2 checkpoint
def test_dcpctl_run_says_how_to_serve_a_vllm_plan():
    from typer.testing import CliRunner

    from dcpctl.cli import app

    result = CliRunner().invoke(app, ["run", VLLM_PLAN, "--prompt", "hi"])
    assert str(result.exception) == (
        f"plan smollm2_tp1_dcp1_vllm names engine.name=vllm, which `dcpctl eval` and `dcpctl bench` launch; "
        f"`dcpctl run` serves with dcpctl's engine: run `dcpctl plan export {VLLM_PLAN} --to vllm` and start that "
        "command, or set engine.name=dcpctl"
    )


@pytest.mark.slow
@pytest.mark.multiproc
def test_an_eval_of_vllm_itself_agrees_with_dcpctls_plan_or_explains_each_difference(tmp_path):
    """The issue's layout-against-layout check on a real vLLM: `dcpctl eval gsm8k --compare` of the tp1/dcp1 plan
    against the same plan with engine vllm, 20 questions (synthetic, GSM8K's format: CI has no GSM8K). vLLM runs
    eagerly (`model.enforce_eager=true`, for both plans; dcpctl's CPU engine has no graphs to skip): it is healthy in
    ~30 s against ~96 s compiling its graph on a 2-core Zen 4, and the comparison is the subject, not vLLM's speed."""
    installed_vllm()
    pull_model("smollm2-135m-instruct")
    data, out = write_synthetic_gsm8k(tmp_path / "data", n_test=20, n_train=2), tmp_path / "out"
    base = str(ROOT / "plans/cpu/smollm2_tp1_dcp1.yaml")
    code, text = invoke(
        "gsm8k", "--compare", base, VLLM_PLAN, "--data-dir", str(data), "--limit", "20", "--num-fewshot", "2",
        "--output", str(out), "model.enforce_eager=true",
    )  # fmt: skip
    assert code == 0, text
    dcpctl, vllm = json.loads((out / "comparison.json").read_text())["columns"]
    assert not dcpctl["failed"] and not vllm["failed"], vllm["error"]
    assert vllm["text_agreement"]["total"] == 20
    assert vllm["unexplained_divergences"] == 0, vllm["disagreements"]
    assert vllm["text_agreement"]["total"] - vllm["text_agreement"]["same"] == vllm["tie_flips"]
    assert "vllm" in (out / "smollm2_tp1_dcp1_vllm" / "server.log").read_text().lower()
    assert shim_processes() == []

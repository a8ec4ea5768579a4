"""Checking an export against the installed SGLang (its parser and server-argument checks, no server): how the
SGLang (and vLLM) python is found and what an export says without one (fast), and where SGLang is found
($DCPCTL_SGLANG_PYTHON or `sglang` on PATH; slow) its verdicts in its own words."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dcpctl.cli import app
from engine.peers.export import plan_facts
from engine.peers.exporters import export_plan
from engine.peers.sglang_check import check_launch_args, find_sglang_python
from engine.peers.vllm_check import find_vllm_python

ROOT = Path(__file__).resolve().parents[1]
RUNNER = CliRunner()


def export_json(*args: str) -> dict:
    result = RUNNER.invoke(app, ["plan", "export", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


@pytest.mark.parametrize(
    ("find", "script_name", "env_var"),
    [(find_vllm_python, "vllm", "DCPCTL_VLLM_PYTHON"), (find_sglang_python, "sglang", "DCPCTL_SGLANG_PYTHON")],
)
def test_an_engines_python_comes_from_the_option_then_the_environment_then_path(
    tmp_path, monkeypatch, find, script_name, env_var
):
    script = tmp_path / "bin" / script_name
    script.parent.mkdir()
    script.write_text("#!/opt/venv/bin/python3\nimport sys\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", str(script.parent))
    monkeypatch.delenv(env_var, raising=False)
    assert find() == "/opt/venv/bin/python3"
    monkeypatch.setenv(env_var, "/env/python")
    assert find() == "/env/python"
    assert find("/given/python") == "/given/python"  # engine.python, --vllm-python, --sglang-python
    monkeypatch.delenv(env_var)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find() is None


def test_an_export_says_what_it_was_checked_against_without_an_installed_engine(tmp_path, monkeypatch):
    monkeypatch.delenv("DCPCTL_SGLANG_PYTHON", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    data = export_json(str(ROOT / "plans/tp2_dcp2_i1.yaml"), "--to", "sglang")
    assert data["checked"] == "nothing: no SGLang found (set $DCPCTL_SGLANG_PYTHON or put `sglang` on PATH)"
    data = export_json(str(ROOT / "plans/tp2_dcp2_i64.yaml"), "--to", "trtllm")
    assert data["checked"] == "nothing: dcpctl checks exports against an installed vLLM or SGLang only"


def installed_sglang() -> str:
    """The python of the installed SGLang, or skip the test saying how to give one."""
    python = find_sglang_python()
    if python is None:
        pytest.skip("no SGLang: set $DCPCTL_SGLANG_PYTHON to the python of a venv with sglang (pip install sglang)")
    return python


@pytest.mark.slow
def test_the_installed_sglang_accepts_the_exports_and_rejects_in_its_own_words():
    python = installed_sglang()
    for plan in ("plans/tp2_dcp2_i1.yaml", "plans/cpu/smollm2_tp1_dcp1.yaml", "plans/cpu/smollm2_pd_dcp2_i1.yaml"):
        export = export_plan("sglang", plan_facts(ROOT / plan, ["parallel.dcp=1"] if "_pd_" in plan else []))
        for instance in export.instances:  # P/D: the prefill and the decode instance
            verdict = check_launch_args(python, instance.argv, instance.env)
            assert verdict.ok, (plan, instance.role, verdict.error)
    (instance,) = export_plan("sglang", plan_facts(ROOT / "plans/tp2_dcp2_i1.yaml")).instances
    verdict = check_launch_args(python, [*instance.argv, "--dcp-comm-backend", "bogus"], instance.env)
    assert (verdict.ok, verdict.stage) == (False, "parser")
    assert verdict.error.startswith("argument --dcp-comm-backend: invalid choice: 'bogus' (choose from 'ag_rs'")
    verdict = check_launch_args(python, [*instance.argv, "--no-such-flag"], instance.env)
    assert verdict.error == "unrecognized arguments: --no-such-flag"
    data = export_json(str(ROOT / "plans/tp2_dcp2_i1.yaml"), "--to", "sglang", "--sglang-python", python)
    assert data["checked"].startswith(f"SGLang {verdict.version} ({python}): accepted by its argument parser")

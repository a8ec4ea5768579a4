"""`dcpctl demo`: finds the repo's CPU plans from anywhere, picks its data honestly, and runs end to end."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from dcpctl import demo_cmd
from engine.plan.checks import validate_plan_file
from evals.tasks import gsm8k_task

REPO = Path(__file__).resolve().parent.parent


def test_demo_plans_found_from_any_cwd_and_valid(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plans = demo_cmd.demo_plans()
    assert [Path(p).stem for p in plans] == list(demo_cmd.DEMO_PLANS)
    assert all(Path(p).parent == REPO / "plans" / "cpu" for p in plans)
    reports = [validate_plan_file(p) for p in plans]
    assert all(r.valid for r in reports), [str(e) for r in reports for e in r.problems.errors]
    resolved = [r.resolved for r in reports]
    assert [(r.world_size, r.plan.parallel.dcp, r.plan.parallel.interleave) for r in resolved] == [
        (1, 1, 1),
        (2, 2, 1),
        (2, 2, 16),
        (2, 2, 64),
    ]
    assert resolved[-1].plan.parallel.interleave == resolved[-1].plan.cache.block_size  # block-level interleave


def test_offline_without_data_uses_labelled_synthetic_sample(tmp_path, monkeypatch):
    monkeypatch.delenv("DCPCTL_GSM8K_DIR", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    console = Console(record=True, width=200)
    data = demo_cmd.choose_data_dir(None, tmp_path, n_test=7, console=console)
    assert data == tmp_path / demo_cmd.SYNTHETIC_DIR
    said = console.export_text()
    assert "SYNTHETIC" in said and "NOT GSM8K" in said
    assert len((data / "test.jsonl").read_text().splitlines()) >= 7
    spec = gsm8k_task(data, tmp_path / "work")
    assert spec.synthetic and "SYNTHETIC" in spec.display_name and "not GSM8K" in spec.display_name


def test_data_dir_option_and_env_win_over_synthetic(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("DCPCTL_GSM8K_DIR", str(tmp_path / "env"))
    console = Console(record=True)
    assert demo_cmd.choose_data_dir(tmp_path / "opt", tmp_path, 5, console) == tmp_path / "opt"
    assert demo_cmd.choose_data_dir(None, tmp_path, 5, console) == tmp_path / "env"
    assert not (tmp_path / demo_cmd.SYNTHETIC_DIR).exists()


@pytest.mark.slow
@pytest.mark.multiproc
def test_demo_end_to_end_on_smollm2_offline(tmp_path, monkeypatch):
    """The whole demo at --limit 1: pull (idempotent), 4 plans launched and evaluated, labelled synthetic."""
    monkeypatch.delenv("DCPCTL_GSM8K_DIR", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    app = __import__("typer").Typer()
    app.command()(demo_cmd.demo)
    out = tmp_path / "demo"
    result = CliRunner().invoke(app, ["--limit", "1", "--num-fewshot", "1", "--output", str(out)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    data = json.loads((out / "comparison.json").read_text())
    assert [c["label"] for c in data["columns"]] == list(demo_cmd.DEMO_PLANS)
    assert not any(c["failed"] for c in data["columns"])
    assert "SYNTHETIC" in data["dataset"] and "SYNTHETIC" in (out / "comparison.md").read_text()
    assert "SYNTHETIC" in result.output
    for col in data["columns"][1:]:
        assert col["text_agreement"]["total"] == 1
    assert os.path.getsize(out / "accuracy.png") > 1000

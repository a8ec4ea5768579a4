"""`dcpctl plan export`: every shipped plan to vLLM, SGLang and TensorRT-LLM against reviewed golden files, and the
rejection reasons of each engine's rules.

Regenerate the golden files after a deliberate change with `DCPCTL_UPDATE_GOLDEN=1 pytest tests/test_peer_export.py`
and review the diff. The model cache is pinned to /models so that the SmolLM2 plans' folder is the same everywhere
(the exports then read dcpctl's shipped config.json facts of the models).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dcpctl.cli import app
from dcpctl.export_cmd import render_export
from engine.peers.export import ENGINES, plan_facts
from engine.peers.exporters import export_plan

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).with_name("golden") / "export"
SHIPPED_PLANS = sorted(p.relative_to(ROOT) for p in (ROOT / "plans").rglob("*.yaml"))
RUNNER = CliRunner()


@pytest.fixture(autouse=True)
def pinned_cache(monkeypatch):
    monkeypatch.setenv("DCPCTL_CACHE", "/models")
    monkeypatch.delenv("DCPCTL_VLLM_PYTHON", raising=False)
    monkeypatch.delenv("DCPCTL_SGLANG_PYTHON", raising=False)
    monkeypatch.chdir(ROOT)


def golden_name(plan: Path, engine: str) -> str:
    return "__".join(plan.with_suffix("").parts[1:]) + f".{engine}.txt"


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("plan", SHIPPED_PLANS, ids=str)
def test_export_matches_golden(plan, engine):
    text = render_export(export_plan(engine, plan_facts(plan))) + "\n"
    golden = GOLDEN / golden_name(plan, engine)
    if os.environ.get("DCPCTL_UPDATE_GOLDEN"):
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(text)
    assert text == golden.read_text()


def test_every_golden_file_belongs_to_a_shipped_plan():
    expected = {golden_name(p, e) for p in SHIPPED_PLANS for e in ENGINES}
    assert {p.name for p in GOLDEN.iterdir()} == expected


def blocking(engine: str, plan: str | Path, overrides: list[str] | None = None) -> list[str]:
    return [g.message for g in export_plan(engine, plan_facts(plan, overrides)).gaps if g.blocking]


def test_vllm_rejects_replica_ranks_and_dcp_on_its_cpu_build():
    assert blocking("vllm", "plans/cpu/smollm2_tp1_dcp2_i16.yaml") == [
        "vLLM runs DCP inside the TP group: tensor_parallel_size must be divisible by decode_context_parallel_size "
        "(tp=1, dcp=2); dcpctl's replica ranks (world size 2) have no vLLM equivalent"
    ]
    assert blocking("vllm", "plans/tp2_dcp2_i64.yaml", ["launch.device=cpu"]) == [
        "vLLM-CPU cannot run decode context parallel (dcp=2 on launch.device=cpu)"
    ]
    assert blocking("vllm", "plans/tp2_dcp2_i64.yaml") == []


def test_vllm_pd_rules(make_plan, tmp_path):
    """P/D with dcp > 1: MLA only on the decode side, and each side's dcp 1 or = tp (vLLM PR #50611)."""
    from tests.conftest import mla_fields, write_config

    gqa = write_config(tmp_path / "gqa", num_attention_heads=8, num_key_value_heads=1)
    mla = write_config(tmp_path / "mla", **mla_fields(num_attention_heads=8))
    for name, folder in (("gqa", gqa), ("mla", mla)):
        make_plan(f"model: {{path: {folder}}}\nparallel: {{tp: 4}}\ncache: {{block_size: 16}}\n", f"p_{name}.yaml")
        make_plan(
            f"base: p_{name}.yaml\nparallel: {{tp: 4, dcp: 2, interleave: 16}}\ndisagg: {{prefill: p_{name}.yaml}}\n",
            f"d_{name}.yaml",
        )
    assert blocking("vllm", tmp_path / "d_gqa.yaml") == [
        "decode: vLLM's P/D hand-off with decode_context_parallel_size > 1 is for MLA models only (dcp=2, a GQA model)"
    ]
    assert blocking("vllm", tmp_path / "d_mla.yaml") == [
        "decode: vLLM's P/D hand-off takes decode_context_parallel_size 1 or = tensor_parallel_size on each side "
        "(tp=4, dcp=2)"
    ]
    assert blocking("vllm", tmp_path / "d_mla.yaml", ["parallel.dcp=4", "parallel.interleave=16"]) == []


def test_sglang_takes_token_interleave_only():
    assert blocking("sglang", "plans/tp2_dcp2_i1.yaml") == []
    assert blocking("sglang", "plans/tp2_dcp2_i16.yaml") == [
        "SGLang's DCP interleaves single tokens only (parallel.interleave=16; it has no interleave setting): a P/D "
        "hand-off then moves one run per token instead of whole blocks"
    ]


def test_trtllm_helix_rules():
    assert blocking("trtllm", "plans/tp2_dcp2_i64.yaml") == []
    assert blocking("trtllm", "plans/tp2_dcp2_i16.yaml") == [
        "Helix shards whole KV blocks: interleave must equal cp_config.tokens_per_block = "
        "kv_cache_config.tokens_per_block (interleave=16, block_size=64)"
    ]
    assert blocking("trtllm", "plans/cpu/smollm2_tp1_dcp2_i64.yaml") == [
        "TensorRT-LLM runs on NVIDIA GPUs only (launch.device=cpu)",
        "Helix (context_parallel_size > 1) is for MLA models; this model is GQA",
    ]


def test_every_set_field_is_reported_or_carried():
    """A field the engine has no equivalent for is listed, never dropped."""
    gaps = export_plan("vllm", plan_facts("plans/tp1_dcp1.yaml", ["launch.threads_per_rank=3"])).gaps
    assert [g.message for g in gaps if g.field == "launch.threads_per_rank"] == [
        "launch.threads_per_rank=3 has no vLLM equivalent: not carried over"
    ]


def test_cli_exits_1_with_the_rule_and_prints_the_closest_with_allow_partial():
    result = RUNNER.invoke(app, ["plan", "export", "plans/cpu/smollm2_tp1_dcp2_i16.yaml", "--to", "sglang"])
    assert result.exit_code == 1
    assert "SGLang cannot run plan smollm2_tp1_dcp2_i16: SGLang runs DCP inside the TP group" in result.output
    result = RUNNER.invoke(
        app, ["plan", "export", "plans/cpu/smollm2_tp1_dcp2_i16.yaml", "--to", "vllm", "--allow-partial", "--json"]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["runnable"] is False
    assert "--decode-context-parallel-size" not in data["instances"][0]["argv"]
    assert [g["closest"] for g in data["gaps"] if g["blocking"]] == ["parallel.dcp 2 -> 1"]
    assert data["checked"].startswith("nothing: no vLLM found")


def test_cli_rejects_an_unknown_engine_and_an_invalid_plan(make_plan):
    result = RUNNER.invoke(app, ["plan", "export", "plans/tp1_dcp1.yaml", "--to", "tgi"])
    assert result.exit_code == 1
    assert str(result.exception) == "--to 'tgi' is not an engine dcpctl exports to: choose one of vllm, sglang, trtllm"
    bad = make_plan("model: {path: deepseek-v2-lite}\nparallel: {tp: 3}\n")
    result = RUNNER.invoke(app, ["plan", "export", str(bad), "--to", "vllm"])
    assert "is not valid" in str(result.exception) and "parallel.tp=3" in str(result.exception)

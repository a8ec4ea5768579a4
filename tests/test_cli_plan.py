"""`dcpctl plan validate` / `plan show` through Typer's CliRunner: exit codes, JSON, pictures."""

import json
from pathlib import Path

from typer.testing import CliRunner

from dcpctl.cli import app
from tests.conftest import mla_fields, write_config

runner = CliRunner()
REPO = Path(__file__).resolve().parents[1]


def test_shipped_plans_validate():
    plans = sorted(str(p) for p in (REPO / "plans").rglob("*.yaml"))
    result = runner.invoke(app, ["plan", "validate", *plans])
    assert result.exit_code == 0, result.output
    assert "tp2_dcp2_i64" in result.output


def test_exit_codes_valid_invalid_usage(make_plan, llama_folder):
    good = make_plan(f"model: {{path: {llama_folder}}}\n", "good.yaml")
    bad = make_plan(f"model: {{path: {llama_folder}}}\nparallel: {{interleave: 3}}\n", "bad.yaml")
    assert runner.invoke(app, ["plan", "validate", str(good)]).exit_code == 0
    result = runner.invoke(app, ["plan", "validate", str(good), str(bad)])
    assert result.exit_code == 1
    assert "parallel.interleave=3 does not divide cache.block_size=16" in " ".join(result.output.split())
    assert runner.invoke(app, ["plan", "validate"]).exit_code == 2
    assert runner.invoke(app, ["plan", "validate", "--nope", str(good)]).exit_code == 2


def test_show_positions_are_bounded(make_plan, llama_folder):
    plan = str(make_plan(f"model: {{path: {llama_folder}}}\n"))
    for positions in ("0", "-5", "100000000"):
        result = runner.invoke(app, ["plan", "show", plan, "--positions", positions])
        assert result.exit_code == 2 and "--positions must be 1..65536" in result.output, positions


def test_overrides_apply_to_every_plan(make_plan, llama_folder):
    good = make_plan(f"model: {{path: {llama_folder}}}\ncache: {{block_size: 64}}\n")
    result = runner.invoke(app, ["plan", "validate", str(good), "parallel.interleave=48", "--json"])
    assert result.exit_code == 1
    (report,) = json.loads(result.output)
    assert report["errors"][0]["field"] == "parallel.interleave"
    assert report["errors"][0]["file"] == "command line"


def test_json_report(make_plan, tmp_path):
    folder = write_config(tmp_path / "mla", **mla_fields())
    path = make_plan(
        f"model: {{path: {folder}}}\nparallel: {{tp: 2, dcp: 2, interleave: 4}}\n"
        "launch: {device: cpu}\ncache: {memory: 1MiB}\n"
    )
    result = runner.invoke(app, ["plan", "validate", "--json", str(path)])
    assert result.exit_code == 0, result.output
    (report,) = json.loads(result.output)
    assert report["valid"] and report["resolved"]["world_size"] == 2
    assert report["layout"] == {"kind": "tp", "kv_replication": 2, "replicas": 1}
    assert report["kv_cache"]["token_capacity"] == report["kv_cache"]["tokens_per_rank"] * 2
    assert report["config"]["parallel"]["interleave"] == 4
    assert report["resolved"]["cpu_comm"] == "shm"
    result = runner.invoke(app, ["plan", "validate", str(path), "launch.cpu_comm=gloo"])
    assert "collectives plan: gloo (launch.cpu_comm=gloo)" in " ".join(result.output.split())


def test_validate_shows_the_bf16_gemm_switch_and_names_a_bad_value(make_plan, tmp_path, monkeypatch):
    folder = write_config(tmp_path / "mla", **mla_fields())
    path = make_plan(f"model: {{path: {folder}, dtype: bfloat16}}\nlaunch: {{device: cpu}}\ncache: {{memory: 1MiB}}\n")
    monkeypatch.setenv("DCPCTL_BF16_GEMM", "panels")
    result = runner.invoke(app, ["plan", "validate", str(path)])
    assert result.exit_code == 0, result.output
    assert "bfloat16 linear layers: GEMV for 1-2 rows, engine panel GEMM" in " ".join(result.output.split())
    monkeypatch.setenv("DCPCTL_BF16_GEMM", "mkl")
    result = runner.invoke(app, ["plan", "validate", str(path)])
    assert result.exit_code == 1
    assert "DCPCTL_BF16_GEMM='mkl' is not one of auto, onednn, panels" in " ".join(result.output.split())


def test_show_draws_ranks_and_ownership(make_plan, tmp_path):
    folder = write_config(tmp_path / "mla", **mla_fields())
    path = make_plan(
        f"model: {{path: {folder}}}\nparallel: {{tp: 2, dcp: 2, interleave: 2}}\n"
        "cache: {block_size: 4, memory: 1MiB}\nlaunch: {device: cpu}\n"
    )
    result = runner.invoke(app, ["plan", "show", str(path), "--positions", "16"])
    assert result.exit_code == 0, result.output
    assert "DCP groups: [[0, 1]]" in result.output
    assert "virtual block = 8 tokens" in " ".join(result.output.split())
    # interleave 2 over dcp 2: 0011 repeating; '|' after each 8-token virtual block
    assert "00110011|00110011" in result.output.replace(" ", "")
    shown = " ".join(result.output.split())
    assert "collectives: shared memory, every rank on this node (launch.cpu_comm=auto); gloo for step plans" in shown
    result = runner.invoke(app, ["plan", "show", str(path), "launch.cpu_comm=gloo"])
    assert "collectives: gloo (launch.cpu_comm=gloo)" in result.output


def test_show_block_interleave(make_plan, tmp_path):
    folder = write_config(tmp_path / "kv1", num_key_value_heads=1)
    path = make_plan(
        f"model: {{path: {folder}}}\nparallel: {{tp: 2, dcp: 2, interleave: 4}}\n"
        "cache: {block_size: 4, memory: 1MiB}\nlaunch: {device: cpu}\n"
    )
    result = runner.invoke(app, ["plan", "show", str(path), "--positions", "16"])
    assert "00001111|00001111" in result.output.replace(" ", "")


def test_show_invalid_plan_exits_1(make_plan, llama_folder):
    path = make_plan(f"model: {{path: {llama_folder}}}\nparallel: {{interleave: 5}}\n")
    result = runner.invoke(app, ["plan", "show", str(path)])
    assert result.exit_code == 1
    assert "does not divide cache.block_size" in " ".join(result.output.split())


def test_show_and_validate_report_the_sharded_placement(make_plan, tmp_path):
    folder = write_config(tmp_path / "kv2", num_key_value_heads=2)
    path = make_plan(
        f"model: {{path: {folder}}}\nparallel: {{dcp: 2, dense: sharded, dcp_comm_backend: a2a}}\n"
        "cache: {block_size: 4, memory: 1MiB}\nlaunch: {device: cpu}\n"
    )
    result = runner.invoke(app, ["plan", "show", str(path), "--positions", "8"], terminal_width=200)
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())
    assert "dense placement: sharded over the world (2 ranks): o_proj, mlp, embedding and LM head split 2 ways" in out
    assert "TensorRT-LLM cp_config.cp_type: HELIX). DCP combine: a2a." in out
    assert "Collectives per decode step: 8" in out  # 2 layers x (a2a + o_proj + mlp) + embedding + lm head gather
    assert "memory per rank: weights" in out
    assert "dense groups: o_proj over world [0, 1]; mlp over world [0, 1]; embedding/LM head over world [0, 1]" in out
    result = runner.invoke(app, ["plan", "validate", "--json", str(path)])
    (report,) = json.loads(result.output)
    placement = report["placement"]
    assert placement["sharded"] and placement["dcp_comm_backend"] == "a2a"
    assert [c["op"] for c in placement["collectives"]] == [
        "all_to_all",
        "all_reduce",
        "all_reduce",
        "all_reduce",
        "gather",
    ]
    replicated = runner.invoke(app, ["plan", "validate", "--json", str(path), "parallel.dense=replicated"])
    (base,) = json.loads(replicated.output)
    assert max(placement["weight_bytes_per_rank"]) < max(base["placement"]["weight_bytes_per_rank"])

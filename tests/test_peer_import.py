"""`dcpctl plan import`: vLLM / SGLang command lines and TensorRT-LLM YAML back to plans. Export then import gives
back an equivalent plan, for every shipped plan and for generated ones: the imported plan exports to the very same
command (or YAML), and a layout the engine runs comes back with the same layout fields."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from dcpctl.cli import app
from engine.errors import UserError
from engine.parallel_layout import divisors
from engine.peers.export import ENGINES, Instance, plan_facts
from engine.peers.exporters import export_plan
from engine.peers.imports import import_words

ROOT = Path(__file__).resolve().parents[1]
SHIPPED_PLANS = sorted(p.relative_to(ROOT) for p in (ROOT / "plans").rglob("*.yaml"))
RUNNER = CliRunner()
# a P/D instance's wiring: the dcpctl plan of one instance has no such flags (disagg.prefill pairs two plans)
PD_FLAGS = (
    "--kv-transfer-config",
    "--disaggregation-mode",
    "--disaggregation-transfer-backend",
    "--disaggregation-bootstrap-port",
    "--extra_llm_api_options",  # its file name says the role; the YAML itself is compared
)


@pytest.fixture(autouse=True)
def pinned_cache(monkeypatch):
    monkeypatch.setenv("DCPCTL_CACHE", "/models")
    monkeypatch.chdir(ROOT)


def standalone(instance: Instance) -> tuple[list[str], dict, dict | None]:
    """An instance's argv, env and config without its P/D wiring."""
    argv, i = [], 0
    while i < len(instance.argv):
        if instance.argv[i] in PD_FLAGS:
            i += 2
            continue
        argv.append(instance.argv[i])
        i += 1
    env = {k: v for k, v in instance.env.items() if k != "VLLM_NIXL_SIDE_CHANNEL_PORT"}
    config = (
        None
        if instance.config is None
        else {k: v for k, v in instance.config.items() if k != "cache_transceiver_config"}
    )
    return argv, env, config


def round_trip(engine: str, instance: Instance, name: str, folder: Path) -> Instance:
    """Import the instance's command (and YAML) into a plan file, export that plan again."""
    trtllm = None
    if instance.config is not None:
        trtllm = folder / instance.config_file
        trtllm.write_text(yaml.safe_dump(instance.config, sort_keys=False))
    imported = import_words(shlex.split(instance.command), str(trtllm) if trtllm else None)
    assert imported.not_understood == []
    plan = folder / f"{name}.imported.yaml"
    plan.write_text(yaml.safe_dump(imported.plan_data(name), sort_keys=False))
    (again,) = export_plan(engine, plan_facts(plan)).instances
    return again


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("plan", SHIPPED_PLANS, ids=str)
def test_every_shipped_plan_survives_export_then_import(plan, engine, tmp_path):
    facts = plan_facts(plan)
    sides = {"serve": facts} if facts.prefill is None else {"prefill": facts.prefill, "decode": facts}
    for instance in export_plan(engine, facts).instances:
        again = round_trip(engine, instance, sides[instance.role].plan.name, tmp_path)
        assert standalone(again) == standalone(instance)


LAYOUT_FIELDS = (
    "parallel.tp",
    "parallel.dcp",
    "cache.block_size",
    "model.max_model_len",
    "scheduler.max_num_seqs",
    "scheduler.max_num_batched_tokens",
    "scheduler.chunked_prefill",
    "cache.prefix_caching",
    "model.dtype",
)


def field_of(plan, key: str):
    section, name = key.split(".")
    return getattr(getattr(plan, section), name)


@st.composite
def generated_plans(draw):
    """A valid DeepSeek-V2-Lite (MLA, 16 heads) GPU plan: DCP inside the TP group."""
    tp = draw(st.sampled_from([1, 2, 4, 8, 16]))
    dcp = draw(st.sampled_from(divisors(tp)))
    block = draw(st.sampled_from([16, 32, 64]))
    return {
        "model": {
            "path": "deepseek-v2-lite",
            "dtype": draw(st.sampled_from(["auto", "bfloat16", "float16"])),
            # at most what the smallest cache.memory below holds, and the default 1 GiB an imported plan gets where
            # the engine sizes its pool by a fraction only (SGLang, TensorRT-LLM): every generated plan is valid
            "max_model_len": draw(st.sampled_from([2048, 4096, 8192])),
        },
        "parallel": {"tp": tp, "dcp": dcp, "interleave": draw(st.sampled_from(divisors(block)))},
        "cache": {
            "block_size": block,
            "memory": draw(st.sampled_from(["8GiB", "0.9", "640MiB"])),
            "prefix_caching": draw(st.booleans()),
        },
        "scheduler": {
            "max_num_seqs": draw(st.integers(1, 512)),
            "max_num_batched_tokens": draw(st.integers(64, 16384)),
            "chunked_prefill": True,
        },
        "serve": {"port": draw(st.integers(1024, 65535))},
    }


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=generated_plans(), engine=st.sampled_from(ENGINES))
def test_generated_plans_survive_export_then_import(data, engine, tmp_path):
    plan = tmp_path / "gen.yaml"
    plan.write_text(yaml.safe_dump({"name": "gen", **data}))
    facts = plan_facts(plan)
    exported = export_plan(engine, facts)
    (instance,) = exported.instances
    again = round_trip(engine, instance, "gen", tmp_path)
    assert standalone(again) == standalone(instance)
    if exported.runnable:
        back = plan_facts(tmp_path / "gen.imported.yaml").plan
        keys = [k for k in LAYOUT_FIELDS if not (engine == "trtllm" and k == "parallel.tp")]
        assert {k: field_of(back, k) for k in keys} == {k: field_of(facts.plan, k) for k in keys}
        if facts.plan.parallel.dcp > 1:
            assert back.parallel.interleave == facts.plan.parallel.interleave


def test_flags_not_understood_are_listed_and_the_plan_is_written_whole(tmp_path):
    out = tmp_path / "imported.yaml"
    words = [
        "vllm",
        "serve",
        "deepseek-ai/DeepSeek-V2-Lite",
        "-tp",
        "4",
        "-dcp",
        "2",
        "--dcp-kv-cache-interleave-size",
        "8",
        "--block_size=16",
        "--enforce-eager",
        "--seed",
        "3",
        "--speculative-config",
        '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_minimum": 1}',
    ]
    result = RUNNER.invoke(app, ["plan", "import", "--output", str(out), "--", *words])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert [ln for ln in lines if ln.startswith("not understood")] == [
        "not understood (left out of the plan): --seed 3",
        "not understood (left out of the plan): --speculative-config key prompt_lookup_minimum=1",
    ]
    plan = yaml.safe_load(out.read_text())
    assert plan == {
        "name": "imported",
        "description": "imported from vLLM",
        "model": {"path": "deepseek-v2-lite", "enforce_eager": True},
        "parallel": {"tp": 4, "dcp": 2, "interleave": 8},
        "cache": {"block_size": 16},
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 2},
    }
    assert out.read_text().startswith(
        "# imported by `dcpctl plan import` from: vllm serve deepseek-ai/DeepSeek-V2-Lite"
    )


def test_sglang_line_and_bad_input(tmp_path):
    imported = import_words(
        shlex.split(
            "python3 -m sglang.launch_server --model-path deepseek-ai/DeepSeek-V2-Lite --tp 8 --dcp-size 4 "
            "--page-size 32 --disable-radix-cache --chunked-prefill-size -1 --mem-fraction-static 0.85 "
            "--enable-dp-attention"
        )
    )
    assert imported.settings == {
        "model.path": "deepseek-v2-lite",
        "parallel.tp": 8,
        "parallel.dcp": 4,
        "cache.block_size": 32,
        "cache.prefix_caching": False,
        "scheduler.chunked_prefill": False,
        "cache.memory": "0.85",
        "parallel.interleave": 1,
    }
    assert imported.not_understood == ["--enable-dp-attention"]
    with pytest.raises(UserError, match=r"^cannot tell the engine from 'tgi serve x'"):
        import_words(["tgi", "serve", "x"])
    with pytest.raises(UserError, match=r"^parallel.tp takes a whole number, not 'two'$"):
        import_words(["vllm", "serve", "m", "-tp", "two"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("[1, 2")
    with pytest.raises(UserError, match=r"is not YAML"):
        import_words(["trtllm-serve", "m"], str(bad))
    out = tmp_path / "x.yaml"
    result = RUNNER.invoke(app, ["plan", "import", "--output", str(out), "--", "vllm", "serve", "-tp", "2"])
    assert str(result.exception).startswith("the command names no model")
    assert not out.exists()

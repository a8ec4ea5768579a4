"""`dcpctl model random`: a named model's real config with random weights, streamed to sharded safetensors."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from engine.checkpoints.random_model import (
    checkpoint_shapes,
    make_random_checkpoint,
    parse_overrides,
    random_model_config,
)
from engine.errors import UserError
from tests.oracle import hf_greedy, prompt_ids, write_plan

# DeepSeek-V2-Lite's architecture (MLA, yarn rope, shared + routed experts, a first dense layer) at test size
TINY_DEEPSEEK = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 1024,
}


def _params(name: str) -> int:
    from transformers import AutoConfig

    fields = random_model_config(name)
    return sum(_numel(shape) for _, shape in checkpoint_shapes(AutoConfig.for_model(**fields)))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def test_real_shapes_have_the_published_parameter_counts():
    """Meta-device shapes only: the configs are the real ones (Llama-3.1-8B: 8.03B; DeepSeek-V2-Lite: 15.7B)."""
    assert _params("llama-3.1-8b-instruct") == 8_030_261_248
    assert round(_params("deepseek-v2-lite") / 1e9, 1) == 15.7


def test_deepseek_folder_is_sharded_and_engine_matches_hf(tmp_path):
    """Several shards with an index naming every tensor once; the engine's greedy tokens equal HF's on it."""
    from engine import LLM, SamplingParams

    folder = make_random_checkpoint(
        "deepseek-v2-lite", tmp_path / "ds", overrides=TINY_DEEPSEEK, dtype="float32", max_shard_bytes=64 << 10
    )
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    stored, total = {}, 0
    for file in files:
        with safe_open(str(folder / file), "pt") as f:
            sizes = [_numel(tuple(f.get_slice(key).get_shape())) * 4 for key in f.keys()]  # noqa: SIM118
            stored.update(dict.fromkeys(f.keys(), file))
        assert len(sizes) == 1 or sum(sizes) <= 64 << 10  # the cap; a bigger tensor gets a shard of its own
        total += sum(sizes)
    assert stored == index["weight_map"] and total == index["metadata"]["total_size"]
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in stored  # per-expert names, as the hub's files

    config = json.loads((folder / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "yarn" and config["rope_parameters"]["factor"] == 40.0
    assert config["n_shared_experts"] == 2 and config["max_position_embeddings"] == 163840  # not overridden

    prompts = prompt_ids(2, [5, 23], vocab=300, seed=4)
    plan = write_plan(tmp_path, folder, {"model.dtype": "float32"})
    with LLM(plan) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(folder, p, 6)[0] for p in prompts]


def test_cli_writes_bf16_llama_and_refuses_bad_input(tmp_path):
    from typer.testing import CliRunner

    from dcpctl.model_cmd import app

    out = tmp_path / "llama"
    sets = ["num_hidden_layers=1", "hidden_size=64", "intermediate_size=128", "num_attention_heads=4"]
    sets += ["num_key_value_heads=2", "head_dim=16", "vocab_size=512"]
    args = ["random", "llama-3.1-8b-instruct", "--output", str(out), "--seed", "3"]
    result = CliRunner().invoke(app, [*args, *[a for s in sets for a in ("--set", s)]])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == str(out)
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["rope_parameters"]["rope_type"] == "llama3"
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)  # the byte-level tokenizer's ids
    with safe_open(str(out / "model-00001-of-00001.safetensors"), "pt") as f:
        assert str(f.get_tensor("lm_head.weight").dtype) == "torch.bfloat16"
    provenance = json.loads((out / "dcpctl-random.json").read_text())
    assert provenance["model"] == "llama-3.1-8b-instruct" and provenance["overrides"]["vocab_size"] == 512

    again = CliRunner().invoke(app, args)  # the folder exists now
    assert isinstance(again.exception, UserError) and "already exists" in str(again.exception)


@pytest.mark.parametrize(
    ("name", "overrides", "message"),
    [
        ("deepseek-v3", {}, "shipped for planning only"),
        ("gpt-5", {}, "use one of deepseek-v2-lite, llama-3.1-70b-instruct"),
        ("llama-3.1-8b-instruct", {"n_routed_experts": 4}, "has no field 'n_routed_experts'"),
        ("llama-3.1-8b-instruct", {"vocab_size": 100}, "vocab_size must be >= 320"),
    ],
)
def test_bad_names_and_fields_are_user_errors(name, overrides, message, tmp_path):
    with pytest.raises(UserError, match=message):
        make_random_checkpoint(name, tmp_path / "x", overrides=overrides)
    assert not (tmp_path / "x").exists()


def test_overrides_parse_json_values_and_refuse_bare_keys():
    assert parse_overrides(["a=2", "b=true", "c=null", "d=yarn", "e=[1, 2]"]) == {
        "a": 2, "b": True, "c": None, "d": "yarn", "e": [1, 2],
    }  # fmt: skip
    with pytest.raises(UserError, match="write KEY=VALUE"):
        parse_overrides(["num_hidden_layers"])

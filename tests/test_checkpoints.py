"""Checkpoints: aliases and cache, tiny random models (HF loads and generates them), pulling SmolLM2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from engine.checkpoints import aliases
from engine.checkpoints.aliases import (
    COMPLETE_MARKER,
    KNOWN_ALIASES,
    cache_dir,
    is_alias,
    is_complete,
    resolve_model_path,
)
from engine.errors import UserError

REPO = Path(__file__).resolve().parents[1]
SMOLLM2 = "smollm2-135m-instruct"
FILES = ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


# ---- aliases and cache (no torch) ----


def test_cache_dir_default_and_env(monkeypatch, tmp_path):
    monkeypatch.delenv("DCPCTL_CACHE", raising=False)
    assert cache_dir() == Path.home() / ".cache" / "dcpctl" / "models"
    monkeypatch.setenv("DCPCTL_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    assert resolve_model_path(SMOLLM2) == tmp_path / "c" / SMOLLM2


def test_resolve_model_path(monkeypatch, tmp_path):
    monkeypatch.setenv("DCPCTL_CACHE", str(tmp_path))
    assert is_alias(SMOLLM2) and SMOLLM2 in KNOWN_ALIASES
    assert not is_alias("models/tiny") and not is_alias("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert resolve_model_path("models/tiny") == Path("models/tiny")
    assert not resolve_model_path("models/tiny").is_absolute()
    assert resolve_model_path("~/m") == Path.home() / "m"
    assert resolve_model_path(f"./{SMOLLM2}") == Path(SMOLLM2)


def test_hub_ids_and_hub_aliases_resolve_to_their_pulled_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("DCPCTL_CACHE", str(tmp_path))
    assert is_alias("deepseek-v2-lite")
    assert resolve_model_path("deepseek-v2-lite") == tmp_path / "deepseek-ai--DeepSeek-V2-Lite"
    assert resolve_model_path("org/name") == Path("org/name")  # not pulled: a plain relative path
    (tmp_path / "org--name").mkdir()
    assert resolve_model_path("org/name") == tmp_path / "org--name"


def test_is_complete(tmp_path):
    assert not is_complete(tmp_path / "missing")
    assert not is_complete(tmp_path)
    (tmp_path / COMPLETE_MARKER).write_text("{not json")
    assert not is_complete(tmp_path)
    (tmp_path / COMPLETE_MARKER).write_text(json.dumps({"name": "x"}))
    assert is_complete(tmp_path)
    assert aliases.read_marker(tmp_path) == {"name": "x"}


def test_aliases_and_package_do_not_import_torch():
    code = (
        "import sys, engine.checkpoints, engine.checkpoints.aliases\n"
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def test_unknown_alias_error_lists_known(tmp_path):
    from engine.checkpoints.pull import pull_model

    with pytest.raises(UserError) as err:
        pull_model("no-such-model", dest=tmp_path / "x")
    msg = str(err.value)
    assert "no-such-model" in msg and SMOLLM2 in msg and "ORG/NAME" in msg
    assert "\n" not in msg
    assert not (tmp_path / "x").exists()


def test_hub_pull_offline_is_one_line_user_error(monkeypatch, tmp_path):
    from engine.checkpoints.pull import pull_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError) as err:
        pull_model("some-org/some-model", dest=tmp_path / "m")
    assert "some-org/some-model" in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "m").exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # the partial folder is gone too


def test_pull_refuses_foreign_nonempty_dest(tmp_path):
    from engine.checkpoints.pull import pull_model

    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(UserError, match="not a complete pull"):
        pull_model(SMOLLM2, dest=tmp_path)
    assert (tmp_path / "keep.txt").read_text() == "mine"


def test_pull_returns_complete_folder_at_once(tmp_path):
    from engine.checkpoints.pull import pull_model

    (tmp_path / COMPLETE_MARKER).write_text(json.dumps({"name": SMOLLM2}))
    start = time.monotonic()
    assert pull_model(SMOLLM2, dest=tmp_path) == tmp_path
    assert time.monotonic() - start < 1.0


# ---- tiny checkpoints ----


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny")


def _make(root: Path, name: str, arch: str, seed: int = 0, **sizes) -> Path:
    from engine.checkpoints.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(root / name, arch, seed, **sizes)


def test_tiny_same_seed_is_byte_identical_and_seed_changes_weights(tiny_dir):
    a = _make(tiny_dir, "det_a", "llama", seed=3)
    b = _make(tiny_dir, "det_b", "llama", seed=3)
    c = _make(tiny_dir, "det_c", "llama", seed=4)
    for name in FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


def test_tiny_is_identical_across_processes(tiny_dir):
    """A fresh interpreter (new hash seed, fresh tokenizer training) writes the same bytes."""
    here = _make(tiny_dir, "proc_here", "deepseek_v2", seed=5, q_lora_rank=16)
    there = tiny_dir / "proc_there"
    code = textwrap.dedent(f"""
        from engine.checkpoints.tiny import make_tiny_checkpoint
        make_tiny_checkpoint({str(there)!r}, "deepseek_v2", 5, q_lora_rank=16)
    """)
    env = {**os.environ, "PYTHONHASHSEED": "random"}
    subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, check=True, capture_output=True)
    for name in FILES:
        assert (here / name).read_bytes() == (there / name).read_bytes(), name


def test_tiny_refuses_nonempty_out_unless_overwrite(tiny_dir):
    from engine.checkpoints.tiny import make_tiny_checkpoint

    out = tiny_dir / "occupied"
    out.mkdir()
    (out / "x.txt").write_text("x")
    with pytest.raises(UserError, match="not empty"):
        make_tiny_checkpoint(out, "qwen2")
    assert make_tiny_checkpoint(out, "qwen2", overwrite=True) == out
    assert not (out / "x.txt").exists() and (out / "model.safetensors").is_file()
    assert [p.name for p in tiny_dir.iterdir() if p.name.startswith(".")] == []


@pytest.mark.parametrize(
    ("sizes", "match"),
    [
        ({"kv_lora_rank": 8}, "kv_lora_rank do not apply to arch llama"),
        ({"num_heads": 4, "num_kv_heads": 3}, "multiple of num_kv_heads"),
        ({"vocab_size": 100}, "vocab_size must be >="),
        ({"head_dim": 15}, "head_dim must be even"),
        ({"head_dim": 0}, "head_dim must be >= 1"),
        ({"head_dim": -2}, "head_dim must be >= 1"),
        ({"num_kv_heads": 0}, "num_kv_heads must be >= 1"),
        ({"hidden_size": 30, "num_heads": 4}, r"hidden_size \(30\) must be a multiple of num_heads \(4\)"),
        ({"rope_theta": float("nan")}, "rope_theta must be a positive finite number"),
        ({"rope_theta": -1.0}, "rope_theta must be a positive finite number"),
        ({"arch": "deepseek_v2", "kv_lora_rank": 0}, "kv_lora_rank must be >= 1"),
        ({"arch": "deepseek_v2", "v_head_dim": 0}, "v_head_dim must be >= 1"),
        ({"arch": "deepseek_v2", "yarn_factor": 0.0}, "yarn_factor must be a positive finite number"),
        ({"seed": 10**20}, r"seed must be 0 \.\. 2\*\*63-1"),
        ({"seed": -1}, "seed must be 0"),
    ],
)
def test_tiny_bad_sizes_are_user_errors(tiny_dir, sizes, match):
    with pytest.raises(UserError, match=match):
        _make(tiny_dir, "bad", **{"arch": "llama", **sizes})
    assert not (tiny_dir / "bad").exists()


def test_tiny_refuses_an_empty_or_unwritable_out(tiny_dir):
    from engine.checkpoints.tiny import make_tiny_checkpoint

    with pytest.raises(UserError, match="the output folder is empty"):
        make_tiny_checkpoint("", "llama", overwrite=True)
    afile = tiny_dir / "afile"
    afile.write_text("x")
    with pytest.raises(UserError, match="is a file, not a folder"):
        make_tiny_checkpoint(afile / "sub", "llama")


def test_tiny_unknown_arch(tiny_dir):
    with pytest.raises(UserError, match="llama, qwen2, deepseek_v2"):
        _make(tiny_dir, "bad_arch", "mistral")


CASES = {
    "llama": ("llama", {}),
    "llama_tied": ("llama", {"tie_word_embeddings": True, "num_kv_heads": 1}),
    "qwen2": ("qwen2", {"num_heads": 6, "num_kv_heads": 3, "vocab_size": 1024}),
    "ds_yarn": ("deepseek_v2", {}),
    "ds_qlora": ("deepseek_v2", {"q_lora_rank": 16, "num_layers": 3}),
    "ds_no_yarn": ("deepseek_v2", {"yarn": False}),
    "ds_dense": ("deepseek_v2", {"n_routed_experts": 0}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tiny_loads_in_hf_and_generates(tiny_dir, case):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from engine.checkpoints.tiny import quiet_hf

    arch, sizes = CASES[case]
    path = _make(tiny_dir, f"gen_{case}", arch, seed=0, **sizes)
    cfg = AutoConfig.from_pretrained(path)
    assert cfg.model_type == arch
    with quiet_hf():
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert len(tok) <= cfg.vocab_size
    ids = tok("Once upon a time there was a little robot", return_tensors="pt").input_ids
    steps = 24
    with torch.no_grad():
        out = model.generate(
            ids,
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    new = out.sequences[0, ids.shape[1] :].tolist()
    assert len(new) == steps
    assert len(set(new)) >= 6, new  # not stuck on one token
    margins = sorted(float(lg[0].topk(2).values.diff().abs()) for lg in out.logits)
    assert margins[len(margins) // 2] > 0.5, margins  # logits are far from uniform

    state = model.state_dict()
    if arch == "qwen2":
        assert state["model.layers.0.self_attn.q_proj.bias"].abs().sum() > 0
    if arch == "deepseek_v2":
        rope = cfg.rope_parameters
        assert rope["rope_type"] == ("default" if sizes.get("yarn") is False else "yarn")
        if rope["rope_type"] == "yarn":
            assert rope["original_max_position_embeddings"] * rope["factor"] == cfg.max_position_embeddings
        assert (cfg.q_lora_rank is None) == ("q_lora_rank" not in sizes)
        dense_layers = cfg.num_hidden_layers if sizes.get("n_routed_experts") == 0 else 1
        assert cfg.first_k_dense_replace == dense_layers
        if dense_layers < cfg.num_hidden_layers:
            assert type(model.model.layers[0].mlp).__name__ == "DeepseekV2MLP"
            assert type(model.model.layers[-1].mlp).__name__ == "DeepseekV2Moe"


def test_tiny_tokenizer_round_trip_and_chat_template(tiny_dir):
    from transformers import AutoTokenizer

    from engine.checkpoints.tiny_tokenizer import BOS_ID, EOS_ID, PAD_ID

    path = _make(tiny_dir, "tok", "llama")
    tok = AutoTokenizer.from_pretrained(path)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID)
    for text in ["Hello world! 12 + 34 = 46.", "  spaces\tand\nnewlines  ", "naïve café ✓ 日本"]:
        ids = tok(text).input_ids
        assert tok.decode(ids) == text
        assert max(ids) < len(tok)
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert ids[0] == BOS_ID and ids.count(EOS_ID) == 1
    assert tok.decode(ids) == text


def test_model_cli_tiny_prints_path(tiny_dir):
    from typer.testing import CliRunner

    from dcpctl.model_cmd import app

    out = tiny_dir / "cli_ds"
    args = ["tiny", str(out), "--arch", "deepseek_v2", "--seed", "2", "--q-lora-rank", "8", "--no-yarn"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == str(out)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["q_lora_rank"] == 8 and cfg["rope_parameters"]["rope_type"] == "default"

    bad = CliRunner().invoke(app, ["tiny", str(tiny_dir / "cli_bad"), "--arch", "llama", "--kv-lora-rank", "4"])
    assert isinstance(bad.exception, UserError)


def test_model_cli_pull_unknown_name_raises_user_error():
    from typer.testing import CliRunner

    from dcpctl.model_cmd import app

    result = CliRunner().invoke(app, ["pull", "nope"])
    assert isinstance(result.exception, UserError)


# ---- SmolLM2 (slow: ~40 s the first time, then reuses the cache) ----


@pytest.mark.slow
def test_pull_smollm2(monkeypatch, tmp_path):
    from engine.checkpoints.pull import pull_model

    default = Path.home() / ".cache" / "dcpctl" / "models"
    if not is_complete(default / SMOLLM2):
        monkeypatch.setenv("DCPCTL_CACHE", str(tmp_path / "cache"))
    path = pull_model(SMOLLM2)
    assert path == cache_dir() / SMOLLM2 and is_complete(path)

    marker = aliases.read_marker(path)
    assert marker["sha256"] == KNOWN_ALIASES[SMOLLM2].gguf_sha256
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "llama" and "quantization_config" not in cfg
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (30, 9, 3)
    assert (cfg["hidden_size"], cfg["vocab_size"], cfg["tie_word_embeddings"]) == (576, 49152, True)

    start = time.monotonic()
    assert pull_model(SMOLLM2) == path
    assert time.monotonic() - start < 1.0


@pytest.mark.slow
def test_smollm2_answers_from_saved_folder():
    """The dequantized float32 folder is a working chat model (catches a wrong tensor layout)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.checkpoints.tiny import quiet_hf

    path = Path.home() / ".cache" / "dcpctl" / "models" / SMOLLM2
    if not is_complete(path):
        pytest.skip(f"{path} not pulled (run: dcpctl model pull {SMOLLM2})")
    with quiet_hf():
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path).eval()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, ids["input_ids"].shape[1] :])
    assert "Paris" in answer, answer

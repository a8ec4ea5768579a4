"""Shared fixtures: tiny config-only model folders and plan files in tmp dirs."""

from __future__ import annotations

import json
import os
import shutil
import textwrap
from pathlib import Path

import pytest


@pytest.fixture(scope="module", autouse=True)
def cpu_set_kept():
    """A module whose tests step an engine from pytest's thread gives the thread its CPU set back by its end (an
    engine pins the thread that steps it until it is shut down; a module-scoped `LLM` holds it across the module's
    tests): the modules after it would otherwise start every process on one core, and those that need two skip."""
    before = os.sched_getaffinity(0)
    yield
    after = os.sched_getaffinity(0)
    assert after == before, f"the module left pytest's thread pinned to CPUs {sorted(after)} (it had {sorted(before)})"


def write_config(folder: Path, **fields) -> Path:
    """A config.json-only model folder (enough for plan checks): Llama-like unless fields say otherwise."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "vocab_size": 256,
        "max_position_embeddings": 1024,
        "intermediate_size": 128,
        "torch_dtype": "float32",
    }
    config.update(fields)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def mla_fields(**fields) -> dict:
    """config.json fields of a small DeepseekV2 (MLA) model."""
    base = {
        "architectures": ["DeepseekV2ForCausalLM"],
        "num_attention_heads": 4,
        "kv_lora_rank": 32,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "moe_intermediate_size": 32,
    }
    base.update(fields)
    return base


@pytest.fixture
def make_plan(tmp_path):
    """Write a plan file (YAML text, dedented) into tmp_path and return its path."""

    def _make(text: str, name: str = "plan.yaml") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text))
        return path

    return _make


@pytest.fixture
def llama_folder(tmp_path) -> Path:
    return write_config(tmp_path / "llama")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Session cache of tiny random checkpoints: tiny_models(arch, **sizes) -> folder."""
    from engine.checkpoints.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny")
    made: dict[tuple, Path] = {}

    def _get(arch: str, seed: int = 0, **sizes) -> Path:
        key = (arch, seed, tuple(sorted(sizes.items())))
        if key not in made:
            name = "-".join([arch, str(seed), *(f"{k}{v}" for k, v in sorted(sizes.items()))])
            made[key] = make_tiny_checkpoint(root / name, arch, seed=seed, **sizes)
        return made[key]

    return _get


ECHO_OUT_SCALE = 0.4  # o_proj / down_proj scaled by this: the token embedding about as strong as the layers


@pytest.fixture(scope="session")
def echo_models(tiny_models, tmp_path_factory):
    """Tiny checkpoints whose greedy output often repeats itself: echo_models(arch, **sizes) -> folder.

    A tiny random model's output never repeats, so prompt lookup (ngram speculation) never guesses right. With tied
    embeddings and the layers' output projections scaled down, the token embedding competes with the layers:
    greedy runs mix repeats (proposals accepted), short runs (partly accepted) and fresh tokens (rejected), while
    every logit still depends on attention over the whole cached context.
    """
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("echo")
    made: dict[tuple, Path] = {}

    def _get(arch: str, **sizes) -> Path:
        key = (arch, tuple(sorted(sizes.items())))
        if key not in made:
            src = tiny_models(arch, tie_word_embeddings=True, **sizes)
            dst = root / src.name
            shutil.copytree(src, dst)
            weights = load_file(dst / "model.safetensors")
            for name, tensor in weights.items():
                if "o_proj" in name or "down_proj" in name:
                    weights[name] = tensor * ECHO_OUT_SCALE
            save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
            made[key] = dst
        return made[key]

    return _get


@pytest.fixture(scope="session")
def kv_scaled_models(tiny_models, tmp_path_factory):
    """Copies of tiny checkpoints with fp8 KV cache scale tensors added: kv_scaled_models(arch, scales, **sizes) ->
    folder, `scales` mapping a tensor name (e.g. model.layers.0.self_attn.k_scale) to its value (a 0-d fp32 tensor, as
    llm-compressor writes them)."""
    import torch
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("kv_scaled")
    made: dict[tuple, Path] = {}

    def _get(arch: str, scales: dict[str, float], **sizes) -> Path:
        key = (arch, repr(sorted(scales.items())), tuple(sorted(sizes.items())))
        if key not in made:
            src = tiny_models(arch, **sizes)
            dst = root / f"{src.name}-{len(made)}"
            shutil.copytree(src, dst)
            weights = load_file(dst / "model.safetensors")
            weights.update({name: torch.tensor(value, dtype=torch.float32) for name, value in scales.items()})
            save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
            made[key] = dst
        return made[key]

    return _get


DRAFT_NOISE = 0.05  # of each matrix's std: a draft whose greedy proposals are right about a fifth of the time


@pytest.fixture(scope="session")
def noisy_drafts(tiny_models, tmp_path_factory):
    """Draft checkpoints for speculative decoding (method draft_model): noisy_drafts(arch, **sizes) -> a copy of
    tiny_models(arch, **sizes) with every matrix perturbed by seeded noise of DRAFT_NOISE x its std.

    The target's tokenizer and size; its proposals are often wrong (a random model of another seed is always wrong,
    and one as close as the target always right): verifications accept all, some and none of them.
    """
    import torch
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("drafts")
    made: dict[tuple, Path] = {}

    def _get(arch: str, **sizes) -> Path:
        key = (arch, tuple(sorted(sizes.items())))
        if key not in made:
            src = tiny_models(arch, **sizes)
            dst = root / src.name
            shutil.copytree(src, dst)
            weights = load_file(dst / "model.safetensors")
            g = torch.Generator().manual_seed(1)
            for name in sorted(weights):
                tensor = weights[name]
                if tensor.dim() > 1:
                    weights[name] = tensor + DRAFT_NOISE * tensor.std() * torch.randn(tensor.shape, generator=g)
            save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
            made[key] = dst
        return made[key]

    return _get

"""A checkpoint's config as plain values: what rank 0 reads with transformers and sends to the other ranks."""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.checkpoints.config_values import ConfigValues, read_config
from engine.errors import UserError
from engine.layers.rotary import RotaryEmbedding

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "deepseek_v2"])
def test_the_values_read_as_the_transformers_config_and_build_the_same_rope(arch, tiny_models):
    from transformers import AutoConfig

    folder = tiny_models(arch)
    real = AutoConfig.from_pretrained(folder)
    values = pickle.loads(pickle.dumps(read_config(folder)))  # as another rank receives it
    assert isinstance(values, ConfigValues)
    public = [name for name in vars(real) if not name.startswith("_")]
    assert "num_hidden_layers" in public and "rope_parameters" in public
    for name in [*public, *real.attribute_map, "model_type"]:
        assert getattr(values, name) == getattr(real, name), name
    assert getattr(values, "no_such_field", "default") == "default"
    with pytest.raises(AttributeError, match="no_such_field"):
        values.no_such_field  # noqa: B018
    # DeepSeek-V2's tiny checkpoint has yarn rope: its frequencies come from transformers' init function on rank 0
    assert hasattr(values, "rope_init") == (arch == "deepseek_v2")
    dim = getattr(real, "qk_rope_head_dim", None) or real.hidden_size // real.num_attention_heads
    ours, theirs = (RotaryEmbedding(c, dim, 64, arch == "deepseek_v2", torch.device("cpu")) for c in (values, real))
    assert torch.equal(ours.cos, theirs.cos) and torch.equal(ours.sin, theirs.sin)


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"model_type": "no-such-model"}, "ValueError: The checkpoint you are trying to load has model type"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, 'KeyError: "Missing required keys in `rope_'),
    ],
)
def test_a_config_transformers_cannot_read_is_one_line_naming_the_file(tmp_path, tiny_models, fields, error):
    config = json.loads((tiny_models("llama") / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **fields}))
    with pytest.raises(UserError) as caught:
        read_config(tmp_path)
    assert str(caught.value).startswith(f"{tmp_path}/config.json: transformers cannot read it ({error}")
    assert "\n" not in str(caught.value)


def test_a_follower_rank_starts_without_transformers_or_the_server():
    """A rank other than 0 imports what `engine.worker` imports for a served plan there: no transformers (rank 0
    reads the config, its own calls import it) and no server modules (rank 0 serves); rank 0's server modules bring
    no transformers either."""
    code = (
        "import sys, engine.worker, engine.serving.ranks, engine.llm, engine.core.startup\n"
        "heavy = ('transformers', 'sympy', 'fastapi', 'uvicorn')\n"
        "print(sorted({m.split('.')[0] for m in sys.modules if m.split('.')[0] in heavy}))\n"
        "import engine.serving.hosting\n"
        "print(sorted({m.split('.')[0] for m in sys.modules if m.split('.')[0] in heavy}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.split("\n")[:2] == ["[]", "['fastapi']"], done.stdout


@pytest.mark.multiproc
def test_a_config_rank_0_cannot_read_fails_the_two_rank_run_in_one_line(tmp_path, tiny_models):
    folder = tmp_path / "model"
    shutil.copytree(tiny_models("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "no-such-model"}))
    plan = tmp_path / "plan.yaml"
    plan.write_text(f"name: bad\nmodel:\n  path: {folder}\nparallel:\n  dcp: 2\ncache:\n  memory: 64MiB\n")
    argv = [sys.executable, "-m", "dcpctl.cli", "run", str(plan), "--prompt", "Hi", "--max-tokens", "2"]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert f"{folder}/config.json: transformers cannot read it (" in done.stderr
    assert "Traceback" not in done.stderr

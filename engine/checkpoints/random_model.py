"""Random checkpoints at real shapes: a named model's full config and random weights, made where they are used.

A GPU machine may have no network and no room to carry a 16-30 GB checkpoint, yet real-size speed needs real
shapes. The config is the model's public config.json (the facts `plan suggest` ships, engine.suggest.models, plus
the fields a runnable config needs: rope, norms, routing), the weights are drawn tensor by tensor on the chosen
device with the tiny checkpoints' scales (engine.checkpoints.tiny) and streamed to safetensors shard by shard, so
host memory never holds more than about two shards. Weights are random: the text is noise; the speed is real.

The tokenizer is the tiny checkpoints' byte-level BPE (trained offline, at most the model's vocab size), not the
model's own: its tokenizer cannot be fetched offline and no shipped one has the same vocab size. Its special token
ids (0 pad, 1 bos, 2 eos) go into the config.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from engine.checkpoints.shipped_configs import SHIPPED
from engine.checkpoints.tiny import (
    MIN_VOCAB,
    check_out_folder,
    embedding_std,
    make_readable,
    move_into_place,
    quiet_hf,
    random_parameter,
)
from engine.checkpoints.tiny_tokenizer import BOS_ID, EOS_ID, PAD_ID, build_tokenizer
from engine.errors import UserError

PROVENANCE_FILE = "dcpctl-random.json"
DEFAULT_SHARD_BYTES = 2 << 30
DTYPES = ("bfloat16", "float16", "float32")

# Fields of each model's public config.json that the planning facts (engine.checkpoints.shipped_configs.SHIPPED)
# leave out, in transformers 5's form (rope_parameters); the hub's config.json of the repo named there is the source.
_RUNTIME_FIELDS: dict[str, dict[str, Any]] = {
    "deepseek-v2-lite": {
        "model_type": "deepseek_v2",
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "topk_method": "greedy",
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
        "norm_topk_prob": False,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
        },
    },
    "llama-3.1-8b-instruct": {
        "model_type": "llama",
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
    "qwen2.5-7b-instruct": {
        "model_type": "qwen2",
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    },
    "smollm2-135m-instruct": {
        "model_type": "llama",
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
    },
}
_RUNTIME_FIELDS["llama-3.1-70b-instruct"] = _RUNTIME_FIELDS["llama-3.1-8b-instruct"]

_FUSED_EXPERTS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def random_model_names() -> list[str]:
    """The model names `make_random_checkpoint` knows."""
    return sorted(_RUNTIME_FIELDS)


def random_model_config(name: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config.json fields of `name` with `overrides` applied (each must name an existing field)."""
    if name not in _RUNTIME_FIELDS:
        runnable = ", ".join(random_model_names())
        also = " (shipped for planning only: the engine does not run its architecture)" if name in SHIPPED else ""
        raise UserError(f"no random checkpoint for model {name!r}{also}: use one of {runnable}")
    fields = {**SHIPPED[name].config, **_RUNTIME_FIELDS[name]}
    fields.pop("torch_dtype", None)
    for key, value in (overrides or {}).items():
        if key not in fields:
            raise UserError(f"--set {key}: {name}'s config has no field {key!r}; fields: {', '.join(sorted(fields))}")
        fields[key] = value
    if fields["vocab_size"] < MIN_VOCAB:
        raise UserError(f"vocab_size must be >= {MIN_VOCAB} for the byte-level tokenizer (got {fields['vocab_size']})")
    fields.update(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    return fields


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`KEY=VALUE` strings to a dict; VALUE is JSON where it parses (numbers, true, null), else a string."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--set {item!r}: write KEY=VALUE, e.g. --set num_hidden_layers=2")
        try:
            out[key.strip()] = json.loads(text)
        except json.JSONDecodeError:
            out[key.strip()] = text
    return out


def make_random_checkpoint(
    name: str,
    out: str | os.PathLike,
    *,
    overrides: dict[str, Any] | None = None,
    dtype: str = "bfloat16",
    device: str = "auto",
    seed: int = 0,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    overwrite: bool = False,
) -> Path:
    """Write `name`'s config, random weights (sharded safetensors + index) and a tokenizer to `out`.

    Weights are drawn on `device` (auto: CUDA when present) in `dtype`, one tensor at a time in name order from one
    generator seeded with `seed`, and written whenever a shard reaches `max_shard_bytes`. The folder appears whole
    (built alongside, then renamed).
    """
    import torch

    if dtype not in DTYPES:
        raise UserError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if device not in ("auto", "cpu", "cuda"):
        raise UserError(f"device {device!r} is not one of auto, cpu, cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("device cuda: no CUDA GPU is visible here; use --device cpu (or auto)")
    if max_shard_bytes < 1:
        raise UserError(f"the shard size must be positive (got {max_shard_bytes} bytes)")
    fields = random_model_config(name, overrides)
    out = Path(out).expanduser()
    check_out_folder(out, overwrite)
    where = torch.device("cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu")
    with quiet_hf():
        from transformers import AutoConfig

        try:
            config = AutoConfig.for_model(**fields)
        except (ValueError, TypeError) as exc:
            raise UserError(f"{name} with these --set values is not a valid config: {exc}") from None
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.tmp-") as work:
        build = Path(work) / "build"
        build.mkdir()
        config.dtype = dtype
        with quiet_hf():
            config.save_pretrained(build)
            build_tokenizer(config.vocab_size, config.max_position_embeddings).save_pretrained(build)
        gen = torch.Generator(device=where).manual_seed(seed)
        _write_shards(build, _random_tensors(config, gen, getattr(torch, dtype)), max_shard_bytes)
        provenance = {"model": name, "seed": seed, "dtype": dtype, "overrides": overrides or {}, "device": where.type}
        (build / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2, sort_keys=True) + "\n")
        make_readable(build)
        move_into_place(build, out, Path(work))
    return out


def checkpoint_shapes(config: Any) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of `config`'s HF checkpoint as saved (per-expert MoE names), name-sorted, from a meta-device
    model (no memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    with quiet_hf(), torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    shapes: list[tuple[str, tuple[int, ...]]] = []
    for param_name, param in model.named_parameters():
        if tied and param_name == "lm_head.weight":
            continue
        shape = tuple(param.shape)
        if param_name.endswith(_FUSED_EXPERTS[0]):  # [E, 2I, H]: gate rows, then up rows
            prefix = param_name.removesuffix("gate_up_proj")
            for e in range(shape[0]):
                for proj in ("gate_proj", "up_proj"):
                    shapes.append((f"{prefix}{e}.{proj}.weight", (shape[1] // 2, shape[2])))
        elif param_name.endswith(_FUSED_EXPERTS[1]):  # [E, H, I]
            prefix = param_name.removesuffix("down_proj")
            shapes.extend((f"{prefix}{e}.down_proj.weight", shape[1:]) for e in range(shape[0]))
        else:
            shapes.append((param_name, shape))
    return sorted(shapes)


def _random_tensors(config: Any, gen: Any, dtype: Any) -> Iterator[tuple[str, Any]]:
    embed_std = embedding_std(config)
    for name, shape in checkpoint_shapes(config):
        yield name, random_parameter(name, shape, gen, embed_std, dtype)


def _write_shards(folder: Path, tensors: Iterator[tuple[str, Any]], max_shard_bytes: int) -> None:
    """Save `tensors` as model-0000i-of-0000n.safetensors files of at most `max_shard_bytes` each (a bigger tensor
    gets a shard of its own) and the index that maps names to files; one shard is held in memory at a time."""
    from safetensors.torch import save_file

    weight_map: dict[str, int] = {}
    shard: dict[str, Any] = {}
    shard_bytes = total = 0
    count = 0

    def flush() -> None:
        nonlocal shard, shard_bytes, count
        if shard:
            count += 1
            save_file({k: v.cpu() for k, v in shard.items()}, folder / f"shard-{count}.tmp", metadata={"format": "pt"})
            shard, shard_bytes = {}, 0

    for name, tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        if shard and shard_bytes + size > max_shard_bytes:
            flush()
        shard[name] = tensor
        shard_bytes += size
        total += size
        weight_map[name] = count + 1
    flush()
    digits = max(5, int(math.log10(count)) + 1)
    files = {i: f"model-{i:0{digits}d}-of-{count:0{digits}d}.safetensors" for i in range(1, count + 1)}
    for i, file in files.items():
        (folder / f"shard-{i}.tmp").rename(folder / file)
    index = {"metadata": {"total_size": total}, "weight_map": {k: files[v] for k, v in sorted(weight_map.items())}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

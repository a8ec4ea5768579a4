"""Tiny random checkpoints (Llama, Qwen2, DeepseekV2) that HF transformers and our engine both load offline.

The weights are not HF's default init: every parameter is drawn from one seeded generator in name order, with
scales chosen so that logits are far from uniform. Greedy decoding then has wide top-1/top-2 margins, so two
correct implementations pick the same tokens despite float rounding, and it does not collapse into repeating
one token.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from engine.checkpoints.tiny_tokenizer import BOS_ID, EOS_ID, PAD_ID, build_tokenizer
from engine.errors import UserError
from engine.io_utils import writable_folder

ARCHS = ("llama", "qwen2", "deepseek_v2")

PROVENANCE_FILE = "dcpctl-tiny.json"
MIN_VOCAB = 320  # 256 byte tokens + specials + a few merges

_COMMON_DEFAULTS: dict[str, Any] = {
    "hidden_size": 64,
    "num_layers": 2,
    "num_heads": 4,
    "intermediate_size": 128,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
}
_GQA_DEFAULTS: dict[str, Any] = {"num_kv_heads": 2, "head_dim": 16}
_DEEPSEEK_DEFAULTS: dict[str, Any] = {
    "kv_lora_rank": 32,
    "q_lora_rank": None,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 32,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 1.0,
    "topk_method": "greedy",
    "n_group": None,
    "topk_group": None,
    # DeepSeek-V2-Lite's rope_scaling, scaled down: factor 40 over 4096 there.
    "yarn": True,
    "yarn_factor": 4.0,
    "original_max_position_embeddings": None,  # None: max_position_embeddings / yarn_factor
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}

# Init scales (std of each parameter family); see the module docstring for why they are this large.
_EMBED_STD = 1.0
_LINEAR_GAIN = 2.0  # std = gain / sqrt(fan_in)
# o_proj / down_proj gain, relative to the embedding std: the layers' outputs must outweigh the token
# embedding in the residual stream, or (tied embeddings especially) greedy decoding repeats the input token.
_OUT_GAIN_PER_EMBED_STD = 3.0
_ROUTER_GAIN = 3.0  # spread router logits so the top-k experts are rarely a near tie
_LOGIT_STD = 16.0  # lm_head std = this / sqrt(hidden_size): logits spread this much whatever the width
_BIAS_STD = 0.2
_NORM_RANGE = (0.75, 1.25)


def default_sizes(arch: str) -> dict[str, Any]:
    """All size options accepted for `arch`, with their defaults."""
    _check_arch(arch)
    extra = _DEEPSEEK_DEFAULTS if arch == "deepseek_v2" else _GQA_DEFAULTS
    return {**_COMMON_DEFAULTS, **extra}


def make_tiny_checkpoint(
    out: str | os.PathLike, arch: str, seed: int = 0, *, overwrite: bool = False, **sizes: Any
) -> Path:
    """Write a random `arch` checkpoint (config, safetensors, tokenizer) to `out` and return its path.

    Size options are those of `default_sizes(arch)`; the same seed and sizes give byte-identical files. The
    folder appears whole (built alongside, then renamed); an existing non-empty `out` needs `overwrite=True`.
    """
    if not str(out).strip():
        raise UserError("the output folder is empty: give a folder path such as models/tiny-llama")
    if not 0 <= seed < 2**63:
        raise UserError(f"seed must be 0 .. 2**63-1 (got {seed})")
    out = Path(out).expanduser()
    resolved = _resolve_sizes(arch, sizes)
    check_out_folder(out, overwrite)

    import torch

    config = _build_config(arch, resolved)
    tokenizer = build_tokenizer(resolved["vocab_size"], resolved["max_position_embeddings"])

    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.tmp-") as work:
        build = Path(work) / "build"
        with quiet_hf():
            from transformers import AutoModelForCausalLM

            with _torch_seed(seed):
                model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            init_weights(model, seed)
            model.save_pretrained(build)
            tokenizer.save_pretrained(build)
        provenance = {"arch": arch, "seed": seed, "sizes": resolved}
        (build / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2, sort_keys=True) + "\n")
        make_readable(build)
        move_into_place(build, out, Path(work))
    return out


def init_weights(model: Any, seed: int) -> None:
    """Overwrite every parameter of `model` from one generator seeded with `seed`, in name order."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    embed_std = embedding_std(model.config)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            param.copy_(random_parameter(name, param.shape, gen, embed_std).to(param.dtype))


def embedding_std(config: Any) -> float:
    """The token embedding's init std: tied embeddings double as the LM head, so they get its logit scale."""
    if getattr(config, "tie_word_embeddings", False):
        return _LOGIT_STD / math.sqrt(config.hidden_size)
    return _EMBED_STD


def random_parameter(name: str, shape: Any, gen: Any, embed_std: float, dtype: Any = None) -> Any:
    """One parameter's random init (fp32 unless `dtype`), drawn from `gen` on the generator's device; the scale
    depends on the parameter's family, read from its HF name (see the module docstring)."""
    import torch

    kw = {"generator": gen, "device": gen.device, "dtype": dtype}
    if "norm" in name:
        lo, hi = _NORM_RANGE
        return torch.rand(shape, **kw).mul_(hi - lo).add_(lo)
    if name.endswith(".bias"):
        std = _BIAS_STD
    elif name.startswith("lm_head"):
        std = _LOGIT_STD / math.sqrt(shape[-1])
    elif "embed_tokens" in name:
        std = embed_std
    else:
        gain = _LINEAR_GAIN
        if name.endswith("mlp.gate.weight"):
            gain = _ROUTER_GAIN
        elif "o_proj" in name or "down_proj" in name:
            gain = _OUT_GAIN_PER_EMBED_STD * embed_std
        std = gain / math.sqrt(shape[-1])
    return torch.randn(shape, **kw).mul_(std)


def make_readable(folder: Path) -> None:
    """Give every file in `folder` mode 0644: some writers use private temp files (0600), and model folders
    are shared (the cache)."""
    for path in folder.iterdir():
        if path.is_file():
            path.chmod(0o644)


@contextlib.contextmanager
def quiet_hf() -> Iterator[None]:
    """Silence transformers' progress bars and info/warning logs for the duration."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def _check_arch(arch: str) -> None:
    if arch not in ARCHS:
        raise UserError(f"unknown tiny model arch {arch!r}: use one of {', '.join(ARCHS)}")


def _resolve_sizes(arch: str, sizes: dict[str, Any]) -> dict[str, Any]:
    resolved = default_sizes(arch)
    unknown = sorted(set(sizes) - set(resolved))
    if unknown:
        raise UserError(
            f"size option(s) {', '.join(unknown)} do not apply to arch {arch}: use any of {', '.join(sorted(resolved))}"
        )
    resolved.update(sizes)
    r = resolved
    positive = ["hidden_size", "num_layers", "num_heads", "intermediate_size", "max_position_embeddings"]
    mla = arch == "deepseek_v2"
    positive += ["kv_lora_rank", "qk_rope_head_dim", "v_head_dim"] if mla else ["num_kv_heads", "head_dim"]
    for key in positive:
        if int(r[key]) < 1:
            raise UserError(f"{key} must be >= 1 (got {r[key]})")
    for key in ("qk_nope_head_dim", "n_routed_experts", "n_shared_experts", "first_k_dense_replace"):
        if key in r and int(r[key]) < 0:
            raise UserError(f"{key} must be >= 0 (got {r[key]})")
    for key in ("rope_theta", "yarn_factor", "routed_scaling_factor", "mscale", "mscale_all_dim"):
        if key in r and not (math.isfinite(r[key]) and r[key] > 0):
            raise UserError(f"{key} must be a positive finite number (got {r[key]})")
    if arch != "qwen2" and r["hidden_size"] % r["num_heads"]:  # LlamaConfig and DeepseekV2Config check it
        raise UserError(
            f"hidden_size ({r['hidden_size']}) must be a multiple of num_heads ({r['num_heads']}) for transformers' "
            f"{arch} config"
        )
    if r["vocab_size"] < MIN_VOCAB:
        raise UserError(f"vocab_size must be >= {MIN_VOCAB} for the byte-level tokenizer (got {r['vocab_size']})")
    if arch == "deepseek_v2":
        if r["q_lora_rank"] == 0:
            r["q_lora_rank"] = None
        if r["qk_rope_head_dim"] % 2:
            raise UserError(f"qk_rope_head_dim must be even (got {r['qk_rope_head_dim']})")
        if r["n_routed_experts"] and not 1 <= r["num_experts_per_tok"] <= r["n_routed_experts"]:
            raise UserError(
                f"num_experts_per_tok ({r['num_experts_per_tok']}) must be between 1 and "
                f"n_routed_experts ({r['n_routed_experts']})"
            )
        if r["yarn"] and r["original_max_position_embeddings"] is None:
            r["original_max_position_embeddings"] = max(1, int(r["max_position_embeddings"] / r["yarn_factor"]))
    else:
        if r["num_heads"] % r["num_kv_heads"]:
            raise UserError(f"num_heads ({r['num_heads']}) must be a multiple of num_kv_heads ({r['num_kv_heads']})")
        if r["head_dim"] % 2:
            raise UserError(f"head_dim must be even for rotary embeddings (got {r['head_dim']})")
    return r


def _build_config(arch: str, r: dict[str, Any]) -> Any:
    common = {
        "vocab_size": r["vocab_size"],
        "hidden_size": r["hidden_size"],
        "intermediate_size": r["intermediate_size"],
        "num_hidden_layers": r["num_layers"],
        "num_attention_heads": r["num_heads"],
        "max_position_embeddings": r["max_position_embeddings"],
        "rms_norm_eps": r["rms_norm_eps"],
        "tie_word_embeddings": r["tie_word_embeddings"],
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
    }
    if arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(
            **common,
            num_key_value_heads=r["num_kv_heads"],
            head_dim=r["head_dim"],
            rope_parameters={"rope_type": "default", "rope_theta": r["rope_theta"]},
        )
    if arch == "qwen2":
        from transformers import Qwen2Config

        # Qwen2's q/k/v projections always carry a bias; there is no flag for it.
        return Qwen2Config(
            **common,
            num_key_value_heads=r["num_kv_heads"],
            head_dim=r["head_dim"],
            rope_parameters={"rope_type": "default", "rope_theta": r["rope_theta"]},
        )
    from transformers import DeepseekV2Config

    if r["yarn"]:
        rope = {
            "rope_type": "yarn",
            "rope_theta": r["rope_theta"],
            "factor": float(r["yarn_factor"]),
            "original_max_position_embeddings": int(r["original_max_position_embeddings"]),
            "mscale": float(r["mscale"]),
            "mscale_all_dim": float(r["mscale_all_dim"]),
            "beta_fast": float(r["beta_fast"]),
            "beta_slow": float(r["beta_slow"]),
        }
    else:
        rope = {"rope_type": "default", "rope_theta": r["rope_theta"]}
    n_experts = r["n_routed_experts"]
    return DeepseekV2Config(
        **common,
        kv_lora_rank=r["kv_lora_rank"],
        q_lora_rank=r["q_lora_rank"],
        qk_nope_head_dim=r["qk_nope_head_dim"],
        qk_rope_head_dim=r["qk_rope_head_dim"],
        v_head_dim=r["v_head_dim"],
        # n_routed_experts = 0 means a dense model: HF builds a MoE block from layer first_k_dense_replace on.
        n_routed_experts=n_experts if n_experts else 1,
        first_k_dense_replace=r["first_k_dense_replace"] if n_experts else r["num_layers"],
        num_experts_per_tok=r["num_experts_per_tok"] if n_experts else 1,
        n_shared_experts=r["n_shared_experts"],
        moe_intermediate_size=r["moe_intermediate_size"],
        routed_scaling_factor=float(r["routed_scaling_factor"]),
        topk_method=r["topk_method"],
        n_group=r["n_group"],
        topk_group=r["topk_group"],
        norm_topk_prob=False,
        rope_parameters=rope,
    )


@contextlib.contextmanager
def _torch_seed(seed: int) -> Iterator[None]:
    import torch

    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.random.set_rng_state(state)


def check_out_folder(out: Path, overwrite: bool) -> None:
    """A UserError unless `out` may become a new model folder (absent, empty, or replaced with `overwrite`)."""
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} exists and is not a folder: pick another output path")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise UserError(f"{out} already exists and is not empty: pick another folder or overwrite it (--force)")
    writable_folder(out, "output folder")


def move_into_place(build: Path, out: Path, work: Path) -> None:
    """Rename the finished `build` folder to `out` (an old `out` goes into `work`, removed with it)."""
    if out.is_dir():
        if any(out.iterdir()):
            os.replace(out, work / "old")  # removed with the work folder
        else:
            out.rmdir()
    os.replace(build, out)
    shutil.rmtree(work / "old", ignore_errors=True)

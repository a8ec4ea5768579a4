"""What the plan checks and the engine need to know about a checkpoint, read without torch.

`read_model_info` parses `config.json` (and the safetensors headers for the weight size) so
that `dcpctl plan validate` can apply the head and memory rules before anything is launched.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from engine.errors import UserError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "DeepseekV2ForCausalLM",
)

_DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F64": 8,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}


@dataclass(frozen=True)
class ModelInfo:
    """Shape facts of a checkpoint that layout, memory and engine decisions depend on."""

    path: Path
    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int  # 1 for MLA: the latent cache is one shared "head"
    head_dim: int  # per-head query/key dim for GQA models
    vocab_size: int
    max_position_embeddings: int
    torch_dtype: str
    is_mla: bool = False
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    q_lora_rank: int = 0  # 0: MLA queries come from one q_proj
    intermediate_size: int = 0
    moe_intermediate_size: int = 0
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0  # MLA models: the first k decoder layers have a dense MLP, the rest MoE
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # GQA: q/k/v projections; MLA: q_a_proj and kv_a_proj_with_mqa
    o_bias: bool = False
    mlp_bias: bool = False
    weight_bytes: int = 0  # total bytes of the safetensors tensors, 0 if unknown

    def kv_bytes_per_token(self, tp: int, dtype_bytes: int) -> int:
        """KV cache bytes one rank stores per token over all layers (before DCP sharding)."""
        if self.is_mla:
            per_layer = (self.kv_lora_rank + self.qk_rope_head_dim) * dtype_bytes
        else:
            heads = max(1, self.num_kv_heads // tp)
            per_layer = 2 * heads * self.head_dim * dtype_bytes
        return per_layer * self.num_layers


def dtype_bytes(name: str) -> int:
    """Bytes per element of a dtype name such as 'float32' or 'bfloat16'."""
    try:
        return _DTYPE_BYTES[name]
    except KeyError:
        raise UserError(f"unknown dtype {name!r}; use one of float32, bfloat16, float16") from None


def safetensors_entries(folder: Path) -> list[tuple[str, str, int]]:
    """(name, dtype, bytes) of every tensor in a folder's safetensors files, read from their headers only."""
    entries = []
    for file in sorted(Path(folder).glob("*.safetensors")):
        with file.open("rb") as fh:
            (header_len,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(header_len))
        for name, meta in header.items():
            if name != "__metadata__":
                start, end = meta["data_offsets"]
                entries.append((name, meta["dtype"], end - start))
    return entries


def weight_elements(folder: Path) -> int:
    """Parameters stored in a checkpoint folder (tied weights count once)."""
    return sum(size // _DTYPE_BYTES.get(dtype, 1) for _, dtype, size in safetensors_entries(folder))


def read_config(folder: Path) -> dict:
    """The parsed config.json of a checkpoint folder, with a clear error when it is unusable."""
    config_file = folder / "config.json"
    if not folder.is_dir():
        raise UserError(f"model folder {folder} does not exist; run `dcpctl model pull` or fix model.path")
    if not config_file.is_file():
        raise UserError(f"{folder} has no config.json; model.path must be a Hugging Face checkpoint folder")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise UserError(f"{config_file} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    except (UnicodeDecodeError, RecursionError):
        raise UserError(
            f"{config_file} is not a JSON text; model.path must be a Hugging Face checkpoint folder"
        ) from None
    if not isinstance(config, dict):
        raise UserError(f"{config_file} must hold a JSON object (a model config), not {type(config).__name__}")
    return config


def architecture_of(config: dict, where: Path) -> str:
    """The single supported architecture a config names, or a UserError listing the supported ones."""
    archs = config.get("architectures") or []
    arch = archs[0] if archs else ""
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UserError(
            f"{where}: unsupported architecture {arch or '(none given)'!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def read_model_info(folder: str | Path) -> ModelInfo:
    """Read a checkpoint folder's config.json (and weight sizes) into a ModelInfo."""
    folder = Path(folder)
    config = read_config(folder)
    arch = architecture_of(config, folder / "config.json")
    try:
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        is_mla = arch == "DeepseekV2ForCausalLM"
        head_dim = int(config.get("head_dim") or hidden // heads)
        kv_heads = 1 if is_mla else int(config.get("num_key_value_heads") or heads)
        attention_bias = bool(config.get("attention_bias"))
        info = ModelInfo(
            path=folder,
            architecture=arch,
            num_layers=int(config["num_hidden_layers"]),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=int(config["vocab_size"]),
            max_position_embeddings=int(config.get("max_position_embeddings") or 2048),
            torch_dtype=str(config.get("torch_dtype") or config.get("dtype") or "float32"),
            is_mla=is_mla,
            kv_lora_rank=int(config.get("kv_lora_rank") or 0),
            qk_rope_head_dim=int(config.get("qk_rope_head_dim") or 0),
            qk_nope_head_dim=int(config.get("qk_nope_head_dim") or 0),
            v_head_dim=int(config.get("v_head_dim") or 0),
            q_lora_rank=int(config.get("q_lora_rank") or 0),
            intermediate_size=int(config.get("intermediate_size") or 0),
            moe_intermediate_size=int(config.get("moe_intermediate_size") or 0),
            n_routed_experts=int(config.get("n_routed_experts") or 0) if is_mla else 0,
            n_shared_experts=int(config.get("n_shared_experts") or 0) if is_mla else 0,
            first_k_dense_replace=int(config.get("first_k_dense_replace") or 0) if is_mla else 0,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias or arch == "Qwen2ForCausalLM",
            o_bias=attention_bias,
            mlp_bias=bool(config.get("mlp_bias")) and not is_mla,
            weight_bytes=sum(size for _, _, size in safetensors_entries(folder)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"{folder / 'config.json'}: missing or malformed field {exc}") from None
    return info

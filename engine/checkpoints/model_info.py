"""What the plan checks and the engine need to know about a checkpoint, read without torch.

`read_model_info` parses `config.json` (and the safetensors headers for the weight size) so
that `dcpctl plan validate` can apply the head and memory rules before anything is launched.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine.errors import UserError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "DeepseekV2ForCausalLM",
)
# Architectures `plan suggest` sizes by their shape (the engine does not run them): DeepSeek-V3 is DeepSeek-V2's MLA
# and MoE shape with more of each.
PLANNING_ARCHITECTURES = (*SUPPORTED_ARCHITECTURES, "DeepseekV3ForCausalLM")
_MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")

_DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
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
    experts_per_token: int = 0  # routed experts each token goes through (num_experts_per_tok)
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
        raise UserError(f"unknown dtype {name!r}; use one of float32, bfloat16, float16, fp8_e4m3, fp8_e5m2") from None


def safetensors_entries(folder: Path) -> list[tuple[str, str, int]]:
    """(name, dtype, bytes) of every tensor in a folder's safetensors files, read from their headers only."""
    return [entry for file in sorted(Path(folder).glob("*.safetensors")) for entry in safetensors_file_entries(file)]


_REFETCH = "the file is damaged: fetch or convert the checkpoint again"
_MAX_HEADER = 100_000_000  # the safetensors library's own limit


def safetensors_file_entries(file: Path) -> list[tuple[str, str, int]]:
    """(name, dtype, bytes) of every tensor in one safetensors file, checked against the file's size before
    anything is read: a UserError naming the file (`git lfs pull` for a Git LFS pointer) when it is not one."""
    size = file.stat().st_size
    with file.open("rb") as fh:
        head = fh.read(8)
        if head.startswith(b"version "):
            raise UserError(f"{file} is a Git LFS pointer, not the weights: run `git lfs pull` in the checkpoint repo")
        header_len = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 2 <= header_len <= min(size - 8, _MAX_HEADER):
            raise UserError(f"{file} is not a safetensors file (its header length does not fit the file); {_REFETCH}")
        raw = fh.read(header_len)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise UserError(f"{file} is not a safetensors file (its header is not JSON); {_REFETCH}") from None
    if not isinstance(header, dict):
        raise UserError(f"{file} is not a safetensors file (its header is not a JSON object); {_REFETCH}")
    entries, data_end = [], 0
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            start, end = (int(x) for x in meta["data_offsets"])
            entries.append((name, str(meta["dtype"]), end - start))
        except (KeyError, TypeError, ValueError):
            raise UserError(f"{file}: tensor {name!r} has a malformed header entry; {_REFETCH}") from None
        data_end = max(data_end, end)
    if data_end > size - 8 - header_len:
        raise UserError(f"{file} is truncated ({size} bytes, its header needs {data_end + 8 + header_len}); {_REFETCH}")
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


def architecture_of(config: dict, where: Path, supported: tuple[str, ...] = SUPPORTED_ARCHITECTURES) -> str:
    """The single supported architecture a config names, or a UserError listing the supported ones."""
    archs = config.get("architectures") or []
    arch = archs[0] if archs else ""
    if arch not in supported:
        raise UserError(
            f"{where}: unsupported architecture {arch or '(none given)'!r}; supported: {', '.join(supported)}"
        )
    return arch


def config_int(config: dict, key: str, where: Path, default: int | None = None, minimum: int = 1) -> int:
    """config[key] as a whole number >= minimum (`default` when absent or null); a UserError naming the field."""
    value = config.get(key)
    if value is None:
        if default is None:
            raise UserError(f"{where}: missing field {key!r}; the checkpoint's config.json must give it")
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserError(f"{where}: field {key!r} must be a whole number, not {value!r}")
    if value < minimum:
        raise UserError(f"{where}: field {key!r} is {value}; it must be at least {minimum}")
    return value


def read_model_info(folder: str | Path) -> ModelInfo:
    """Read a checkpoint folder's config.json (and weight sizes) into a ModelInfo."""
    folder = Path(folder)
    config = read_config(folder)
    arch = architecture_of(config, folder / "config.json")
    return model_info_from_config(config, folder, arch, lambda: sum(size for _, _, size in safetensors_entries(folder)))


def model_info_from_config(
    config: dict, folder: Path, arch: str, weight_bytes: Callable[[], int] = lambda: 0
) -> ModelInfo:
    """The ModelInfo of a parsed config.json whose architecture `arch` was checked; `weight_bytes` sizes the
    stored tensors (0: no weights, e.g. a bare config.json)."""
    where = folder / "config.json"
    is_mla = arch in _MLA_ARCHITECTURES

    def size(key: str, default: int | None = None, minimum: int = 1) -> int:
        return config_int(config, key, where, default, minimum)

    heads = size("num_attention_heads")
    hidden = size("hidden_size")
    return ModelInfo(
        path=folder,
        architecture=arch,
        num_layers=size("num_hidden_layers"),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=1 if is_mla else size("num_key_value_heads", heads),
        head_dim=size("head_dim", hidden // heads),
        vocab_size=size("vocab_size"),
        max_position_embeddings=size("max_position_embeddings", 2048),
        torch_dtype=str(config.get("torch_dtype") or config.get("dtype") or "float32"),
        is_mla=is_mla,
        kv_lora_rank=size("kv_lora_rank", minimum=1) if is_mla else 0,
        qk_rope_head_dim=size("qk_rope_head_dim", minimum=1) if is_mla else 0,
        qk_nope_head_dim=size("qk_nope_head_dim", 0, minimum=0) if is_mla else 0,
        v_head_dim=size("v_head_dim", minimum=1) if is_mla else 0,
        q_lora_rank=size("q_lora_rank", 0, minimum=0),
        intermediate_size=size("intermediate_size", 0, minimum=0),
        moe_intermediate_size=size("moe_intermediate_size", 0, minimum=0),
        n_routed_experts=size("n_routed_experts", 0, minimum=0) if is_mla else 0,
        n_shared_experts=size("n_shared_experts", 0, minimum=0) if is_mla else 0,
        experts_per_token=size("num_experts_per_tok", 0, minimum=0) if is_mla else 0,
        first_k_dense_replace=size("first_k_dense_replace", 0, minimum=0) if is_mla else 0,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=bool(config.get("attention_bias")) or arch == "Qwen2ForCausalLM",
        o_bias=bool(config.get("attention_bias")),
        mlp_bias=bool(config.get("mlp_bias")) and not is_mla,
        weight_bytes=weight_bytes(),
    )

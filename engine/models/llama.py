"""Llama-family decoder (Llama, Mistral, Qwen2) built from the paged, tensor-parallel layers."""

from __future__ import annotations

import re

import torch
from torch import nn

from engine.distributed import Shard, get_parallel
from engine.errors import UserError
from engine.layers.activation import silu_and_mul
from engine.layers.attention import PagedAttention
from engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from engine.layers.rotary import RotaryEmbedding
from engine.models.base import CausalLM, DecoderLayer


class LlamaAttention(nn.Module):
    def __init__(self, cfg, qkv_bias: bool):
        super().__init__()
        par = get_parallel()
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        role = par.role
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size,
            self.head_dim,
            par.placement.q_heads,
            range(role.kv_head_start, role.kv_head_start + role.kv_heads),
            bias=qkv_bias,
        )
        self.o_proj = RowParallelLinear(
            heads * self.head_dim,
            cfg.hidden_size,
            bias=bool(getattr(cfg, "attention_bias", False)),
            shard=par.shard(par.placement.o_proj),
        )
        self.attn = PagedAttention(
            self.qkv_proj.kv_local, self.head_dim, self.head_dim, self.head_dim**-0.5, heads // kv_heads
        )

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x).view(x.shape[0], -1, self.head_dim)
        return self.o_proj(self.attn.rotary_forward(qkv, rope, cos, sin))


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up merged; `reduce=False` leaves the TP sum to the caller."""

    def __init__(
        self, hidden: int, intermediate: int, bias: bool = False, reduce: bool = True, shard: Shard | None = None
    ):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate, intermediate], bias=bias, shard=shard)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=bias, reduce=reduce, shard=shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


# HF tensor name fragment -> (our merged parameter, shard id)
STACKED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_STACKED_NAME = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.")


def stacked_name(name: str, fragments: re.Pattern = _STACKED_NAME) -> tuple[str, object] | None:
    """Map e.g. '...mlp.gate_proj.weight' to ('...mlp.gate_up_proj.weight', 0); None if not stacked."""
    match = fragments.search(name)
    if not match:
        return None
    target, shard = STACKED[match.group(1)]
    return name.replace(f".{match.group(1)}.", f".{target}."), shard


class LlamaForCausalLM(CausalLM):
    """Llama, Mistral and Qwen2 (qkv bias) checkpoints."""

    def __init__(self, cfg, max_positions: int, device: torch.device):
        qkv_bias = cfg.model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False))
        window = getattr(cfg, "sliding_window", None)
        if window and getattr(cfg, "use_sliding_window", True) and window < max_positions:
            raise UserError(
                f"sliding-window attention ({window} tokens) is not supported; set model.max_model_len <= {window}"
            )
        if cfg.hidden_act != "silu":
            raise UserError(f"hidden_act {cfg.hidden_act!r} is not supported (only silu)")
        mlp_bias = bool(getattr(cfg, "mlp_bias", False))
        par = get_parallel()
        layers = [
            DecoderLayer(
                LlamaAttention(cfg, qkv_bias),
                GatedMLP(cfg.hidden_size, cfg.intermediate_size, mlp_bias, shard=par.shard(par.placement.mlp)),
                cfg.hidden_size,
                cfg.rms_norm_eps,
            )
            for _ in range(cfg.num_hidden_layers)
        ]
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        super().__init__(cfg, layers, RotaryEmbedding(cfg, head_dim, max_positions, interleaved=False, device=device))

    def checkpoint_name_map(self, name: str) -> tuple[str, object] | None:
        base = self.base_name_map(name)
        if base is None:
            return None
        return stacked_name(base[0]) or base

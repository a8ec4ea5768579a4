"""DeepSeek-V2: multi-head latent attention (MLA) with the absorbed decode form, and MoE with shared experts.

The KV cache holds one "head" per token: the normed latent (kv_lora_rank) followed by the roped
shared key (qk_rope_head_dim). Queries are projected into the latent space with W_UK (from
kv_b_proj), attend like multi-query attention with key dim rank+rope and value dim rank, and the
result is projected back with W_UV. This is exact, and makes the cache one head that TP
replicates on every rank, which is what DCP shards.
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn

from engine.checkpoints.weights import CheckpointTensor, copy_into
from engine.distributed import Shard, all_reduce, get_parallel
from engine.errors import UserError
from engine.layers.attention import PagedAttention
from engine.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, attach_loader
from engine.layers.moe import Experts, TopKRouter
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.models.base import CausalLM, DecoderLayer
from engine.models.llama import GatedMLP, stacked_name
from engine.placement.split import slice_of


def _softmax_scale(cfg) -> float:
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    mscale_all_dim = rope.get("mscale_all_dim") or 0
    if rope.get("rope_type", "default") != "default" and mscale_all_dim:
        factor = rope["factor"]
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= mscale * mscale
    return scale


class LatentProjections(nn.Module):
    """kv_b_proj as the absorbed form uses it: W_UK [q heads, nope, rank] of the heads whose queries this rank
    projects, then W_UV [out heads, v, rank] of the heads whose merged latent output it projects back."""

    def __init__(self, rank: int, nope: int, v_dim: int, q_heads: range, out_heads: range):
        super().__init__()
        self.nope, self.v_dim, self.q_heads, self.out_heads = nope, v_dim, q_heads, out_heads
        rows = len(q_heads) * nope + len(out_heads) * v_dim
        self.weight = attach_loader(nn.Parameter(torch.empty(rows, rank), requires_grad=False), self._load)

    def _load(self, param: nn.Parameter, tensor: CheckpointTensor, shard_id=None) -> None:
        per_head = self.nope + self.v_dim  # checkpoint rows: each head's nope rows, then its v rows
        for i, h in enumerate(self.q_heads):
            copy_into(
                param.data.narrow(0, i * self.nope, self.nope), tensor.narrow(0, h * per_head, self.nope), tensor.name
            )
        base = len(self.q_heads) * self.nope
        for i, h in enumerate(self.out_heads):
            copy_into(
                param.data.narrow(0, base + i * self.v_dim, self.v_dim),
                tensor.narrow(0, h * per_head + self.nope, self.v_dim),
                tensor.name,
            )

    def w_uk(self) -> torch.Tensor:
        return self.weight[: len(self.q_heads) * self.nope].view(len(self.q_heads), self.nope, -1)

    def w_uv(self) -> torch.Tensor:
        return self.weight[len(self.q_heads) * self.nope :].view(len(self.out_heads), self.v_dim, -1)


class MLAAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        par = get_parallel()
        share = par.placement
        heads = cfg.num_attention_heads
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.rank = cfg.kv_lora_rank
        bias = bool(getattr(cfg, "attention_bias", False))
        qk_dim = self.nope + self.rope_dim
        q_shard = Shard(slice_of(share.q_heads, heads), None)
        if cfg.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(cfg.hidden_size, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, heads * qk_dim, shard=q_shard)
        else:
            self.q_proj = ColumnParallelLinear(cfg.hidden_size, heads * qk_dim, shard=q_shard)
        self.kv_a_proj_with_mqa = ReplicatedLinear(cfg.hidden_size, self.rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, cfg.rms_norm_eps)
        out_heads = share.o_proj.span(heads)  # the heads whose latent the combine merges here
        self.kv_b_proj = LatentProjections(self.rank, self.nope, self.v_dim, share.q_heads, out_heads)
        self.o_proj = RowParallelLinear(heads * self.v_dim, cfg.hidden_size, bias=bias, shard=par.shard(share.o_proj))
        self.q_local, self.out_local = len(share.q_heads), len(out_heads)
        self.attn = PagedAttention(
            1, self.rank + self.rope_dim, self.rank, _softmax_scale(cfg), heads, value_in_key=True
        )
        self.q_lora = bool(cfg.q_lora_rank)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q_nope, q_pe = q.view(n, self.q_local, -1).split([self.nope, self.rope_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        q_pe = rope.apply(q_pe, cos, sin)
        k_pe = rope.apply(k_pe.reshape(n, 1, self.rope_dim), cos, sin)
        q_latent = torch.einsum("nhd,hdc->nhc", q_nope, self.kv_b_proj.w_uk())
        query = torch.cat([q_latent, q_pe], dim=-1)
        key = torch.cat([latent.view(n, 1, self.rank), k_pe], dim=-1)
        out_latent = self.attn(query, key, key[..., : self.rank]).view(n, self.out_local, self.rank)
        out = torch.einsum("nhc,hvc->nhv", out_latent, self.kv_b_proj.w_uv()).reshape(n, -1)
        return self.o_proj(out)


class DeepseekV2MoE(nn.Module):
    def __init__(self, cfg, shard: Shard):
        super().__init__()
        self.group = shard.group
        self.gate = TopKRouter(
            cfg.hidden_size,
            cfg.n_routed_experts,
            cfg.num_experts_per_tok,
            getattr(cfg, "topk_method", "greedy"),
            getattr(cfg, "n_group", 1) or 1,
            getattr(cfg, "topk_group", 1) or 1,
            float(getattr(cfg, "routed_scaling_factor", 1.0)),
        )
        self.experts = Experts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, shard)
        shared = cfg.n_shared_experts or 0
        self.shared_experts = (
            GatedMLP(cfg.hidden_size, cfg.moe_intermediate_size * shared, reduce=False, shard=shard) if shared else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return all_reduce(out, self.group)


_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED_EXPERTS = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")
_GATE_UP = re.compile(r"\.(gate_proj|up_proj)\.")  # MLA's q_proj is a plain projection, not a stacked qkv


class DeepseekV2ForCausalLM(CausalLM):
    def __init__(self, cfg, max_positions: int, device: torch.device):
        if cfg.hidden_act != "silu":
            raise UserError(f"hidden_act {cfg.hidden_act!r} is not supported (only silu)")
        first_dense = getattr(cfg, "first_k_dense_replace", 0) or 0
        moe = bool(getattr(cfg, "n_routed_experts", 0))
        par = get_parallel()
        layers = []
        for i in range(cfg.num_hidden_layers):
            if moe and i >= first_dense:
                mlp = DeepseekV2MoE(cfg, par.shard(par.placement.moe))
            else:
                mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, shard=par.shard(par.placement.mlp))
            layers.append(DecoderLayer(MLAAttention(cfg), mlp, cfg.hidden_size, cfg.rms_norm_eps))
        rope = RotaryEmbedding(cfg, cfg.qk_rope_head_dim, max_positions, interleaved=True, device=device)
        super().__init__(cfg, layers, rope)

    def checkpoint_name_map(self, name: str) -> tuple[str, object] | None:
        base = self.base_name_map(name)
        if base is None:
            return None
        name = base[0]
        match = _EXPERT.search(name)
        if match:
            expert, proj = int(match.group(1)), match.group(2)
            prefix = name[: match.start()] + ".mlp.experts."
            if proj == "down_proj":
                return prefix + "w2", expert
            return prefix + "w13", (expert, 0 if proj == "gate_proj" else 1)
        match = _FUSED_EXPERTS.search(name)
        if match:
            prefix = name[: match.start()] + ".mlp.experts."
            return prefix + ("w13" if match.group(1) == "gate_up_proj" else "w2"), "fused"
        return stacked_name(name, _GATE_UP) or base

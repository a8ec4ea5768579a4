"""The shapes one decode step of a model runs at (its linear layers and attention on one rank), and the tiny
checkpoint of its architecture, depth and heads whose step is all host work: what `decode_timing` times."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from engine.checkpoints.model_info import ModelInfo

TINY_MAX_EXPERTS = 64
TINY_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v2",
}


@dataclass(frozen=True)
class LinearShape:
    """One kind of linear layer: an [out, in] weight used `count` times per decode step."""

    out_features: int
    in_features: int
    count: int

    @property
    def elements(self) -> int:
        return self.out_features * self.in_features


@dataclass(frozen=True)
class DecodeShapes:
    """The shapes a decode step of a model runs at (one rank holding the whole model)."""

    linears: tuple[LinearShape, ...]
    heads: int  # query heads attending
    kv_heads: int
    key_dim: int
    value_dim: int
    value_in_key: bool  # MLA: values are the first value_dim dims of the (latent) keys
    tiny_arch: str  # the host timing's checkpoint (engine.checkpoints.tiny): architecture and sizes
    tiny_sizes: dict

    @property
    def key(self) -> str:
        """What the cached figures of these shapes are filed under."""
        linears = ",".join(f"{s.out_features}x{s.in_features}x{s.count}" for s in self.linears)
        attention = f"{self.heads}/{self.kv_heads}x{self.key_dim}/{self.value_dim}{'m' if self.value_in_key else ''}"
        tiny = ",".join(f"{k}={v}" for k, v in sorted(self.tiny_sizes.items()))
        return f"{linears};{attention};{self.tiny_arch}:{tiny}"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> DecodeShapes:
        return cls(**{**data, "linears": tuple(LinearShape(**s) for s in data["linears"])})


def decode_shapes(model: ModelInfo) -> DecodeShapes:
    """The linear layers and attention of one decode step of `model` on one rank (tp 1, dcp 1)."""
    hidden, layers, heads = model.hidden_size, model.num_layers, model.num_heads
    if model.is_mla:
        qk = model.qk_nope_head_dim + model.qk_rope_head_dim
        latent = model.kv_lora_rank + model.qk_rope_head_dim
        if model.q_lora_rank:
            q = [LinearShape(model.q_lora_rank, hidden, layers), LinearShape(heads * qk, model.q_lora_rank, layers)]
        else:
            q = [LinearShape(heads * qk, hidden, layers)]
        kv_b = heads * (model.qk_nope_head_dim + model.v_head_dim)
        attention = [*q, LinearShape(latent, hidden, layers), LinearShape(kv_b, model.kv_lora_rank, layers)]
        attention.append(LinearShape(hidden, heads * model.v_head_dim, layers))
        kv_heads, key_dim, value_dim = 1, latent, model.kv_lora_rank
    else:
        d = model.head_dim
        attention = [LinearShape((heads + 2 * model.num_kv_heads) * d, hidden, layers)]
        attention.append(LinearShape(hidden, heads * d, layers))
        kv_heads, key_dim, value_dim = model.num_kv_heads, d, d
    moe_layers = layers - model.first_k_dense_replace if model.n_routed_experts else 0
    mlp = []
    if layers - moe_layers:
        mlp += [LinearShape(2 * model.intermediate_size, hidden, layers - moe_layers)]
        mlp += [LinearShape(hidden, model.intermediate_size, layers - moe_layers)]
    if moe_layers:  # the experts each token runs (routed and shared), as one expert's projections
        experts = moe_layers * (model.experts_per_token + model.n_shared_experts)
        mlp += [LinearShape(2 * model.moe_intermediate_size, hidden, experts)]
        mlp += [LinearShape(hidden, model.moe_intermediate_size, experts)]
    lm_head = LinearShape(model.vocab_size, hidden, 1)
    arch, sizes = tiny_like(model)
    return DecodeShapes((*attention, *mlp, lm_head), heads, kv_heads, key_dim, value_dim, model.is_mla, arch, sizes)


def tiny_like(model: ModelInfo) -> tuple[str, dict]:
    """A tiny checkpoint's architecture and sizes with the model's depth, heads and kind of layers (MLA, MoE) and
    widths that make its matmuls and attention negligible: what the host timing runs."""
    # transformers wants the hidden size a multiple of the heads
    sizes = {"num_layers": model.num_layers, "num_heads": model.num_heads, "tie_word_embeddings": False}
    arch = TINY_ARCHS[model.architecture]
    if arch == "deepseek_v2":
        sizes["hidden_size"] = model.num_heads
        # a step runs at most rows x experts_per_token routed experts: more experts add weights, not host work
        experts = min(model.n_routed_experts, TINY_MAX_EXPERTS)
        sizes.update(n_routed_experts=experts, n_shared_experts=model.n_shared_experts)
        sizes.update(
            num_experts_per_tok=model.experts_per_token or 1, first_k_dense_replace=model.first_k_dense_replace
        )
        sizes.update(q_lora_rank=8 if model.q_lora_rank else None, moe_intermediate_size=8)
    else:
        sizes.update(hidden_size=8 * model.num_heads, num_kv_heads=model.num_kv_heads, head_dim=8)
    return arch, sizes

"""Shipped config facts: config.json fields of well-known models (no weights), copied from each model's public
config.json on the Hugging Face hub (the repo id is given with each). `plan suggest` plans a GPU cluster from them on
a laptop; `dcpctl model random` writes checkpoints of their shapes with random weights.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.checkpoints.aliases import is_alias

_DEEPSEEK_V2_LITE = {  # https://huggingface.co/deepseek-ai/DeepSeek-V2-Lite/blob/main/config.json
    "architectures": ["DeepseekV2ForCausalLM"],
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "moe_intermediate_size": 1408,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "num_experts_per_tok": 6,
    "first_k_dense_replace": 1,
    "num_attention_heads": 16,
    "num_hidden_layers": 27,
    "num_key_value_heads": 16,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "vocab_size": 102400,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "torch_dtype": "bfloat16",
}
_DEEPSEEK_V3 = {  # https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json (weights ship in fp8)
    "architectures": ["DeepseekV3ForCausalLM"],
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "num_attention_heads": 128,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "vocab_size": 129280,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "torch_dtype": "bfloat16",
}
_QWEN25_7B = {  # https://huggingface.co/Qwen/Qwen2.5-7B-Instruct/blob/main/config.json
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "max_position_embeddings": 32768,
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
_LLAMA31_8B = {  # https://huggingface.co/meta-llama/Llama-3.1-8B-Instruct/blob/main/config.json
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "torch_dtype": "bfloat16",
}
_LLAMA31_70B = {  # https://huggingface.co/meta-llama/Llama-3.1-70B-Instruct/blob/main/config.json
    **_LLAMA31_8B,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_hidden_layers": 80,
}
_SMOLLM2_135M = {  # https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct/blob/main/config.json
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 576,
    "intermediate_size": 1536,
    "max_position_embeddings": 8192,
    "num_attention_heads": 9,
    "num_hidden_layers": 30,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "mlp_bias": False,
    "torch_dtype": "bfloat16",
}


@dataclass(frozen=True)
class ShippedModel:
    """A model's config.json facts shipped with dcpctl, and the name a plan's model.path takes for it."""

    name: str
    repo_id: str
    config: dict

    @property
    def plan_path(self) -> str:
        """model.path for its plans: our alias where one exists (`dcpctl model pull` knows it), else the hub id."""
        return self.name if is_alias(self.name) else self.repo_id


SHIPPED: dict[str, ShippedModel] = {
    m.name: m
    for m in (
        ShippedModel("deepseek-v2-lite", "deepseek-ai/DeepSeek-V2-Lite", _DEEPSEEK_V2_LITE),
        ShippedModel("deepseek-v3", "deepseek-ai/DeepSeek-V3", _DEEPSEEK_V3),
        ShippedModel("qwen2.5-7b-instruct", "Qwen/Qwen2.5-7B-Instruct", _QWEN25_7B),
        ShippedModel("llama-3.1-8b-instruct", "meta-llama/Llama-3.1-8B-Instruct", _LLAMA31_8B),
        ShippedModel("llama-3.1-70b-instruct", "meta-llama/Llama-3.1-70B-Instruct", _LLAMA31_70B),
        ShippedModel("smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", _SMOLLM2_135M),
    )
}

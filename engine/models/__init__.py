"""Model architectures the engine implements, by the name config.json gives them."""

from __future__ import annotations

import torch
from torch import nn

from engine.checkpoints.model_info import SUPPORTED_ARCHITECTURES
from engine.errors import UserError


def _classes() -> dict[str, type[nn.Module]]:
    from engine.models.deepseek_v2 import DeepseekV2ForCausalLM
    from engine.models.llama import LlamaForCausalLM

    return {
        "LlamaForCausalLM": LlamaForCausalLM,
        "MistralForCausalLM": LlamaForCausalLM,
        "Qwen2ForCausalLM": LlamaForCausalLM,
        "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    }


def build_model(hf_config, max_model_len: int, device: torch.device) -> nn.Module:
    """Instantiate the engine's own implementation of the checkpoint's architecture."""
    arch = (getattr(hf_config, "architectures", None) or [""])[0]
    classes = _classes()
    if arch not in classes:
        raise UserError(f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return classes[arch](hf_config, max_model_len, device)

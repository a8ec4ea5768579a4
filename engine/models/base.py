"""What every decoder-only model shares: pre-norm residual blocks, embedding, final norm, LM head."""

from __future__ import annotations

import torch
from torch import nn

from engine.distributed import get_parallel
from engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding


class DecoderLayer(nn.Module):
    """x -> x + attn(norm(x)) -> x + mlp(norm(x)), with the residual carried fused into the norms."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, hidden: int, eps: float):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(self, x, residual, rope, cos, sin):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope, cos, sin)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class CausalLM(nn.Module):
    """Embedding, decoder layers, final norm and a vocab-parallel LM head over flattened step tokens."""

    def __init__(self, cfg, layers: list[nn.Module], rope: RotaryEmbedding):
        super().__init__()
        par = get_parallel()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, par.shard(par.placement.vocab))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(self.embed_tokens, tied=self.tied)
        self.rope = rope

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Final hidden states [N, hidden] of one step's tokens."""
        cos, sin = self.rope.lookup(positions)
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, self.rope, cos, sin)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """fp32 logits of the given rows on rank 0 (None on other ranks)."""
        return self.lm_head(hidden)

    def base_name_map(self, name: str) -> tuple[str, object] | None:
        """Shared checkpoint names: drop 'model.', skip rotary buffers and a tied LM head."""
        if "rotary_emb" in name or (self.tied and name == "lm_head.weight"):
            return None
        return name.removeprefix("model."), None


def inline_module_attributes(model: nn.Module) -> None:
    """Make every submodule and parameter of a loaded model a plain instance attribute.

    nn.Module finds them through `__getattr__`, ~1 µs per read; a decode step reads ~20 per layer,
    which at batch 1 on CPU is a few percent of the step (benchmarks/RESULTS.md). Assigning a new
    parameter or submodule later still works: `nn.Module.__setattr__` drops the plain entry first.
    """
    for module in model.modules():
        module.__dict__.update(module._parameters)
        module.__dict__.update(module._modules)

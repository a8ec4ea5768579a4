"""What every decoder-only model shares: pre-norm residual blocks, embedding, final norm, LM head."""

from __future__ import annotations

import functools

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
        return self.feed_forward(*self.attend(x, residual, rope, cos, sin))

    def attend(self, x, residual, rope, cos, sin):
        """The layer's first half: (attn(norm(x)), residual), every token's K and V written to the cache."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        return self.self_attn(x, rope, cos, sin), residual

    def feed_forward(self, x, residual):
        """The layer's second half: (mlp(norm(x + residual)), x + residual)."""
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

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Final hidden states [N, hidden] of one step's tokens, or [len(rows), hidden] of the given rows only.

        With `rows` (the positions whose logits are read: a prompt chunk's last token, not the ~1000 before it) the
        last layer's MLP and the final norm run on those rows alone; every layer still writes every token's K and V.
        """
        cos, sin = self.rope.lookup(positions)
        x, residual = self.embed_tokens(input_ids), None
        *layers, last = self.layers
        for layer in layers:
            x, residual = layer(x, residual, self.rope, cos, sin)
        x, residual = last.attend(x, residual, self.rope, cos, sin)
        if rows is not None:
            x, residual = x[rows], residual[rows]
            if not len(rows):  # a step of prompt chunks that end no prompt: nothing to read
                return x
        x, _ = self.norm(*last.feed_forward(x, residual))
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """fp32 logits of the given rows on rank 0 (None on other ranks)."""
        return self.lm_head(hidden)

    def base_name_map(self, name: str) -> tuple[str, object] | None:
        """Shared checkpoint names: drop 'model.', skip rotary buffers and a tied LM head."""
        if "rotary_emb" in name or (self.tied and name == "lm_head.weight"):
            return None
        return name.removeprefix("model."), None


def streamline_modules(model: nn.Module) -> None:
    """Take the hot path's per-call Python out of a loaded model's module calls; the layers compute the same.

    - Every submodule and parameter becomes a plain instance attribute: nn.Module finds them through `__getattr__`,
      ~1 µs per read, and a decode step reads ~20 per layer. Assigning a new parameter or submodule later still
      works: `nn.Module.__setattr__` drops the plain entry first.
    - Calling a module runs its `forward` directly: nn.Module.__call__'s hook and tracing checks cost ~1 µs a call
      and a decode step makes ~10 calls per layer, ~0.3 ms of a 30-layer step (docs/results/cpu-kernels.md). The engine
      registers no hooks; a hook registered on a streamlined module is refused (`register_forward_hook` and the
      other hook registrations raise) rather than silently skipped.
    """
    for module in model.modules():
        module.__dict__.update(module._parameters)
        module.__dict__.update(module._modules)
        module.__class__ = _direct_call_class(type(module))


@functools.cache
def _direct_call_class(cls: type[nn.Module]) -> type[nn.Module]:
    """`cls` with calls going straight to `forward` (same name and module; hook registration refused)."""
    if getattr(cls, "_direct_call", False):
        return cls
    members = {"__call__": _call_forward, "_direct_call": True, "__module__": cls.__module__}
    members |= {name: _refuse_hook for name in _HOOK_REGISTRATIONS}
    return type(cls.__name__, (cls,), members | {"__qualname__": cls.__qualname__})


def _call_forward(self: nn.Module, *args, **kwargs):
    return self.forward(*args, **kwargs)


_HOOK_REGISTRATIONS = (
    "register_forward_hook",
    "register_forward_pre_hook",
    "register_full_backward_hook",
    "register_full_backward_pre_hook",
    "register_backward_hook",
)


def _refuse_hook(self: nn.Module, *args, **kwargs):
    raise RuntimeError(f"{type(self).__name__}: the engine's modules call forward directly and run no hooks")

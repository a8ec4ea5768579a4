"""Rotary position embeddings: cos/sin tables from the HF rope parameters, looked up once per step."""

from __future__ import annotations

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.errors import UserError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class RotaryEmbedding:
    """cos/sin for every position up to `max_positions`, in fp32.

    `interleaved=False`: halves are rotated (Llama, "neox" style); `interleaved=True`: adjacent pairs
    are rotated (DeepSeek-V2 as HF implements it). HF's attention scaling factor (yarn) multiplies both.
    """

    def __init__(self, hf_config, rotary_dim: int, max_positions: int, interleaved: bool, device: torch.device):
        params = dict(getattr(hf_config, "rope_parameters", None) or {})
        rope_type = params.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UserError(f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        if rope_type == "default":
            theta = float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
            inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
            scale = 1.0
        else:
            inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
        # fp32 throughout, as HF computes it, so positions far out round the same way
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq.float())
        self.cos = (freqs.cos() * scale).to(device)
        self.sin = (freqs.sin() * scale).to(device)
        self.interleaved = interleaved

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [tokens, 1, rotary_dim / 2] (broadcast over heads)."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x of shape [tokens, heads, rotary_dim]."""
        xf = x.float()
        if self.interleaved:
            even, odd = xf[..., 0::2], xf[..., 1::2]
            out = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
        else:
            half = xf.shape[-1] // 2
            x1, x2 = xf[..., :half], xf[..., half:]
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return out.to(x.dtype)

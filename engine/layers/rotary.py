"""Rotary position embeddings: cos/sin tables from the HF rope parameters, looked up once per step."""

from __future__ import annotations

import torch

from engine.checkpoints.config_values import SUPPORTED_ROPE_TYPES, rope_init, rope_type
from engine.errors import UserError
from engine.kernels.cpu_kernels import KERNEL_DTYPES, cpu_kernels_available


class RotaryEmbedding:
    """cos/sin for every position up to `max_positions`, in fp32.

    `interleaved=False`: halves are rotated (Llama, "neox" style); `interleaved=True`: adjacent pairs
    are rotated (DeepSeek-V2 as HF implements it). HF's attention scaling factor (yarn) multiplies both.
    """

    def __init__(self, hf_config, rotary_dim: int, max_positions: int, interleaved: bool, device: torch.device):
        params = dict(getattr(hf_config, "rope_parameters", None) or {})
        kind = rope_type(hf_config)
        if kind not in SUPPORTED_ROPE_TYPES:
            raise UserError(f"rope type {kind!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        # Built on CPU whatever the default device (the model is built under `with torch.device(cuda)`; HF's yarn
        # frequencies are CPU tensors), in fp32 as HF computes them, then moved to `device`
        with torch.device("cpu"):
            cos, sin = _tables(hf_config, params, kind, rotary_dim, max_positions, interleaved)
        self.cos, self.sin = cos.to(device), sin.to(device)
        self.interleaved = interleaved

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin of shape [tokens, 1, rotary_dim] (broadcast over heads), once per step."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x of shape [tokens, heads, rotary_dim] in fp32 (the CPU kernel gives the same bits)."""
        if x.is_cpu and x.dtype in KERNEL_DTYPES and x.stride(-1) == 1 and cpu_kernels_available():
            return torch.ops.dcpctl.rotary(x, cos, sin, self.interleaved)
        return self.apply_torch(x, cos, sin)

    def apply_torch(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`apply` in torch ops (CUDA, and CPU without the engine's kernels)."""
        xf = x.float()
        if self.interleaved:  # each adjacent pair (even, odd) rotates together
            partner = xf.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
        else:  # dim i rotates with dim i + rotary_dim / 2
            partner = xf.roll(xf.shape[-1] // 2, dims=-1)
        return (xf * cos + partner * sin).to(x.dtype)


def _tables(
    hf_config, params: dict, kind: str, rotary_dim: int, max_positions: int, interleaved: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-width cos and signed sin tables [max_positions, rotary_dim] on the default device."""
    if kind == "default":
        theta = float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
        scale = 1.0
    else:
        inv_freq, scale = rope_init(hf_config, kind)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq.float())
    cos, sin = freqs.cos() * scale, freqs.sin() * scale
    # Full-width tables so that apply() is x * cos + partner(x) * sin: the sign of each pair's
    # rotation is folded into `sin` (HF's rotate_half negates the partner instead; same bits)
    if interleaved:
        return cos.repeat_interleave(2, dim=-1), torch.stack((-sin, sin), dim=-1).flatten(-2)
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)

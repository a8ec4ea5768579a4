"""Mixture-of-experts: a replicated fp32 router and experts split on their intermediate dim over a shard's ranks (the
TP group, or the whole world with the sharded dense placement). On CUDA the routed experts run as two Triton grouped
GEMMs (engine.layers.fused_moe); on CPU one expert at a time."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.checkpoints.weights import CheckpointTensor, copy_into
from engine.distributed import Shard, get_parallel
from engine.layers.activation import silu_and_mul
from engine.layers.fused_moe import fused_experts
from engine.layers.linear import attach_loader


class TopKRouter(nn.Module):
    """Softmax over experts in fp32, then greedy or group-limited top-k, scaled by `routed_scaling_factor`."""

    def __init__(
        self, hidden: int, num_experts: int, top_k: int, method: str, num_groups: int, top_groups: int, scaling: float
    ):
        super().__init__()
        self.weight = attach_loader(
            nn.Parameter(torch.empty(num_experts, hidden, dtype=torch.float32), requires_grad=False), self._load
        )
        self.top_k, self.method = top_k, method
        self.num_groups, self.top_groups, self.scaling = num_groups, top_groups, scaling

    def _load(self, param, tensor: CheckpointTensor, shard_id=None) -> None:
        copy_into(param, tensor.load(), tensor.name)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(x.float(), self.weight).softmax(dim=-1)
        if self.method == "group_limited_greedy":
            grouped = scores.view(scores.shape[0], self.num_groups, -1)
            keep = grouped.max(dim=-1).values.topk(self.top_groups, dim=-1).indices
            mask = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=x.device).scatter_(1, keep, True)
            scores = scores.masked_fill(~mask.repeat_interleave(grouped.shape[-1], dim=1), 0.0)
        weights, ids = scores.topk(self.top_k, dim=-1)
        return weights * self.scaling, ids


class Experts(nn.Module):
    """All experts' gate/up [E, 2 * I/parts, H] and down [E, H, I/parts] weights; partial (un-reduced) output."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, shard: Shard | None = None):
        super().__init__()
        shard = shard or get_parallel().tp_shard
        self.parts, self.index = shard.parts, shard.index
        self.local = intermediate // self.parts
        self.w13 = attach_loader(
            nn.Parameter(torch.empty(num_experts, 2 * self.local, hidden), requires_grad=False), self._load_w13
        )
        self.w2 = attach_loader(
            nn.Parameter(torch.empty(num_experts, hidden, self.local), requires_grad=False), self._load_w2
        )

    def _load_w13(self, param, tensor: CheckpointTensor, shard_id) -> None:
        if shard_id == "fused":  # HF in-memory layout [E, 2I, H], gate rows first
            rows = tensor.shape[1] // 2
            for half in (0, 1):
                copy_into(
                    param.data[:, half * self.local : (half + 1) * self.local],
                    tensor.narrow(1, half * rows + self.index * self.local, self.local),
                    tensor.name,
                )
            return
        expert, half = shard_id
        copy_into(
            param.data[expert, half * self.local : (half + 1) * self.local],
            tensor.chunk(0, self.parts, self.index),
            tensor.name,
        )

    def _load_w2(self, param, tensor: CheckpointTensor, shard_id) -> None:
        if shard_id == "fused":
            copy_into(param, tensor.chunk(2, self.parts, self.index), tensor.name)
            return
        copy_into(param.data[shard_id], tensor.chunk(1, self.parts, self.index), tensor.name)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:  # two grouped GEMMs, no host sync (a CUDA graph can hold them)
            return fused_experts(x, self.w13, self.w2, weights, ids)
        return experts_loop(x, self.w13, self.w2, weights, ids)


def experts_loop(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """The routed experts one at a time from Python (the CPU path, and the reference of `fused_experts`): each
    expert's tokens through its gated MLP, scaled by their routing weights, summed into their rows."""
    out = torch.zeros_like(x)
    for expert in ids.unique().tolist():
        token, slot = (ids == expert).nonzero(as_tuple=True)
        hidden = silu_and_mul(F.linear(x[token], w13[expert]))
        y = F.linear(hidden, w2[expert]) * weights[token, slot].unsqueeze(1).to(x.dtype)
        out.index_add_(0, token, y)
    return out

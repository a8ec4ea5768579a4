"""Tensor-parallel linear layers. Each parameter carries a loader that copies its slice of a checkpoint tensor.

Column-parallel layers split output features over a shard's ranks (no communication); row-parallel
layers split input features and all-reduce their partial outputs (bias added once, after). The shard
comes from the plan's dense placement (the TP group unless the layer is split over the whole world).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.checkpoints.weights import CheckpointTensor, copy_into
from engine.distributed import Shard, all_reduce, get_parallel
from engine.kernels.cpu_gemm import PackableLinear


def attach_loader(param: nn.Parameter, loader) -> nn.Parameter:
    """Give a parameter its checkpoint loader: `loader(param, tensor, shard_id)`."""
    param.weight_loader = loader
    return param


def full_loader(param: nn.Parameter, tensor: CheckpointTensor, shard_id=None) -> None:
    copy_into(param, tensor.load(), tensor.name)


def _param(*shape: int, loader=full_loader) -> nn.Parameter:
    return attach_loader(nn.Parameter(torch.empty(*shape), requires_grad=False), loader)


class ReplicatedLinear(PackableLinear):
    """A linear layer every rank holds whole."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = _param(out_features, in_features)
        self.bias = _param(out_features) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x, self.bias)


class ColumnParallelLinear(PackableLinear):
    """Output features split over a shard's ranks (default: the TP group); the output stays sharded."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, shard: Shard | None = None):
        super().__init__()
        self.shard = shard or get_parallel().tp_shard
        if out_features % self.shard.parts:
            raise ValueError(f"{out_features} output features do not split {self.shard.parts} ways")
        self.out_local = out_features // self.shard.parts
        self.weight = _param(self.out_local, in_features, loader=self._load)
        self.bias = _param(self.out_local, loader=self._load) if bias else None

    def _load(self, param: nn.Parameter, tensor: CheckpointTensor, shard_id=None) -> None:
        copy_into(param, tensor.chunk(0, self.shard.parts, self.shard.index), tensor.name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (e.g. gate and up)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False, shard: Shard | None = None):
        self.out_sizes = out_sizes
        super().__init__(in_features, sum(out_sizes), bias, shard)

    def _load(self, param: nn.Parameter, tensor: CheckpointTensor, shard_id=None) -> None:
        parts, index = self.shard.parts, self.shard.index
        local = [size // parts for size in self.out_sizes]
        offset = sum(local[:shard_id])
        copy_into(param.data.narrow(0, offset, local[shard_id]), tensor.chunk(0, parts, index), tensor.name)


class QKVParallelLinear(PackableLinear):
    """Merged q, k, v projections of the query heads `q_heads` and the KV heads `kv_heads` (global head ids)."""

    def __init__(self, hidden: int, head_dim: int, q_heads: range, kv_heads: range, bias: bool = False):
        super().__init__()
        self.head_dim, self.q_heads, self.kv_heads = head_dim, q_heads, kv_heads
        self.q_local, self.kv_local = len(q_heads), len(kv_heads)
        rows = (self.q_local + 2 * self.kv_local) * head_dim
        self.weight = _param(rows, hidden, loader=self._load)
        self.bias = _param(rows, loader=self._load) if bias else None

    def _load(self, param: nn.Parameter, tensor: CheckpointTensor, shard_id=None) -> None:
        d = self.head_dim
        if shard_id == "q":
            dest, src = (0, self.q_local * d), (self.q_heads.start * d, self.q_local * d)
        else:
            offset = (self.q_local + (self.kv_local if shard_id == "v" else 0)) * d
            dest, src = (offset, self.kv_local * d), (self.kv_heads.start * d, self.kv_local * d)
        copy_into(param.data.narrow(0, *dest), tensor.narrow(0, *src), tensor.name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x, self.bias)


class RowParallelLinear(PackableLinear):
    """Input features split over a shard's ranks (default: the TP group); partial outputs are summed over its group."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, reduce: bool = True, shard: Shard | None = None
    ):
        super().__init__()
        self.shard = shard or get_parallel().tp_shard
        if in_features % self.shard.parts:
            raise ValueError(f"{in_features} input features do not split {self.shard.parts} ways")
        self.reduce = reduce
        self.weight = _param(out_features, in_features // self.shard.parts, loader=self._load)
        self.bias = _param(out_features) if bias else None

    def _load(self, param: nn.Parameter, tensor: CheckpointTensor, shard_id=None) -> None:
        copy_into(param, tensor.chunk(1, self.shard.parts, self.shard.index), tensor.name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.project(x)
        if self.reduce:
            all_reduce(y, self.shard.group)
        return y if self.bias is None else y + self.bias

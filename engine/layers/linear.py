"""Tensor-parallel linear layers. Each parameter carries a loader that copies its slice of a checkpoint tensor.

Column-parallel layers split output features over the TP group (no communication); row-parallel
layers split input features and all-reduce their partial outputs (bias added once, after).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.checkpoints.weights import CheckpointTensor, copy_into
from engine.distributed import all_reduce, get_parallel
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
    """Output features split over TP ranks; the output stays sharded."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        par = get_parallel()
        self.tp_size, self.tp_rank = par.tp_size, par.tp_rank
        if out_features % self.tp_size:
            raise ValueError(f"{out_features} output features do not split over tp={self.tp_size}")
        self.out_local = out_features // self.tp_size
        self.weight = _param(self.out_local, in_features, loader=self._load)
        self.bias = _param(self.out_local, loader=self._load) if bias else None

    def _load(self, param: nn.Parameter, tensor: CheckpointTensor, shard_id=None) -> None:
        copy_into(param, tensor.chunk(0, self.tp_size, self.tp_rank), tensor.name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (e.g. gate and up)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False):
        self.out_sizes = out_sizes
        super().__init__(in_features, sum(out_sizes), bias)

    def _load(self, param: nn.Parameter, tensor: CheckpointTensor, shard_id=None) -> None:
        local = [size // self.tp_size for size in self.out_sizes]
        offset = sum(local[:shard_id])
        copy_into(
            param.data.narrow(0, offset, local[shard_id]), tensor.chunk(0, self.tp_size, self.tp_rank), tensor.name
        )


class QKVParallelLinear(ColumnParallelLinear):
    """Merged q, k, v projections: query heads split over TP, KV heads split or replicated."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        par = get_parallel()
        self.head_dim = head_dim
        self.q_local = num_heads // par.tp_size
        self.kv_local = par.role.kv_heads
        self.kv_start = par.role.kv_head_start
        total = (self.q_local + 2 * self.kv_local) * head_dim * par.tp_size
        super().__init__(hidden, total, bias)

    def _load(self, param: nn.Parameter, tensor: CheckpointTensor, shard_id=None) -> None:
        d = self.head_dim
        if shard_id == "q":
            dest, src = (0, self.q_local * d), (self.tp_rank * self.q_local * d, self.q_local * d)
        else:
            offset = (self.q_local + (self.kv_local if shard_id == "v" else 0)) * d
            dest, src = (offset, self.kv_local * d), (self.kv_start * d, self.kv_local * d)
        copy_into(param.data.narrow(0, *dest), tensor.narrow(0, *src), tensor.name)


class RowParallelLinear(PackableLinear):
    """Input features split over TP ranks; partial outputs are summed over the TP group."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, reduce: bool = True):
        super().__init__()
        par = get_parallel()
        self.tp_size, self.tp_rank, self.group = par.tp_size, par.tp_rank, par.tp_group
        if in_features % self.tp_size:
            raise ValueError(f"{in_features} input features do not split over tp={self.tp_size}")
        self.reduce = reduce
        self.weight = _param(out_features, in_features // self.tp_size, loader=self._load)
        self.bias = _param(out_features) if bias else None

    def _load(self, param: nn.Parameter, tensor: CheckpointTensor, shard_id=None) -> None:
        copy_into(param, tensor.chunk(1, self.tp_size, self.tp_rank), tensor.name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.project(x)
        if self.reduce:
            all_reduce(y, self.group)
        return y if self.bias is None else y + self.bias

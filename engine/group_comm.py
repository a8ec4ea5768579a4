"""The tensor collectives of one process group, through torch.distributed (gloo on CPU, NCCL on CUDA).

`engine.distributed` calls a group's collectives through this interface; `engine.shm_comm.ShmGroup` implements
it again over shared memory for CPU ranks on one node, and falls back to these methods for what it does not cover.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class GroupComm:
    """A process group's tensor collectives (every rank of the group calls each one, in the same order)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.rank = dist.get_group_rank(group, dist.get_rank())
        self.size = dist.get_world_size(group)

    def all_reduce(self, x: torch.Tensor) -> None:
        """Sum over the group, in place."""
        dist.all_reduce(x, group=self.group)

    def all_gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x concatenated along dim 0, in group-rank order."""
        out = x.new_empty((self.size * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=self.group)
        return out

    def reduce_scatter_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the group of dim-0 chunk `rank` of x."""
        out = x.new_empty((x.shape[0] // self.size, *x.shape[1:]))
        dist.reduce_scatter_tensor(out, x.contiguous(), group=self.group)
        return out

    def all_to_all_rows(self, x: torch.Tensor) -> torch.Tensor:
        """all_to_all_single with equal splits: dim-0 chunk j of x goes to rank j; chunk j of the result came
        from rank j."""
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        dist.all_to_all_single(out, x.contiguous(), group=self.group)
        return out

    def gather_to_first(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's x on the group's first rank (None on the others)."""
        first = dist.get_global_rank(self.group, 0)
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x.contiguous(), parts, dst=first, group=self.group)
        return parts

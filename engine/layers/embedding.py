"""Vocab-parallel token embedding and LM head: each rank of the vocabulary's shard (the TP group, or the whole world
with the sharded dense placement) holds a contiguous slice of the vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.checkpoints.weights import CheckpointTensor, copy_into
from engine.distributed import Shard, all_reduce, gather_to_first, get_parallel
from engine.kernels.cpu_gemm import PackableLinear
from engine.layers.linear import attach_loader


class VocabParallelEmbedding(nn.Module):
    """Rows [start, end) of the embedding on this rank (the last shard padded with zeros)."""

    def __init__(self, vocab_size: int, hidden: int, shard: Shard | None = None):
        super().__init__()
        shard = shard or get_parallel().tp_shard
        self.vocab_size = vocab_size
        self.parts, self.group = shard.parts, shard.group
        self.per_rank, rows = shard.split.padded(vocab_size)
        self.start, self.end = rows.start, rows.stop
        self.weight = attach_loader(nn.Parameter(torch.empty(self.per_rank, hidden), requires_grad=False), self._load)

    def _load(self, param: nn.Parameter, tensor: CheckpointTensor, shard_id=None) -> None:
        param.data.zero_()
        rows = self.end - self.start
        copy_into(param.data.narrow(0, 0, rows), tensor.narrow(0, self.start, rows), tensor.name)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.parts == 1:
            return F.embedding(ids, self.weight)
        inside = (ids >= self.start) & (ids < self.end)
        out = F.embedding((ids - self.start) * inside, self.weight) * inside.unsqueeze(-1)
        return all_reduce(out, self.group)


class ParallelLMHead(PackableLinear):
    """Logits over this rank's vocabulary slice, gathered whole on the first rank of the vocabulary's shard."""

    def __init__(self, embedding: VocabParallelEmbedding, tied: bool):
        super().__init__()
        self.vocab_size = embedding.vocab_size
        self.group = embedding.group
        if tied:
            self.weight = embedding.weight
        else:
            self.weight = attach_loader(
                nn.Parameter(torch.empty_like(embedding.weight), requires_grad=False), embedding._load
            )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Full-vocabulary fp32 logits on the shard's first rank (global rank 0), None on the others."""
        local = self.project(hidden).float()
        parts = gather_to_first(local, self.group)
        if parts is None:
            return None
        return torch.cat(parts, dim=-1)[:, : self.vocab_size] if len(parts) > 1 else local[:, : self.vocab_size]

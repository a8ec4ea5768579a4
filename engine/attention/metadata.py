"""Per-step attention metadata, built once per step by the model runner and read by every layer."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.attention.backend import AttentionBackend


@dataclass
class PagedKV:
    """Queries that attend, unmasked, to every token of their sequence's KV shard on this rank.

    Sequence s owns query rows query_start[s] .. query_start[s+1]-1 and its local shard is the
    first lens[s] slots of block_tables[s] (local index j lives at table[j // B] * B + j % B).
    """

    block_tables: torch.Tensor  # [S, max_blocks] int64
    lens: torch.Tensor  # [S] int64, local lengths on this rank (0: this rank holds none)
    query_start: torch.Tensor  # [S + 1] int64
    query_counts: list[int]
    local_lens: list[int]  # `lens` as Python ints
    max_len: int
    block_size: int
    need_lse: bool = True  # False: the caller discards the log-sum-exp (decode without DCP)
    extra: dict = field(default_factory=dict)  # backend-specific tensors, prepared once per step

    @property
    def one_query_each(self) -> bool:
        return all(n == 1 for n in self.query_counts)


@dataclass
class PrefillNew:
    """Causal attention among the new tokens of each prefill chunk (they are all in hand)."""

    cu_seqlens: torch.Tensor  # [P + 1] int64
    seq_lens: list[int]
    max_len: int


@dataclass
class AttentionMetadata:
    """Tokens are laid out prefill chunks first, then one token per decoding sequence."""

    backend: AttentionBackend
    slot_mapping: torch.Tensor  # [N] int64, -1 where another DCP rank stores the token
    num_prefill_tokens: int
    num_decode_tokens: int
    prefill: PrefillNew | None = None
    prefill_context: PagedKV | None = None  # cached context of prefill chunks (None if none has any)
    decode: PagedKV | None = None
    extra: dict = field(default_factory=dict)


_CURRENT: AttentionMetadata | None = None


@contextmanager
def step_metadata(metadata: AttentionMetadata) -> Iterator[AttentionMetadata]:
    """Make `metadata` the one the attention layers read during this forward pass."""
    global _CURRENT
    previous, _CURRENT = _CURRENT, metadata
    try:
        yield metadata
    finally:
        _CURRENT = previous


def current_metadata() -> AttentionMetadata:
    if _CURRENT is None:
        raise RuntimeError("attention layers ran outside a model-runner step")
    return _CURRENT

"""The attention backend interface: the per-step metadata every layer reads, and the kernels a backend implements.

The model runner builds one `AttentionMetadata` per step (`step_metadata` makes it current); each attention layer
reads it (`current_metadata`) and calls the step's backend. Tensors: queries [T, H, Dk]; new keys/values
[T, Hkv, Dk] / [T, Hkv, Dv]; caches [num_blocks, block_size, Hkv, Dk] (keys) and [num_blocks, block_size, Hkv, Dv]
(values). For MLA the value cache is None: values are the first Dv dims of the (latent) keys. Outputs [T, H, Dv] in
the query dtype, log-sum-exp [T, H] in fp32 (natural log; -inf where a row saw no key).
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import torch


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

    @functools.cached_property
    def one_query_each(self) -> bool:  # read by every layer: computed once a step
        return all(n == 1 for n in self.query_counts)


@dataclass
class PrefillNew:
    """Causal attention among the new tokens of each prefill chunk (they are all in hand)."""

    cu_seqlens: torch.Tensor  # [P + 1] int64
    seq_lens: list[int]
    max_len: int
    # without DCP, where some chunk continues a cached prompt: each chunk's cached tokens [P] int64 (0 for a fresh
    # prompt) and block tables [P, W], for a backend that attends to the context in the same pass (`prefill_in_context`)
    context_lens: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    """Tokens are laid out prefill chunks first, then one token per decoding sequence."""

    backend: AttentionBackend
    slot_mapping: torch.Tensor  # [N] int64, -1 where another DCP rank stores the token
    num_prefill_tokens: int
    num_decode_tokens: int
    prefill: PrefillNew | None = None
    # cached context of the prefill chunks from the first to the last that has any (None if none has any); its
    # queries are the prefill rows prefill_context_rows[0] .. prefill_context_rows[1] - 1
    prefill_context: PagedKV | None = None
    prefill_context_rows: tuple[int, int] = (0, 0)
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


class Rotary(Protocol):
    """The rotary embedding `rotate_and_write` applies (engine.layers.rotary.RotaryEmbedding)."""

    interleaved: bool

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor: ...


class AttentionBackend(ABC):
    """Kernels one engine step uses; `prepare` runs once per step, the rest once per layer."""

    name: str = ""
    head_major_cache: bool = False  # True: cache stored [blocks, kv heads, block_size, dim] (attention.kv_cache)

    def prepare(self, metadata: AttentionMetadata) -> None:  # noqa: B027 - optional hook
        """Precompute backend-specific tensors for this step (default: nothing)."""

    @abstractmethod
    def write_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor | None,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor | None,
        metadata: AttentionMetadata,
        scales: tuple[float, float] = (1.0, 1.0),
    ) -> None:
        """Store each token's key/value at its slot; slot -1 (another rank's token) is skipped. An fp8 cache stores
        key / scales[0] and value / scales[1] (engine.kv_quant.to_cache)."""

    def rotate_and_write(
        self,
        qkv: torch.Tensor,
        rope: Rotary,
        cos: torch.Tensor,
        sin: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scales: tuple[float, float] = (1.0, 1.0),
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate the query and key heads of qkv [T, Hq + 2 Hkv, D] and store the rotated keys and the values as
        `write_cache` does; returns the rotated query heads [T, Hq, D] and key heads [T, Hkv, D]."""
        kv_heads = key_cache.shape[2]
        qk = rope.apply(qkv[:, :-kv_heads], cos, sin)
        k = qk[:, -kv_heads:]
        self.write_cache(k, qkv[:, -kv_heads:], key_cache, value_cache, metadata, scales)
        return qk[:, :-kv_heads], k

    @abstractmethod
    def prefill_new(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefill: PrefillNew, scale: float, need_lse: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Causal attention of each chunk's new tokens to themselves."""

    def prefill_in_context(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        prefill: PrefillNew,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor | None:
        """Without DCP: each chunk's new tokens attend to their prompt's cached context (`prefill.context_lens`
        tokens of the cache, which hold exactly the stored keys and values) and causally to themselves in one pass,
        out [T, H, Dv]; None where this backend cannot (the layer then attends to the context and merges by LSE)."""
        return None

    @abstractmethod
    def paged(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor | None,
        value_dim: int,
        kv: PagedKV,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each query row attends to all local cached tokens of its sequence; returns (out, lse).

        A backend may return lse None when `kv.need_lse` is False.
        """

"""The attention backend interface and the registry that names the supported choices.

Tensors: queries [T, H, Dk]; new keys/values [T, Hkv, Dk] / [T, Hkv, Dv]; caches
[num_blocks, block_size, Hkv, Dk] (keys) and [num_blocks, block_size, Hkv, Dv] (values). For MLA the
value cache is None: values are the first Dv dims of the (latent) keys. Outputs [T, H, Dv] in
the query dtype, log-sum-exp [T, H] in fp32 (natural log; -inf where a row saw no key).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from engine.attention.metadata import AttentionMetadata, PagedKV, PrefillNew
from engine.errors import UserError


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
    ) -> None:
        """Store each token's key/value at its slot; slot -1 (another rank's token) is skipped."""

    @abstractmethod
    def prefill_new(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefill: PrefillNew, scale: float, need_lse: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Causal attention of each chunk's new tokens to themselves."""

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


def _torch_backend() -> AttentionBackend:
    from engine.attention.torch_backend import TorchBackend

    return TorchBackend()


def _cpu_backend() -> AttentionBackend:
    from engine.attention.cpu_backend import CpuBackend

    return CpuBackend()


def _triton_backend() -> AttentionBackend:
    from engine.attention.triton_backend import TritonBackend

    return TritonBackend()


def _flash_backend() -> AttentionBackend:
    from engine.attention.flash_backend import FlashAttnBackend

    return FlashAttnBackend()


BACKENDS = {"torch": _torch_backend, "cpu": _cpu_backend, "triton": _triton_backend, "flash_attn": _flash_backend}


def create_backend(name: str) -> AttentionBackend:
    """The backend called `name`; a UserError lists the supported ones."""
    try:
        factory = BACKENDS[name]
    except KeyError:
        raise UserError(f"unknown attention backend {name!r}; supported: {', '.join(BACKENDS)}") from None
    return factory()

"""The attention backends by name: the registry that builds the one a plan names and lists the supported choices.

Each backend is imported when it is asked for, so a plan that never names triton or flash_attn never imports them.
"""

from __future__ import annotations

from engine.attention.backend import AttentionBackend
from engine.errors import UserError


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

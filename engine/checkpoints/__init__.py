"""Checkpoints: model aliases and the cache (torch-free), what a checkpoint's config.json says (`model_info`,
torch-free), reading its tensors (`weights`), tiny random models, pulling real ones.

`make_tiny_checkpoint` and `pull_model` are imported lazily so that `import engine.checkpoints` stays
free of torch and transformers.
"""

from __future__ import annotations

from typing import Any

from engine.checkpoints.aliases import (
    COMPLETE_MARKER,
    KNOWN_ALIASES,
    Alias,
    cache_dir,
    is_alias,
    is_complete,
    read_marker,
    resolve_model_path,
)

__all__ = [
    "COMPLETE_MARKER",
    "KNOWN_ALIASES",
    "Alias",
    "cache_dir",
    "is_alias",
    "is_complete",
    "make_tiny_checkpoint",
    "pull_model",
    "read_marker",
    "resolve_model_path",
]


def __getattr__(name: str) -> Any:
    if name == "make_tiny_checkpoint":
        from engine.checkpoints.tiny import make_tiny_checkpoint

        return make_tiny_checkpoint
    if name == "pull_model":
        from engine.checkpoints.pull import pull_model

        return pull_model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

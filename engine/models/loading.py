"""Fill a model's parameters from a checkpoint folder through each parameter's slice loader."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from torch import nn

from engine.checkpoints.weights import iterate_checkpoint
from engine.errors import UserError

# Maps a checkpoint tensor name to (parameter name, shard id), or None to skip the tensor.
NameMap = Callable[[str], "tuple[str, object] | None"]


def load_checkpoint(model: nn.Module, folder: Path, name_map: NameMap) -> None:
    """Load every parameter of `model`; a UserError names what the checkpoint lacks."""
    params = dict(model.named_parameters(remove_duplicate=False))  # tied weights answer to both names
    pending = set(dict(model.named_parameters()))
    for tensor in iterate_checkpoint(folder):
        target = name_map(tensor.name)
        if target is None:
            continue
        name, shard = target
        param = params.get(name)
        if param is None:
            continue  # a tensor this rank or architecture does not use (e.g. rotary caches)
        param.weight_loader(param, tensor, shard)
        pending -= {n for n, p in params.items() if p is param}
    if pending:
        shown = ", ".join(sorted(pending)[:5])
        raise UserError(f"{folder}: the checkpoint lacks weights for {len(pending)} parameters ({shown}...)")

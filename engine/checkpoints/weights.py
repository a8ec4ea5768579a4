"""Read checkpoint tensors lazily with safetensors, so each rank reads only its slices."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from engine.checkpoints.model_info import safetensors_file_entries
from engine.errors import UserError


class CheckpointTensor:
    """A tensor in a safetensors file that is read only when (a slice of) it is asked for."""

    def __init__(self, name: str, file_slice) -> None:
        self.name = name
        self._slice = file_slice
        self.shape = tuple(file_slice.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * dim + [slice(start, start + length)]
        return self._slice[tuple(index)]

    def chunk(self, dim: int, parts: int, index: int) -> torch.Tensor:
        """The `index`-th of `parts` equal slices along `dim`."""
        size = self.shape[dim]
        if size % parts:
            raise UserError(f"checkpoint tensor {self.name} has {size} rows along dim {dim}, not divisible by {parts}")
        step = size // parts
        return self.narrow(dim, index * step, step)

    def load(self) -> torch.Tensor:
        return self._slice[...]  # `...`, not `:`: a 0-d tensor (a KV cache scale) takes no slice


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder (single file or sharded index)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / n for n in names]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UserError(f"{folder} has no *.safetensors weights; convert the checkpoint to safetensors")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise UserError(f"{folder}: the index names missing weight files: {', '.join(missing)}")
    for file in files:
        safetensors_file_entries(file)  # a damaged file is a clear error before any tensor is read
    return files


def iterate_checkpoint(folder: Path) -> Iterator[CheckpointTensor]:
    """Every tensor of the checkpoint as a lazy CheckpointTensor."""
    with ExitStack() as stack:
        for file in checkpoint_files(folder):
            handle = stack.enter_context(safe_open(str(file), framework="pt"))
            for name in handle.keys():  # noqa: SIM118 - safe_open handles are not mappings
                yield CheckpointTensor(name, handle.get_slice(name))


def copy_into(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
    """Copy a loaded slice into a parameter, with a clear error on shape mismatch."""
    if tuple(param.shape) != tuple(value.shape):
        raise UserError(
            f"checkpoint tensor {name} has shape {tuple(value.shape)} but the model expects "
            f"{tuple(param.shape)}; is config.json from the same checkpoint?"
        )
    param.data.copy_(value.to(param.dtype))

"""An fp8 KV cache's per-layer scales as a checkpoint carries them, under the names vLLM loads.

Per layer N, one scale for the keys and one for the values (`maybe_remap_kv_scale_name` in vLLM):
`model.layers.N.self_attn.k_scale` / `.v_scale` (compressed-tensors, llm-compressor), `...self_attn.k_proj.k_scale` /
`...self_attn.v_proj.v_scale` (ModelOpt), or the deprecated `...self_attn.kv_scale` (both). A layer without one keeps
1.0, vLLM's default. An MLA layer caches one latent: its `k_scale` (or `kv_scale`) is that cache's scale and a
`v_scale` is not read, as in vLLM. A scale that is not one positive finite number is a clear error.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from engine.checkpoints.weights import iterate_checkpoint
from engine.errors import UserError

_SCALE_NAME = re.compile(
    r"^(?:model\.)?layers\.(\d+)\.self_attn\.(?:k_proj\.(k)_scale|v_proj\.(v)_scale|(k|v|kv)_scale)$"
)


def read_kv_scales(folder: Path, mla: bool) -> dict[int, tuple[float | None, float | None]]:
    """Layer index -> (k_scale, v_scale) of the checkpoint in `folder` (None: that one is not in it; MLA: the latent
    cache's scale in both). Empty when the checkpoint has no KV cache scales."""
    found: dict[int, list[float | None]] = {}
    for tensor in iterate_checkpoint(folder):
        match = _SCALE_NAME.match(tensor.name)
        if match is None:
            continue
        layer = int(match.group(1))
        kind = match.group(2) or match.group(3) or match.group(4)
        if mla and kind == "v":
            continue  # the latent cache has one scale: the key's
        value = _one_scale(tensor.name, tensor.load())
        entry = found.setdefault(layer, [None, None])
        if kind in ("k", "kv"):
            entry[0] = value
        if kind in ("v", "kv") or mla:
            entry[1] = value
    return {layer: (k, v) for layer, (k, v) in sorted(found.items())}


def _one_scale(name: str, tensor) -> float:
    if tensor.numel() != 1:
        raise UserError(
            f"checkpoint tensor {name} has {tensor.numel()} values; dcpctl reads one KV cache scale per layer "
            "(per tensor): store a single value"
        )
    value = float(tensor.float().reshape(()))
    if not math.isfinite(value) or value <= 0:
        raise UserError(
            f"checkpoint tensor {name} is {value}: a KV cache scale must be a positive finite number; fix it, or "
            "remove it for the default 1.0"
        )
    return value

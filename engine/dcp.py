"""The one owner of the decode-context-parallel (DCP) token math.

Positions are sharded across the `dcp` ranks of a DCP group in runs of `interleave` tokens.
Every function works on Python ints and, element-wise, on integer torch tensors, so the plan
display (no torch), the block manager and the per-step slot mapping all share these formulas.

Notation (DESIGN.md): I = interleave, D = dcp size, B = block size (tokens per rank per block).
One logical ("virtual") block covers B*D tokens; each rank stores its B-token share of it in
its own pool under the same block id, so block tables are identical on all ranks.
"""

from __future__ import annotations

from typing import Any


def _is_tensor(x: Any) -> bool:
    return hasattr(x, "dtype") and hasattr(x, "clamp")


def _clamp(x: Any, lo: int, hi: int) -> Any:
    return x.clamp(lo, hi) if _is_tensor(x) else min(max(x, lo), hi)


def _select(cond: Any, if_true: Any, if_false: Any) -> Any:
    if _is_tensor(cond):
        import torch

        return torch.where(cond, if_true, if_false)
    return if_true if cond else if_false


def owner(p: Any, interleave: int, dcp: int) -> Any:
    """DCP rank that stores global position `p`."""
    return (p // interleave) % dcp


def local_index(p: Any, interleave: int, dcp: int) -> Any:
    """Index of position `p` in its owner's local (sharded) sequence."""
    return (p // (interleave * dcp)) * interleave + p % interleave


def local_len(length: Any, rank: int, interleave: int, dcp: int) -> Any:
    """Number of the first `length` positions of a sequence that rank `rank` stores."""
    base = (length // (interleave * dcp)) * interleave
    return base + _clamp(length - base * dcp - rank * interleave, 0, interleave)


def tokens_per_virtual_block(block_size: int, dcp: int) -> int:
    """Tokens of a sequence covered by one logical block id across the DCP group."""
    return block_size * dcp


def blocks_needed(length: Any, block_size: int, dcp: int) -> Any:
    """Logical blocks a sequence of `length` tokens needs (ceil division)."""
    span = tokens_per_virtual_block(block_size, dcp)
    return (length + span - 1) // span


def slot(p: Any, rank: int, block_table: Any, block_size: int, interleave: int, dcp: int, rows: Any = None) -> Any:
    """Cache slot of position `p` on DCP rank `rank`, or -1 when another rank owns it.

    `block_table[vb]` (or `block_table[rows, vb]` for a batch of sequences, one row per
    position) is the physical block id of virtual block `vb`.
    """
    span = tokens_per_virtual_block(block_size, dcp)
    vb = p // span
    vo = p % span
    physical = block_table[vb] if rows is None else block_table[rows, vb]
    return _select(owner(vo, interleave, dcp) == rank, physical * block_size + local_index(vo, interleave, dcp), -1)

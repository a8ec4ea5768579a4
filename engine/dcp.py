"""The one owner of the decode-context-parallel (DCP) token math.

Positions are sharded across the `dcp` ranks of a DCP group in runs of `interleave` tokens.
Every function works on Python ints and, element-wise, on integer torch tensors, so the plan
display (no torch), the block manager and the per-step slot mapping all share these formulas.

Notation (DESIGN.md): I = interleave, D = dcp size, B = block size (tokens per rank per block).
One logical ("virtual") block covers B*D tokens; each rank stores its B-token share of it in
its own pool under the same block id, so block tables are identical on all ranks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple


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


# ---- prefill -> decode hand-off: which cache slots of one layout hold what another layout needs ----


class DcpSpec(NamedTuple):
    """One side of a hand-off: how its cache shards positions (B, I, D in DESIGN.md)."""

    block_size: int
    interleave: int
    dcp: int


class Run(NamedTuple):
    """`length` consecutive cache slots from `src_slot` on source DCP rank `src_rank` to `dst_slot` onwards."""

    src_rank: int
    src_slot: int
    dst_slot: int
    length: int


def handoff_runs(
    src: DcpSpec,
    dst: DcpSpec,
    dst_rank: int,
    start: int,
    end: int,
    src_table: Sequence[int],
    dst_table: Sequence[int],
    stretch: bool = True,
) -> list[Run]:
    """The fewest slot runs that give DCP rank `dst_rank` of layout `dst` its positions in [start, end).

    Each run is contiguous on both sides and stays inside one cache block on each side; runs come in position
    order and no two neighbours could be one run. Positions are walked in pieces of gcd(I_src, I_dst), inside
    which both sides are contiguous (each interleave divides its block size). `stretch`: the final run is
    extended to the end of its destination block where the source block has room too, so that a partly filled
    last block still costs one run: the extra destination slots hold positions >= `end` (written by the decode
    side before it reads them), the extra source slots lie in the same source block.
    """
    step = math.gcd(src.interleave, dst.interleave)
    run_span = dst.interleave * dst.dcp
    runs: list[Run] = []
    first_run = (start // run_span) * run_span + dst_rank * dst.interleave
    for run_start in range(first_run, end, run_span):
        lo, hi = max(run_start, start), min(run_start + dst.interleave, end)
        piece = lo
        while piece < hi:
            piece_end = min(hi, (piece // step + 1) * step)
            rank = owner(piece, src.interleave, src.dcp)
            s = slot(piece, rank, src_table, src.block_size, src.interleave, src.dcp)
            d = slot(piece, dst_rank, dst_table, dst.block_size, dst.interleave, dst.dcp)
            n = piece_end - piece
            last = runs[-1] if runs else None
            if (
                last is not None
                and last.src_rank == rank
                and last.src_slot + last.length == s
                and last.dst_slot + last.length == d
                and s % src.block_size
                and d % dst.block_size
            ):
                runs[-1] = last._replace(length=last.length + n)
            else:
                runs.append(Run(rank, s, d, n))
            piece = piece_end
    if stretch and runs:
        last = runs[-1]
        room = min(-(last.src_slot + last.length) % src.block_size, -(last.dst_slot + last.length) % dst.block_size)
        runs[-1] = last._replace(length=last.length + room)
    return runs

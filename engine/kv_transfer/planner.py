"""Byte descriptors of one pull (numpy, no torch): what a decode rank reads from which prefill rank.

The token runs come from `engine.dcp.handoff_runs`, the KV heads' sources from `engine.parallel_layout`, and the
byte addresses from each side's `CacheGeometry`. Each run x layer x kind expands into the largest units that are
contiguous in both layouts (a head's run of tokens when both are head-major; a token's heads when both are
token-major; one head of one token otherwise); units are then sorted by destination and neighbours contiguous on
both sides are merged, which gives the fewest descriptors (destination ranges never overlap). The caches are
block-major across layers, so a run that covers whole blocks with all their heads on both sides merges over every
layer and K/V into one descriptor per block.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine import dcp
from engine.attention.kv_layout import CacheGeometry
from engine.dcp import DcpSpec, Run
from engine.parallel_layout import HeadSource


@dataclass
class Descriptors:
    """Contiguous copies from one prefill rank: absolute addresses and byte counts (equal lengths)."""

    src_addr: np.ndarray  # int64
    dst_addr: np.ndarray
    length: np.ndarray

    def __len__(self) -> int:
        return len(self.length)

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())


@dataclass(frozen=True)
class PullSide:
    """One side of a pull: its DCP sharding, the sequence's block table, and its ranks' cache geometries."""

    spec: DcpSpec
    block_table: list[int]
    geometries: dict[int, CacheGeometry]  # global rank -> geometry (the decode side: just the pulling rank)


def _units(runs: list[Run], head: HeadSource, src: CacheGeometry, dst: CacheGeometry) -> tuple[np.ndarray, ...]:
    """(src offset, dst offset, length) of every unit of these runs for these heads, over all layers and kinds."""
    arr = np.asarray([(r.src_slot, r.dst_slot, r.length) for r in runs], dtype=np.int64).reshape(-1, 3)
    s_slot, d_slot, n = arr[:, 0], arr[:, 1], arr[:, 2]
    hb = src.head_bytes
    if src.head_major and dst.head_major:
        heads = np.arange(head.count, dtype=np.int64)[:, None]
        s_slot, d_slot, n, s_head, d_head = (
            np.broadcast_to(x, (head.count, len(runs))).ravel()
            for x in (s_slot, d_slot, n, heads + head.src_head, heads + head.dst_head)
        )
        unit_len = n * hb
    else:
        # one row per token of every run
        token = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)
        s_slot, d_slot = np.repeat(s_slot, n) + token, np.repeat(d_slot, n) + token
        whole = not src.head_major and not dst.head_major
        if whole:  # the segment's heads of one token are contiguous on both sides
            s_head = np.full_like(s_slot, head.src_head)
            d_head = np.full_like(s_slot, head.dst_head)
            unit_len = np.full_like(s_slot, head.count * hb)
        else:
            count = head.count
            heads = np.arange(count, dtype=np.int64)[:, None]
            s_slot, d_slot, s_head, d_head = (
                np.broadcast_to(x, (count, len(s_slot))).ravel()
                for x in (s_slot, d_slot, heads + head.src_head, heads + head.dst_head)
            )
            unit_len = np.full_like(s_slot, hb)
    src_off, dst_off, lengths = [], [], []
    for layer in range(src.layers):
        for kind in range(src.kinds):
            src_off.append(src.offset(layer, kind, s_slot, s_head))
            dst_off.append(dst.offset(layer, kind, d_slot, d_head))
            lengths.append(unit_len)
    return np.concatenate(src_off), np.concatenate(dst_off), np.concatenate(lengths)


def coalesce(src: np.ndarray, dst: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sort by destination and merge neighbours that are contiguous on both sides."""
    if not len(length):
        return src, dst, length
    order = np.argsort(dst, kind="stable")
    src, dst, length = src[order], dst[order], length[order]
    joins = (src[:-1] + length[:-1] == src[1:]) & (dst[:-1] + length[:-1] == dst[1:])
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return src[starts], dst[starts], np.add.reduceat(length, starts)


def _check_compatible(src: CacheGeometry, dst: CacheGeometry) -> None:
    if (src.layers, src.kinds, src.head_bytes) != (dst.layers, dst.kinds, dst.head_bytes):
        raise ValueError(
            f"the prefill cache (layers {src.layers}, kinds {src.kinds}, {src.head_bytes} B per head) does not match "
            f"the decode cache (layers {dst.layers}, kinds {dst.kinds}, {dst.head_bytes} B per head)"
        )


def _check_table(side: str, table: list[int], spec: DcpSpec, geometry: CacheGeometry | None, end: int) -> None:
    need = dcp.blocks_needed(end, spec.block_size, spec.dcp)
    if len(table) < need:
        raise ValueError(f"the {side} block table has {len(table)} blocks; {end} tokens need {need}")
    if geometry is not None and any(not 0 <= b < geometry.num_blocks for b in table[:need]):
        raise ValueError(f"the {side} block table names a block outside 0..{geometry.num_blocks - 1}")


def plan_pull(
    src: PullSide,
    dst: PullSide,
    dst_rank: int,
    dst_dcp_rank: int,
    heads: list[HeadSource],
    start: int,
    end: int,
) -> dict[int, Descriptors]:
    """Descriptors (absolute addresses) per prefill global rank for decode rank `dst_rank` to get its positions
    in [start, end); ValueError when a table or a geometry does not fit (bad input never becomes a READ)."""
    dst_geo = dst.geometries[dst_rank]
    if end <= start:
        return {}
    _check_table("decode", dst.block_table, dst.spec, dst_geo, end)
    _check_table("prefill", src.block_table, src.spec, None, end)
    runs = dcp.handoff_runs(src.spec, dst.spec, dst_dcp_rank, start, end, src.block_table, dst.block_table)
    by_src: dict[int, list[tuple[np.ndarray, ...]]] = {}
    for head in heads:
        for src_dcp_rank in sorted({r.src_rank for r in runs}):
            rank = head.src_ranks[src_dcp_rank]
            geo = src.geometries.get(rank)
            if geo is None:
                raise ValueError(f"no cache geometry for prefill rank {rank}")
            _check_compatible(geo, dst_geo)
            _check_table("prefill", src.block_table, src.spec, geo, end)
            mine = [r for r in runs if r.src_rank == src_dcp_rank]
            by_src.setdefault(rank, []).append(_units(mine, head, geo, dst_geo))
    out: dict[int, Descriptors] = {}
    for rank, parts in by_src.items():
        s, d, n = coalesce(*(np.concatenate([p[i] for p in parts]) for i in range(3)))
        geo = src.geometries[rank]
        if len(n) and (int((s + n).max()) > geo.nbytes or int((d + n).max()) > dst_geo.nbytes):
            raise ValueError("a descriptor falls outside a registered KV cache")
        out[rank] = Descriptors(s + geo.base_addr, d + dst_geo.base_addr, n)
    return out

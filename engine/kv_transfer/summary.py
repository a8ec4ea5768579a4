"""What a hand-off between two layouts costs, worked out from the layouts alone (no caches, no transport): which
prefill rank and block each decode rank's first block comes from, how many token runs and byte descriptors a
block needs, and the descriptors and bytes per decode rank for a few prompt lengths, also at interleave = block
size and at interleave 1 for comparison. `dcpctl plan show` draws it for a P/D plan.

Block tables are synthetic and never adjacent in memory (blocks 0, 2, 4, ...), so the counts are what the layouts
imply; blocks that happen to be adjacent can merge further. No descriptor then spans a block boundary, so a long
prompt is counted by the planner over one period of both layouts (the lcm of their virtual blocks, where every rank's
blocks start on both sides) times the whole periods, plus the planner's count of the rest.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from engine import dcp
from engine.attention.kv_layout import CacheGeometry
from engine.dcp import DcpSpec
from engine.kv_transfer.planner import Descriptors, PullSide, plan_pull
from engine.parallel_layout import ParallelLayout, kv_head_sources


@dataclass(frozen=True)
class HandoffSide:
    """One side of a hand-off as the summary needs it."""

    name: str
    layout: ParallelLayout
    spec: DcpSpec
    layers: int
    kinds: int
    head_bytes: int
    head_major: bool

    def geometry(self, num_blocks: int) -> CacheGeometry:
        heads = self.layout.kv_heads_per_rank()
        nbytes = self.layers * self.kinds * num_blocks * heads * self.spec.block_size * self.head_bytes
        return CacheGeometry(
            0,
            nbytes,
            self.layers,
            self.kinds,
            num_blocks,
            self.spec.block_size,
            heads,
            self.head_bytes,
            self.head_major,
        )


@dataclass
class BlockSource:
    """Where decode rank `rank`'s first block comes from: (prefill rank, prefill block, [(first, last) slot])."""

    rank: int
    local_tokens: int
    sources: list[tuple[int, int, list[tuple[int, int]]]]
    runs: int  # token runs in the block
    descriptors: int  # for the whole block: all layers, K/V and this rank's KV heads


@dataclass
class HandoffSummary:
    blocks: list[BlockSource]
    per_request: dict[int, list[tuple[int, int]]]  # prompt length -> per decode rank (descriptors, bytes)
    compare: dict[int, dict[int, list[int]]]  # interleave -> prompt length -> descriptors per decode rank


def _tables(prefill: HandoffSide, decode: HandoffSide, n: int) -> tuple[list[int], list[int], int]:
    """Never-adjacent block tables for `n` tokens on both sides, and the block count of each cache."""
    p = dcp.blocks_needed(n, prefill.spec.block_size, prefill.spec.dcp)
    d = dcp.blocks_needed(n, decode.spec.block_size, decode.spec.dcp)
    blocks = 2 * max(p, d) + 2
    return list(range(0, 2 * p, 2)), list(range(0, 2 * d, 2)), blocks


def _pull(prefill: HandoffSide, decode: HandoffSide, rank: int, start: int, end: int):
    src_table, dst_table, blocks = _tables(prefill, decode, end + 1)
    src_geo = prefill.geometry(blocks)
    return plan_pull(
        PullSide(prefill.spec, src_table, dict.fromkeys(range(prefill.layout.world_size), src_geo)),
        PullSide(decode.spec, dst_table, {rank: decode.geometry(blocks)}),
        rank,
        decode.layout.role(rank).dcp_rank,
        kv_head_sources(prefill.layout, decode.layout, rank),
        start,
        end,
    )


@dataclass
class RankPull:
    """What one decode rank pulls: descriptors, bytes, and the bytes each prefill rank sends it."""

    descriptors: int = 0
    nbytes: int = 0
    sent: dict[int, int] = field(default_factory=dict)  # prefill global rank -> bytes

    def add(self, pulls: dict[int, Descriptors], times: int = 1) -> None:
        for rank, d in pulls.items():
            self.descriptors += times * len(d)
            self.nbytes += times * d.nbytes
            self.sent[rank] = self.sent.get(rank, 0) + times * d.nbytes


def rank_pulls(prefill: HandoffSide, decode: HandoffSide, n: int) -> list[RankPull]:
    """Per decode rank, the pull of an n-token prompt (all but its last position, which the decode side computes)."""
    period = math.lcm(
        dcp.tokens_per_virtual_block(prefill.spec.block_size, prefill.spec.dcp),
        dcp.tokens_per_virtual_block(decode.spec.block_size, decode.spec.dcp),
    )
    end = n - 1
    whole = end // period if end >= 2 * period else 0
    out = []
    for rank in range(decode.layout.world_size):
        pull = RankPull()
        if whole:
            pull.add(_pull(prefill, decode, rank, 0, period), whole)
        pull.add(_pull(prefill, decode, rank, whole * period, end))
        out.append(pull)
    return out


def _per_request(prefill: HandoffSide, decode: HandoffSide, n: int) -> list[tuple[int, int]]:
    """(descriptors, bytes) per decode rank to pull an n-token prompt."""
    return [(p.descriptors, p.nbytes) for p in rank_pulls(prefill, decode, n)]


def summarize(prefill: HandoffSide, decode: HandoffSide, lengths: tuple[int, ...] = (512, 2048)) -> HandoffSummary:
    """The hand-off from `prefill` to `decode`, per decode rank."""
    span = dcp.tokens_per_virtual_block(decode.spec.block_size, decode.spec.dcp)
    src_table, dst_table, _ = _tables(prefill, decode, span)
    blocks = []
    for rank in range(decode.layout.world_size):
        role = decode.layout.role(rank)
        runs = dcp.handoff_runs(prefill.spec, decode.spec, role.dcp_rank, 0, span, src_table, dst_table, stretch=False)
        heads = kv_head_sources(prefill.layout, decode.layout, rank)
        sources: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for run in runs:
            p_rank = heads[0].src_ranks[run.src_rank]
            block, first = divmod(run.src_slot, prefill.spec.block_size)
            sources.setdefault((p_rank, src_table.index(block)), []).append((first, first + run.length - 1))
        descriptors = sum(len(d) for d in _pull(prefill, decode, rank, 0, span).values())
        blocks.append(
            BlockSource(
                rank,
                sum(r.length for r in runs),
                [(r, b, slots) for (r, b), slots in sources.items()],
                len(runs),
                descriptors,
            )
        )
    per_request = {n: _per_request(prefill, decode, n) for n in lengths}
    compare = {}
    for interleave in sorted({decode.spec.block_size, 1} - {decode.spec.interleave}, reverse=True):
        other = dataclasses.replace(decode, spec=decode.spec._replace(interleave=interleave))
        compare[interleave] = {n: [d for d, _ in _per_request(prefill, other, n)] for n in lengths}
    return HandoffSummary(blocks, per_request, compare)

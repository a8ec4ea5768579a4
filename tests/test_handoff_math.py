"""The hand-off's token runs (engine.dcp.handoff_runs) against per-position enumeration of both layouts."""

from __future__ import annotations

import itertools
import random

import pytest

from engine import dcp
from engine.dcp import DcpSpec, Run


def random_spec(rng: random.Random) -> DcpSpec:
    block = rng.choice([1, 2, 4, 6, 8, 16])
    return DcpSpec(block, rng.choice([i for i in range(1, block + 1) if block % i == 0]), rng.randint(1, 4))


def position_map(src: DcpSpec, dst: DcpSpec, dst_rank: int, start: int, end: int, src_table, dst_table) -> dict:
    """dst slot -> (src rank, src slot) for every position in [start, end) that dst_rank owns."""
    out = {}
    for p in range(start, end):
        if dcp.owner(p, dst.interleave, dst.dcp) != dst_rank:
            continue
        rank = dcp.owner(p, src.interleave, src.dcp)
        out[dcp.slot(p, dst_rank, dst_table, *dst)] = (rank, dcp.slot(p, rank, src_table, *src))
    return out


def mergeable(a: Run, b: Run, src: DcpSpec, dst: DcpSpec) -> bool:
    return (
        a.src_rank == b.src_rank
        and a.src_slot + a.length == b.src_slot
        and a.dst_slot + a.length == b.dst_slot
        and b.src_slot % src.block_size != 0
        and b.dst_slot % dst.block_size != 0
    )


def check(src, dst, dst_rank, start, end, src_table, dst_table):
    runs = dcp.handoff_runs(src, dst, dst_rank, start, end, src_table, dst_table, stretch=False)
    expected = position_map(src, dst, dst_rank, start, end, src_table, dst_table)
    got = {}
    for run in runs:
        assert run.length > 0
        # inside one block on each side
        assert run.src_slot // src.block_size == (run.src_slot + run.length - 1) // src.block_size
        assert run.dst_slot // dst.block_size == (run.dst_slot + run.length - 1) // dst.block_size
        for k in range(run.length):
            assert run.dst_slot + k not in got
            got[run.dst_slot + k] = (run.src_rank, run.src_slot + k)
    assert got == expected
    for a, b in itertools.pairwise(runs):
        assert not mergeable(a, b, src, dst), (a, b)
    stretched = dcp.handoff_runs(src, dst, dst_rank, start, end, src_table, dst_table)
    assert stretched[:-1] == runs[:-1] if runs else stretched == []
    if runs:
        last, longer = runs[-1], stretched[-1]
        assert longer._replace(length=last.length) == last and longer.length >= last.length
        assert longer.src_slot // src.block_size == (longer.src_slot + longer.length - 1) // src.block_size
        assert longer.dst_slot // dst.block_size == (longer.dst_slot + longer.length - 1) // dst.block_size
        assert (longer.src_slot + longer.length) % src.block_size == 0 or (
            longer.dst_slot + longer.length
        ) % dst.block_size == 0
        # the extra destination slots hold positions at or past `end` only
        for k in range(last.length, longer.length):
            assert longer.dst_slot + k not in expected


def test_runs_match_per_position_enumeration_for_random_layout_pairs():
    rng = random.Random(18)
    for _ in range(3000):
        src, dst = random_spec(rng), random_spec(rng)
        dst_rank = rng.randrange(dst.dcp)
        span_d = dst.block_size * dst.dcp
        end = rng.randint(1, 6 * span_d + 7)
        start = rng.randint(0, (end - 1) // span_d) * span_d
        src_blocks = dcp.blocks_needed(end + src.block_size * src.dcp, src.block_size, src.dcp)
        dst_blocks = dcp.blocks_needed(end + span_d, dst.block_size, dst.dcp)
        src_table = rng.sample(range(3 * src_blocks + 3), src_blocks)
        dst_table = rng.sample(range(3 * dst_blocks + 3), dst_blocks)
        if rng.random() < 0.2:  # consecutive physical blocks: runs must still stop at block ends
            src_table = list(range(src_blocks))
            dst_table = list(range(dst_blocks))
        check(src, dst, dst_rank, start, end, src_table, dst_table)


@pytest.mark.parametrize("interleave", [64, 16, 1])
def test_dcp1_to_dcp2_at_block_64_needs_one_run_per_interleave_piece(interleave):
    """Source blocks never adjacent: a decode rank needs one run per piece of `interleave` positions it owns."""
    src, dst = DcpSpec(64, 64, 1), DcpSpec(64, interleave, 2)
    end = 511  # a 512-token prompt: the decode side computes the last position itself
    src_table = list(range(0, 16, 2))
    dst_table = list(range(4))
    for rank in range(2):
        runs = dcp.handoff_runs(src, dst, rank, 0, end, src_table, dst_table)
        owned = {p // interleave for p in range(end) if dcp.owner(p, interleave, 2) == rank}
        assert len(runs) == len(owned) == 4 * 64 // interleave - (interleave == 1 and rank == 1)
        assert sum(r.length for r in runs) == 256  # the stretched last run reaches the end of its block


def test_interleave_equal_to_block_size_maps_each_decode_block_to_one_prefill_block():
    src, dst = DcpSpec(64, 64, 1), DcpSpec(64, 64, 2)
    runs = dcp.handoff_runs(src, dst, 1, 0, 499, [10, 11, 12, 13, 14, 15, 16, 17], [3, 5, 7, 9])
    assert runs == [Run(0, b * 64, d * 64, 64) for b, d in ((11, 3), (13, 5), (15, 7), (17, 9))]


def test_start_past_a_cached_prefix_and_an_empty_range():
    src, dst = DcpSpec(4, 2, 2), DcpSpec(8, 4, 2)
    assert dcp.handoff_runs(src, dst, 0, 16, 16, list(range(10)), list(range(10))) == []
    runs = dcp.handoff_runs(src, dst, 0, 16, 20, list(range(10)), list(range(10)), stretch=False)
    assert sum(r.length for r in runs) == 4

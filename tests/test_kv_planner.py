"""The hand-off's byte descriptors (engine.kv_transfer.planner) against a per-element map of both caches."""

from __future__ import annotations

import random

import numpy as np
import pytest

from engine import dcp
from engine.attention.kv_layout import CacheGeometry
from engine.dcp import DcpSpec
from engine.kv_transfer.planner import PullSide, coalesce, plan_pull
from engine.parallel_layout import ParallelLayout, kv_head_sources

HEAD_BYTES = 8  # one int64 code per head per token


def geometry(layers, kinds, blocks, block_size, heads, head_major, head_bytes=HEAD_BYTES) -> CacheGeometry:
    nbytes = layers * kinds * blocks * heads * block_size * head_bytes
    return CacheGeometry(0, nbytes, layers, kinds, blocks, block_size, heads, head_bytes, head_major)


def code(rank, layer, kind, slot, head) -> int:
    return (((rank * 100 + layer) * 3 + kind) * 100_000 + slot) * 64 + head


def filled(rank: int, geo: CacheGeometry) -> np.ndarray:
    """A source cache whose every head holds the code of where it is."""
    mem = np.zeros(geo.nbytes // 8, dtype=np.int64)
    for layer in range(geo.layers):
        for kind in range(geo.kinds):
            for slot in range(geo.num_blocks * geo.block_size):
                for head in range(geo.heads):
                    mem[geo.offset(layer, kind, slot, head) // 8] = code(rank, layer, kind, slot, head)
    return mem


def copy(descriptors, sources: dict[int, np.ndarray], dst: np.ndarray) -> None:
    out = dst.view(np.uint8)
    for rank, d in descriptors.items():
        src = sources[rank].view(np.uint8)
        for s, t, n in zip(d.src_addr, d.dst_addr, d.length, strict=True):
            out[t : t + n] = src[s : s + n]


def run_case(rng, src_layout, dst_layout, src_spec, dst_spec, head_major_src, head_major_dst, layers=2):
    kinds = 1 if src_layout.is_mla else 2
    start_max = 4 * dst_spec.block_size * dst_spec.dcp
    end = rng.randint(1, start_max)
    start = rng.randint(0, (end - 1) // (dst_spec.block_size * dst_spec.dcp)) * dst_spec.block_size * dst_spec.dcp
    src_blocks = dcp.blocks_needed(end, src_spec.block_size, src_spec.dcp) + 1
    dst_blocks = dcp.blocks_needed(end, dst_spec.block_size, dst_spec.dcp) + 1
    src_table = rng.sample(range(2 * src_blocks), src_blocks)
    dst_table = rng.sample(range(2 * dst_blocks), dst_blocks)
    src_geos = {
        r: geometry(layers, kinds, 2 * src_blocks, src_spec.block_size, src_layout.kv_heads_per_rank(), head_major_src)
        for r in range(src_layout.world_size)
    }
    sources = {r: filled(r, g) for r, g in src_geos.items()}
    for dst_rank in range(dst_layout.world_size):
        role = dst_layout.role(dst_rank)
        dst_geo = geometry(
            layers, kinds, 2 * dst_blocks, dst_spec.block_size, dst_layout.kv_heads_per_rank(), head_major_dst
        )
        heads = kv_head_sources(src_layout, dst_layout, dst_rank)
        descriptors = plan_pull(
            PullSide(src_spec, src_table, src_geos),
            PullSide(dst_spec, dst_table, {dst_rank: dst_geo}),
            dst_rank,
            role.dcp_rank,
            heads,
            start,
            end,
        )
        mem = np.full(dst_geo.nbytes // 8, -1, dtype=np.int64)
        copy(descriptors, sources, mem)
        for p in range(start, end):
            if dcp.owner(p, dst_spec.interleave, dst_spec.dcp) != role.dcp_rank:
                continue
            d_slot = dcp.slot(p, role.dcp_rank, dst_table, *dst_spec)
            src_dcp = dcp.owner(p, src_spec.interleave, src_spec.dcp)
            s_slot = dcp.slot(p, src_dcp, src_table, *src_spec)
            for h in heads:
                for j in range(h.count):
                    for layer in range(layers):
                        for kind in range(kinds):
                            got = mem[dst_geo.offset(layer, kind, d_slot, h.dst_head + j) // 8]
                            want = code(h.src_ranks[src_dcp], layer, kind, s_slot, h.src_head + j)
                            assert got == want, (p, h, j, layer, kind)
        for d in descriptors.values():  # fully coalesced: no two neighbours (in destination order) could merge
            order = np.argsort(d.dst_addr)
            s, t, n = d.src_addr[order], d.dst_addr[order], d.length[order]
            assert not np.any((s[:-1] + n[:-1] == s[1:]) & (t[:-1] + n[:-1] == t[1:]))


LAYOUT_PAIRS = [  # (model heads, kv heads, mla), (tp, dcp) prefill, (tp, dcp) decode
    ((4, 2, False), (1, 1), (1, 2)),
    ((4, 2, False), (2, 1), (2, 2)),  # replica layout on the decode side (world 4)
    ((4, 2, False), (1, 1), (2, 2)),  # the decode rank holds a subset of the prefill rank's heads
    ((4, 2, False), (2, 1), (1, 1)),  # one decode rank reads from two prefill ranks
    ((4, 2, False), (1, 2), (1, 2)),
    ((8, 4, False), (4, 1), (2, 4)),
    ((4, 1, True), (1, 1), (2, 2)),
    ((4, 1, True), (2, 1), (2, 2)),  # MLA: two prefill copies of the latent, spread over decode ranks
]


@pytest.mark.parametrize(("model", "src_par", "dst_par"), LAYOUT_PAIRS)
def test_descriptors_copy_exactly_what_each_decode_rank_owns(model, src_par, dst_par):
    heads, kv_heads, mla = model
    src_layout = ParallelLayout.build(*src_par, heads, kv_heads, mla)
    dst_layout = ParallelLayout.build(*dst_par, heads, kv_heads, mla)
    rng = random.Random(hash((model, src_par, dst_par)) & 0xFFFF)
    for _ in range(6):
        bs, bd = rng.choice([2, 4, 8]), rng.choice([2, 4, 8])
        src_spec = DcpSpec(bs, rng.choice([i for i in (1, 2, 4, 8) if bs % i == 0]), src_layout.dcp)
        dst_spec = DcpSpec(bd, rng.choice([i for i in (1, 2, 4, 8) if bd % i == 0]), dst_layout.dcp)
        run_case(rng, src_layout, dst_layout, src_spec, dst_spec, rng.random() < 0.5, rng.random() < 0.5)


def smollm2_counts(interleave: int, n: int, head_major: bool = True) -> list[int]:
    """Descriptors per decode rank: SmolLM2 shape (30 layers, K/V, 3 KV heads, fp32 dim 64), B64, dcp1 -> dcp2."""
    layout1 = ParallelLayout.build(1, 1, 9, 3, False)
    layout2 = ParallelLayout.build(1, 2, 9, 3, False)
    src_geo = geometry(30, 2, 64, 64, 3, head_major, 256)
    dst_geo = geometry(30, 2, 64, 64, 3, head_major, 256)
    src = PullSide(DcpSpec(64, 64, 1), list(range(0, 64, 2)), {0: src_geo})  # blocks never adjacent
    counts = []
    for rank in range(2):
        dst = PullSide(DcpSpec(64, interleave, 2), list(range(0, 64, 2)), {rank: dst_geo})
        d = plan_pull(src, dst, rank, rank, kv_head_sources(layout1, layout2, rank), 0, n - 1)
        counts.append(len(d[0]))
        assert d[0].nbytes == 30 * 2 * 3 * 256 * 64 * dcp.blocks_needed(n, 64, 2)
    return counts


@pytest.mark.parametrize(
    ("interleave", "n", "expected"),
    [
        (64, 512, [4, 4]),  # one per block: the cache is block-major, a block of all layers and K/V is contiguous
        (64, 2048, [16, 16]),
        (64, 70, [1, 1]),  # the stretched final run: a partial block is one descriptor too
        (64, 500, [4, 4]),
        (16, 512, [2880, 2880]),  # (B / I) x heads per block per layer per K/V
        (16, 2048, [11520, 11520]),
        (1, 512, [46080, 45900]),  # B x heads; rank 1 does not read position 511 (computed on decode)
        (1, 2048, [184320, 184140]),
    ],
)
def test_smollm2_descriptor_counts(interleave, n, expected):
    assert smollm2_counts(interleave, n) == expected


def test_token_major_caches_at_interleave_equal_block_size_are_one_descriptor_per_block():
    assert smollm2_counts(64, 512, head_major=False) == [4, 4]
    assert smollm2_counts(16, 512, head_major=False) == [960, 960]  # (B / I) runs per block per layer per K/V


@pytest.mark.parametrize(("head_major", "per_block"), [(True, 2 * 2), (False, 2 * 2 * 8)])
def test_a_decode_rank_holding_part_of_the_heads_cannot_merge_across_layers(head_major, per_block):
    """tp1 -> tp2/dcp2 at interleave = block size (2 layers, K/V, 2 KV heads, B8): each decode rank holds one of
    the prefill rank's two heads, so the other head lies between its layers on the prefill side: one descriptor per
    layer and K/V per block (head-major), one per token of those (token-major)."""
    src_layout, dst_layout = ParallelLayout.build(1, 1, 4, 2, False), ParallelLayout.build(2, 2, 4, 2, False)
    src = PullSide(DcpSpec(8, 8, 1), list(range(0, 16, 2)), {0: geometry(2, 2, 16, 8, 2, head_major)})
    for rank in range(dst_layout.world_size):
        dst_geo = geometry(2, 2, 16, 8, 1, head_major)
        dst = PullSide(DcpSpec(8, 8, 2), list(range(0, 16, 2)), {rank: dst_geo})
        role = dst_layout.role(rank)
        pulls = plan_pull(src, dst, rank, role.dcp_rank, kv_head_sources(src_layout, dst_layout, rank), 0, 32)
        assert len(pulls[0]) == 2 * per_block  # two blocks per decode rank


def test_coalesce_merges_only_what_is_contiguous_on_both_sides():
    s, d, n = coalesce(np.array([0, 8, 100, 30]), np.array([0, 8, 16, 24]), np.array([8, 8, 8, 8]))
    assert (s.tolist(), d.tolist(), n.tolist()) == ([0, 100, 30], [0, 16, 24], [16, 8, 8])


def test_bad_tables_and_geometries_are_errors_not_reads():
    layout = ParallelLayout.build(1, 1, 4, 2, False)
    geo = geometry(2, 2, 4, 4, 2, True)
    src = PullSide(DcpSpec(4, 4, 1), [0, 1, 9], {0: geo})
    dst = PullSide(DcpSpec(4, 4, 1), [0, 1, 2], {0: geo})
    heads = kv_head_sources(layout, layout, 0)
    with pytest.raises(ValueError, match=r"outside 0\.\.3"):
        plan_pull(src, dst, 0, 0, heads, 0, 11)
    with pytest.raises(ValueError, match="has 2 blocks; 11 tokens need 3"):
        plan_pull(PullSide(src.spec, [0, 1], src.geometries), dst, 0, 0, heads, 0, 11)
    other = geometry(3, 2, 4, 4, 2, True)
    with pytest.raises(ValueError, match="does not match"):
        plan_pull(PullSide(src.spec, [0, 1, 2], {0: other}), dst, 0, 0, heads, 0, 11)


def test_head_sources_cover_every_decode_head_once_for_every_layout_pair():
    for heads, kv, mla in ((8, 1, False), (8, 2, False), (12, 3, False), (8, 4, False), (8, 1, True)):
        for tp_p in (1, 2, 4):
            for tp_d in (1, 2, 4):
                for dcp_p in (1, 2, 4):
                    for dcp_d in (1, 2, 4):
                        try:
                            src = ParallelLayout.build(tp_p, dcp_p, heads, kv, mla)
                            dst = ParallelLayout.build(tp_d, dcp_d, heads, kv, mla)
                        except ValueError:
                            continue
                        for rank in range(dst.world_size):
                            role = dst.role(rank)
                            got = []
                            for h in kv_head_sources(src, dst, rank):
                                first = src.role(h.src_ranks[0])
                                for j in range(h.count):
                                    got.append(first.kv_head_start + h.src_head + j)
                                    assert all(src.role(r).kv_head_start == first.kv_head_start for r in h.src_ranks)
                            assert got == list(range(role.kv_head_start, role.kv_head_start + role.kv_heads))


def test_replicated_prefill_groups_are_spread_over_decode_ranks():
    src = ParallelLayout.build(2, 1, 4, 1, True)  # MLA tp2: both ranks hold the whole latent
    dst = ParallelLayout.build(2, 2, 4, 1, True)
    assert [kv_head_sources(src, dst, r)[0].src_ranks for r in range(2)] == [(0,), (1,)]


@pytest.mark.parametrize("name", ["torch", "cpu", "triton"])
def test_the_layout_table_knows_which_backends_read_a_head_major_cache(name):
    from engine.attention.kv_layout import HEAD_MAJOR_BACKENDS
    from engine.attention.registry import create_backend

    assert create_backend(name).head_major_cache == (name in HEAD_MAJOR_BACKENDS)

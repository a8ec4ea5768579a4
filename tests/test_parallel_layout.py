"""Rank roles and process groups of both DCP layouts."""

import pytest

from engine.parallel_layout import ParallelLayout, layout_problems


def test_dcp_inside_tp_group_for_mla():
    layout = ParallelLayout.build(tp=4, dcp=2, num_heads=16, num_kv_heads=1, is_mla=True)
    assert (layout.replication, layout.replicas, layout.world_size, layout.kind) == (4, 1, 4, "tp")
    assert layout.dcp_groups() == [[0, 1], [2, 3]]
    assert [r.dcp_rank for r in layout.roles()] == [0, 1, 0, 1]
    assert layout.tp_groups() == [[0, 1, 2, 3]]


def test_replica_layout_when_tp_cannot_replicate_kv():
    layout = ParallelLayout.build(tp=1, dcp=2, num_heads=9, num_kv_heads=3, is_mla=False)
    assert (layout.replication, layout.replicas, layout.world_size, layout.kind) == (1, 2, 2, "replica")
    assert layout.dcp_groups() == [[0, 1]]
    assert layout.tp_groups() == [[0], [1]]
    assert layout.query_groups() == [[0], [1]]
    assert [(r.replica, r.dcp_rank) for r in layout.roles()] == [(0, 0), (1, 1)]


def test_mixed_layout_gathers_queries_inside_a_replica():
    # 2 KV heads over tp 4: R = 2; dcp 4 = 2 query sets x 2 replicas; world 8.
    layout = ParallelLayout.build(tp=4, dcp=4, num_heads=8, num_kv_heads=2, is_mla=False)
    assert (layout.replication, layout.replicas, layout.q_span, layout.world_size) == (2, 2, 2, 8)
    assert layout.dcp_groups() == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert layout.query_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    roles = layout.roles()
    for group in layout.dcp_groups():
        assert [roles[g].dcp_rank for g in group] == [0, 1, 2, 3]
        assert len({roles[g].kv_head_start for g in group}) == 1


def test_kv_heads_per_rank_split_and_replicated():
    split = ParallelLayout.build(tp=2, dcp=1, num_heads=8, num_kv_heads=4, is_mla=False)
    assert [(r.kv_head_start, r.kv_heads) for r in split.roles()] == [(0, 2), (2, 2)]
    replicated = ParallelLayout.build(tp=4, dcp=1, num_heads=8, num_kv_heads=2, is_mla=False)
    assert [r.kv_head_start for r in replicated.roles()] == [0, 0, 1, 1]


@pytest.mark.parametrize(
    ("tp", "dcp", "heads", "kv", "field", "text"),
    [
        (2, 1, 9, 3, "parallel.tp", "parallel.tp=2 does not divide the model's 9 attention heads; use tp in 1, 3, 9"),
        (4, 1, 12, 3, "parallel.tp", "neither divides nor is a multiple of the model's 3 KV heads"),
        (4, 3, 8, 2, "parallel.dcp", "parallel.dcp=3 neither divides nor is a multiple of the KV replication R=2"),
        (4, 3, 8, 1, "parallel.dcp", "use dcp in 1, 2, 4, 8"),
        (0, 1, 8, 2, "parallel.tp", "parallel.tp=0 must be >= 1"),
    ],
)
def test_layout_problems_name_field_and_fix(tp, dcp, heads, kv, field, text):
    problems = layout_problems(tp, dcp, heads, kv, is_mla=False)
    assert [f for f, _ in problems] == [field]
    assert text in problems[0][1]


def test_build_raises_with_every_reason():
    with pytest.raises(ValueError, match=r"parallel\.dcp=3"):
        ParallelLayout.build(tp=2, dcp=3, num_heads=8, num_kv_heads=1, is_mla=True)

"""The placement owner: each rank's heads and slices, the fallbacks, weights per rank and collectives per step."""

from __future__ import annotations

import itertools

import pytest

from engine.checkpoints.model_info import read_model_info, safetensors_entries
from engine.parallel_layout import ParallelLayout, layout_problems
from engine.placement.collectives import collectives, per_step_count
from engine.placement.split import DensePlacement
from engine.placement.weights import weight_bytes, weight_shares
from tests.conftest import mla_fields, write_config

SMOLLM2 = {
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "num_hidden_layers": 30,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
}
DEEPSEEK_V2_LITE = mla_fields(
    hidden_size=2048,
    num_attention_heads=16,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    q_lora_rank=None,
    intermediate_size=10944,
    moe_intermediate_size=1408,
    n_routed_experts=64,
    n_shared_experts=2,
    first_k_dense_replace=1,
    num_hidden_layers=27,
    vocab_size=102400,
)


def placement(tmp_path, fields: dict, tp: int, dcp: int, dense: str = "sharded", comm: str = "a2a"):
    info = read_model_info(write_config(tmp_path / "model", **fields))
    layout = ParallelLayout.build(tp, dcp, info.num_heads, info.num_kv_heads, info.is_mla)
    return DensePlacement.build(layout, info, dense, comm)


def test_smollm2_tp1_dcp2_splits_576_columns_through_head_4(tmp_path):
    p = placement(tmp_path, SMOLLM2, 1, 2)
    r0, r1 = p.ranks()
    assert p.sharded and p.o_proj.group == p.mlp.group == p.vocab.group == "world"
    assert r0.q_heads == r0.attended == r1.attended == range(9)  # every rank projects all 9 heads: no gather
    assert (r0.merge_columns, r1.merge_columns) == (range(0, 288), range(288, 576))
    assert (r0.merge_heads, r1.merge_heads) == (range(0, 5), range(4, 9))
    assert not r0.head_aligned
    assert (r0.o_proj.span(576), r1.o_proj.span(576)) == (range(0, 288), range(288, 576))
    assert (r0.mlp.span(1536), r1.mlp.span(1536)) == (range(0, 768), range(768, 1536))
    assert r0.vocab.padded(49152) == (24576, range(0, 24576))
    assert r0.computes_logits and r1.computes_logits
    assert p.notes() == [
        "o_proj input: 576 columns of a DCP group split 288 per rank (9 heads do not divide dcp=2, so slices cut "
        "heads; prefill attention computes up to 5 heads per rank)"
    ]


def test_replicated_placement_is_todays_layout(tmp_path):
    p = placement(tmp_path, SMOLLM2, 1, 2, dense="replicated", comm="ag_rs")
    r0, r1 = p.ranks()
    assert not p.sharded and p.o_proj.group == "tp" and p.o_proj.parts == 1
    assert r1.merge_columns == range(576) and r1.o_proj.span(576) == range(576)
    assert r0.computes_logits and not r1.computes_logits


def test_deepseek_v2_lite_tp2_dcp4_merges_four_whole_heads_per_rank(tmp_path):
    p = placement(tmp_path, DEEPSEEK_V2_LITE, 2, 4)
    shares = p.ranks()
    assert [s.attended for s in shares] == [range(16)] * 4
    assert [s.merge_columns for s in shares] == [range(2048 * j, 2048 * (j + 1)) for j in range(4)]
    assert [s.o_proj.span(16) for s in shares] == [range(4 * j, 4 * j + 4) for j in range(4)]
    assert all(s.head_aligned and not s.gather_queries for s in shares)
    assert [s.moe.span(1408) for s in shares][3] == range(1056, 1408)
    assert p.mlp.layers == range(1) and p.moe.layers == range(1, 27)


def test_tiny_gqa_six_heads_tp1_dcp4_slices_cross_heads_and_kv_groups(tmp_path):
    p = placement(tmp_path, {"num_attention_heads": 6, "hidden_size": 96, "head_dim": 16}, 1, 4)
    assert [s.merge_columns for s in p.ranks()] == [range(0, 24), range(24, 48), range(48, 72), range(72, 96)]
    assert [s.merge_heads for s in p.ranks()] == [range(0, 2), range(1, 3), range(3, 5), range(4, 6)]


def _valid_grid():
    for heads, kv, tp, dcp, mla in itertools.product(
        (2, 4, 6, 8, 9, 12), (1, 2, 3, 4), (1, 2, 4), (1, 2, 3, 4, 8), (0, 1)
    ):
        kv = 1 if mla else kv
        if heads % kv == 0 and not layout_problems(tp, dcp, heads, kv, bool(mla)):
            yield heads, kv, tp, dcp, bool(mla)


@pytest.mark.parametrize("dense", ["replicated", "sharded"])
def test_every_layout_partitions_the_output_and_attends_its_groups_heads(tmp_path, dense):
    checked = 0
    for heads, kv, tp, dcp, mla in _valid_grid():
        fields = mla_fields(num_attention_heads=heads) if mla else {"num_attention_heads": heads}
        fields.update(num_key_value_heads=kv, head_dim=16, hidden_size=16 * heads)
        p = placement(tmp_path / f"{heads}-{kv}-{tp}-{dcp}-{mla}", fields, tp, dcp, dense)
        layout, dv, do = p.layout, (32 if mla else 16), 16
        shares = p.ranks()
        for group in layout.dcp_groups():
            members = [shares[g] for g in group]
            assert len({s.attended for s in members}) == 1  # a DCP group attends one set of heads
            heads_cols = {c for s in members for c in s.merge_columns}
            assert heads_cols == set(range(members[0].attended.start * dv, members[0].attended.stop * dv))
            if layout.kind != "replica" or p.o_proj.group == "tp":  # query groups of a replica get their heads
                assert all(
                    s.merge_heads == range(s.rank % tp * heads // tp, (s.rank % tp + 1) * heads // tp) for s in members
                )
        o_cols = sorted(c for s in shares for c in s.o_proj.span(heads * do))
        copies = 1 if p.o_proj.group == "world" else layout.replicas
        assert o_cols == sorted(list(range(heads * do)) * copies)  # the o_proj input is split, never lost
        for s in shares:
            assert s.q_heads.start >= s.attended.start and s.q_heads.stop <= s.attended.stop
            assert s.gather_queries == (not p.sharded and layout.q_span > 1)
            if p.o_proj.group == "world" and not mla:
                assert s.merge_columns == s.o_proj.span(heads * dv)  # o_proj reads exactly what it merged
            if mla:
                assert s.merge_heads == s.o_proj.span(heads) and s.head_aligned
        checked += 1
    assert checked > 40


def test_mla_heads_that_do_not_divide_dcp_fall_back_to_tp_with_the_reason(tmp_path):
    p = placement(tmp_path, mla_fields(num_attention_heads=2, hidden_size=64), 1, 4)
    assert p.o_proj.group == "tp" and p.mlp.group == "world"
    assert p.fallbacks == [
        "layers 0-1 o_proj: not split over the 4 ranks (MLA merges whole heads and 2 heads do not divide dcp=4); "
        "split over tp=1 as with parallel.dense=replicated"
    ]
    assert [s.merge_starts for s in p.ranks()] == [(0, 0, 0, 0)] * 4 and p.rank(3).merge_width == 64


def test_mlp_that_does_not_divide_the_world_falls_back_per_module(tmp_path):
    p = placement(tmp_path, {"intermediate_size": 126}, 1, 4)
    assert (p.o_proj.group, p.mlp.group, p.vocab.group) == ("world", "tp", "world")
    assert p.fallbacks == [
        "layers 0-1 mlp: not split over the 4 ranks (intermediate_size=126 % 4 != 0); "
        "split over tp=1 as with parallel.dense=replicated"
    ]
    assert p.rank(2).mlp.span(126) == range(126)


def test_sharded_without_replicas_says_it_changes_nothing(tmp_path):
    p = placement(tmp_path, mla_fields(), 2, 2)
    assert not p.sharded and p.o_proj.group == "tp"
    assert p.notes() == [
        "parallel.dense=sharded: no replica ranks (dcp=2 divides R=2), so the dense layers are tensor-parallel "
        "over all 2 ranks either way"
    ]


def test_smollm2_weights_per_rank_shrink_to_0_56(tmp_path):
    replicated = placement(tmp_path / "a", SMOLLM2, 1, 2, dense="replicated")
    sharded = placement(tmp_path / "b", SMOLLM2, 1, 2)
    assert weight_bytes(replicated, 1, 4) == 134_515_008 * 4  # the whole model, tied embedding once
    q, kv, o, mlp, norms = 576 * 576, 2 * 192 * 576, 576 * 288, 3 * 768 * 576, 2 * 576
    assert weight_bytes(sharded, 1, 4) == 4 * (30 * (q + kv + o + mlp + norms) + 24576 * 576 + 576)
    assert weight_bytes(sharded, 0, 4) / weight_bytes(replicated, 0, 4) == pytest.approx(0.562, abs=1e-3)


def test_deepseek_v2_lite_tp2_dcp4_weights(tmp_path):
    replicated = placement(tmp_path / "a", DEEPSEEK_V2_LITE, 2, 4, dense="replicated")
    sharded = placement(tmp_path / "b", DEEPSEEK_V2_LITE, 2, 4)
    whole = placement(tmp_path / "c", DEEPSEEK_V2_LITE, 1, 1)
    assert weight_bytes(whole, 0, 2) / 2 == pytest.approx(15.71e9, rel=1e-3)
    assert weight_bytes(replicated, 3, 2) / 2 == pytest.approx(7.87e9, rel=1e-3)
    # q_proj and W_UK for all 16 heads (Helix repeats them), W_UV / o_proj / MoE / vocab over 4 ranks
    assert weight_bytes(sharded, 3, 2) / 2 == pytest.approx(4.105e9, rel=1e-3)
    router = next(s for s in weight_shares(sharded, 0) if s.module == "router")
    assert router.fp32 and router.copies == 26


def test_smollm2_collectives_per_decode_step(tmp_path):
    today = placement(tmp_path / "a", SMOLLM2, 1, 2, dense="replicated", comm="ag_rs")
    assert [(c.where, c.op, c.group, c.bytes_per_token) for c in collectives(today, 4)] == [
        ("attention: combine (LSE)", "all_gather", "dcp", 36),
        ("attention: combine", "reduce_scatter", "dcp", 2304),
    ]
    assert per_step_count(collectives(today, 4)) == 60
    replicated_a2a = placement(tmp_path / "b", SMOLLM2, 1, 2, dense="replicated")
    assert per_step_count(collectives(replicated_a2a, 4)) == 30
    sharded = collectives(placement(tmp_path / "c", SMOLLM2, 1, 2), 4)
    assert [(c.where, c.op, c.group, c.ranks, c.bytes_per_token) for c in sharded] == [
        ("attention: combine", "all_to_all", "dcp", 2, 1188),
        ("o_proj", "all_reduce", "world", 2, 2304),
        ("mlp", "all_reduce", "world", 2, 2304),
        ("embedding", "all_reduce", "world", 2, 2304),
        ("lm head", "gather", "world", 2, 98304),
    ]
    assert per_step_count(sharded) == 92
    sharded_ag_rs = placement(tmp_path / "d", SMOLLM2, 1, 2, comm="ag_rs")
    assert per_step_count(collectives(sharded_ag_rs, 4)) == 122


def test_deepseek_v2_lite_tp2_dcp4_collectives_bf16(tmp_path):
    today = collectives(placement(tmp_path / "a", DEEPSEEK_V2_LITE, 2, 4, dense="replicated", comm="ag_rs"), 2)
    assert [(c.where, c.ranks, c.bytes_per_token) for c in today][:5] == [
        ("attention: query gather", 2, 9216),
        ("attention: combine (LSE)", 4, 192),
        ("attention: combine", 4, 49152),
        ("o_proj", 2, 4096),
        ("mlp", 2, 4096),
    ]
    sharded = collectives(placement(tmp_path / "b", DEEPSEEK_V2_LITE, 2, 4), 2)
    assert [(c.where, c.layers, c.ranks, c.bytes_per_token) for c in sharded][:4] == [
        ("attention: combine", range(27), 4, 12480),
        ("o_proj", range(27), 4, 6144),
        ("mlp", range(1), 4, 6144),
        ("moe", range(1, 27), 4, 6144),
    ]


@pytest.mark.parametrize(
    ("arch", "sizes"),
    [
        ("llama", {}),
        ("llama", {"tie_word_embeddings": True, "num_kv_heads": 1}),
        ("qwen2", {}),
        ("deepseek_v2", {}),
        ("deepseek_v2", {"q_lora_rank": 24}),
        ("deepseek_v2", {"n_routed_experts": 0}),
    ],
)
def test_whole_model_weights_equal_the_checkpoint(tiny_models, arch, sizes):
    folder = tiny_models(arch, **sizes)
    info = read_model_info(folder)
    layout = ParallelLayout.build(1, 1, info.num_heads, info.num_kv_heads, info.is_mla)
    total = weight_bytes(DensePlacement.build(layout, info), 0, 4)
    assert total == sum(size for _, _, size in safetensors_entries(folder))


def test_comm_backend_auto_is_a2a_only_with_the_sharded_placement(tmp_path):
    assert placement(tmp_path / "a", SMOLLM2, 1, 2, comm="auto").comm_backend == "a2a"
    assert placement(tmp_path / "b", SMOLLM2, 1, 2, dense="replicated", comm="auto").comm_backend == "ag_rs"
    assert placement(tmp_path / "c", SMOLLM2, 1, 1, comm="auto").comm_backend == "ag_rs"  # no replicas: no Helix
    assert placement(tmp_path / "d", SMOLLM2, 1, 2, comm="ag_rs").comm_backend == "ag_rs"  # an explicit choice wins

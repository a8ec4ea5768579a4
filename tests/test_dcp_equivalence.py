"""Every TP/DCP layout under torchrun (gloo, CPU) gives HF's greedy tokens and logprobs, and stores 1/dcp.

Each case is a real `dcpctl run` of several ranks on a tiny checkpoint. Prompt lengths are chosen to
not be multiples of interleave, block size or block_size * dcp, and to be shorter than dcp * interleave
(some ranks hold nothing for that sequence).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engine.placement.weights import weight_bytes
from engine.plan.checks import validate_plan_file
from tests.oracle import LOGPROB_TOL, hf_greedy, prompt_ids, read_jsonl, write_plan

pytestmark = pytest.mark.multiproc

LENGTHS = [1, 3, 31, 33, 47, 100, 130]
NEW_TOKENS = 24

MLA = ("deepseek_v2", {})
MLA2 = ("deepseek_v2", {"num_heads": 2})  # 2 heads cannot be merged whole over dcp 4: o_proj stays on tp
KV1 = ("llama", {"num_kv_heads": 1})
KV2 = ("llama", {"num_kv_heads": 2})
KV2_6x16 = (
    "llama",
    {"num_kv_heads": 2, "num_heads": 6, "head_dim": 16, "hidden_size": 96},
)  # slices of 24 columns cut heads
KV2_I126 = ("llama", {"num_kv_heads": 2, "intermediate_size": 126})  # 126 % 4: the MLP stays on tp
SHARDED = {"parallel.dense": "sharded"}
REPLICATED = {"parallel.dense": "replicated"}  # the placement before Helix (no longer the default)
A2A = {"parallel.dcp_comm_backend": "a2a"}
AG_RS = {"parallel.dcp_comm_backend": "ag_rs"}  # auto runs a2a with the sharded placement

CASES = {
    # name: (model, settings)
    "mla-tp2-dcp1-b16": (MLA, {"parallel.tp": 2}),
    "mla-tp2-dcp1-b64": (MLA, {"parallel.tp": 2, "cache.block_size": 64}),
    "mla-tp2-dcp2-i1-b16": (MLA, {"parallel.tp": 2, "parallel.dcp": 2, "parallel.interleave": 1}),
    "mla-tp2-dcp2-i2-b16-chunked": (
        MLA,
        {"parallel.tp": 2, "parallel.dcp": 2, "parallel.interleave": 2, "scheduler.max_num_batched_tokens": 24},
    ),
    "mla-tp2-dcp2-i16-b16": (MLA, {"parallel.tp": 2, "parallel.dcp": 2, "parallel.interleave": 16}),
    "mla-tp2-dcp2-i1-b64": (MLA, {"parallel.tp": 2, "parallel.dcp": 2, "cache.block_size": 64}),
    "mla-tp2-dcp2-i2-b64": (
        MLA,
        {"parallel.tp": 2, "parallel.dcp": 2, "parallel.interleave": 2, "cache.block_size": 64},
    ),
    "mla-tp2-dcp2-i64-b64": (
        MLA,
        {"parallel.tp": 2, "parallel.dcp": 2, "parallel.interleave": 64, "cache.block_size": 64},
    ),
    # 2 layers x (32 + 8) x 4 B = 320 B/token/rank: 40 KiB = 8 blocks of 16 per rank = 256 tokens over dcp 2
    "mla-tp2-dcp2-i16-b16-preempt": (
        MLA,
        {
            "parallel.tp": 2,
            "parallel.dcp": 2,
            "parallel.interleave": 16,
            "cache.memory": "40KiB",
            "model.max_model_len": 250,
            "scheduler.max_num_batched_tokens": 64,
        },
    ),
    "gqa1-tp2-dcp2-i1": (KV1, {"parallel.tp": 2, "parallel.dcp": 2}),
    "mla-tp2-dcp2-i2-b16-cpu-backend": (
        MLA,
        {"parallel.tp": 2, "parallel.dcp": 2, "parallel.interleave": 2, "attention.backend": "cpu"},
    ),
    "gqa2-tp1-dcp2-i4-chunked-replica-cpu-backend": (
        KV2,
        {
            **REPLICATED,
            "parallel.dcp": 2,
            "parallel.interleave": 4,
            "scheduler.max_num_batched_tokens": 24,
            "attention.backend": "cpu",
        },
    ),
    # without DCP the cpu backend attends to a chunk's cached context and its new tokens in one kernel call
    "gqa2-tp2-dcp1-chunked-cpu-backend": (
        KV2,
        {"parallel.tp": 2, "scheduler.max_num_batched_tokens": 24, "attention.backend": "cpu"},
    ),
    "gqa1-tp2-dcp1-chunked-cpu-backend": (
        KV1,
        {"parallel.tp": 2, "scheduler.max_num_batched_tokens": 24, "attention.backend": "cpu"},
    ),
    "gqa2-tp1-dcp2-i4-chunked-replica": (
        KV2,
        {**REPLICATED, "parallel.dcp": 2, "parallel.interleave": 4, "scheduler.max_num_batched_tokens": 24},
    ),
    "gqa2-tp2-dcp2-i16-replica": (
        KV2,
        {**REPLICATED, "parallel.tp": 2, "parallel.dcp": 2, "parallel.interleave": 16},
    ),
    # the dense placement (parallel.dense) and the all-to-all combine (issue 19)
    "gqa2-tp1-dcp2-i4-sharded-a2a-chunked": (
        KV2,
        {**SHARDED, **A2A, "parallel.dcp": 2, "parallel.interleave": 4, "scheduler.max_num_batched_tokens": 24},
    ),
    "gqa2-tp1-dcp2-i1-sharded-ag_rs": (KV2, {**SHARDED, **AG_RS, "parallel.dcp": 2}),
    "gqa2-tp1-dcp2-i4-replicated-a2a-cpu-backend": (
        KV2,
        {**REPLICATED, **A2A, "parallel.dcp": 2, "parallel.interleave": 4, "attention.backend": "cpu"},
    ),
    "gqa2x6-tp1-dcp4-i2-sharded-a2a-chunked": (
        KV2_6x16,
        {**SHARDED, **A2A, "parallel.dcp": 4, "parallel.interleave": 2, "scheduler.max_num_batched_tokens": 24},
    ),
    "gqa1-tp2-dcp4-i16-sharded-ag_rs": (
        KV1,
        {**SHARDED, **AG_RS, "parallel.tp": 2, "parallel.dcp": 4, "parallel.interleave": 16},
    ),
    "gqa1-tp2-dcp2-i1-a2a": (KV1, {**A2A, "parallel.tp": 2, "parallel.dcp": 2}),
    "mla-tp1-dcp2-i2-sharded-a2a-chunked-cpu-backend": (
        MLA,
        {
            **SHARDED,
            **A2A,
            "parallel.dcp": 2,
            "parallel.interleave": 2,
            "scheduler.max_num_batched_tokens": 24,
            "attention.backend": "cpu",
        },
    ),
    "mla-tp1-dcp4-i1-sharded-ag_rs": (MLA, {**SHARDED, **AG_RS, "parallel.dcp": 4}),
    # 320 B/token/rank: 40 KiB = 8 blocks of 16 per rank = 512 tokens over dcp 4, for 7 sequences of up to 154
    "mla-tp2-dcp4-i16-sharded-a2a-preempt": (
        MLA,
        {
            **SHARDED,
            **A2A,
            "parallel.tp": 2,
            "parallel.dcp": 4,
            "parallel.interleave": 16,
            "cache.memory": "40KiB",
            "model.max_model_len": 250,
            "scheduler.max_num_batched_tokens": 64,
        },
    ),
    "mla-tp2-dcp4-i16-replicated-a2a": (
        MLA,
        {**REPLICATED, **A2A, "parallel.tp": 2, "parallel.dcp": 4, "parallel.interleave": 16},
    ),
    "mla-tp2-dcp2-i16-b64-a2a": (
        MLA,
        {**A2A, "parallel.tp": 2, "parallel.dcp": 2, "parallel.interleave": 16, "cache.block_size": 64},
    ),
    "mla2-tp1-dcp4-sharded-a2a-o_proj-fallback": (MLA2, {**SHARDED, **A2A, "parallel.dcp": 4}),
    "gqa2-tp1-dcp4-sharded-a2a-mlp-fallback": (KV2_I126, {**SHARDED, **A2A, "parallel.dcp": 4}),
}


def dcpctl_run(plan, prompts_file, out, stats_dir, new_tokens=NEW_TOKENS, timeout=300):
    env = dict(os.environ, DCPCTL_RANK_STATS_DIR=str(stats_dir))
    cmd = [
        sys.executable,
        "-m",
        "dcpctl.cli",
        "run",
        str(plan),
        "--prompts-file",
        str(prompts_file),
        "--max-tokens",
        str(new_tokens),
        "--ignore-eos",
        "--logprobs",
        "1",
        "--output",
        str(out),
    ]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return read_jsonl(out), [json.loads(p.read_text()) for p in sorted(stats_dir.glob("rank*.json"))]


@pytest.mark.parametrize("case", list(CASES))
def test_layout_matches_hf_and_shards_cache(tmp_path, tiny_models, case):
    (arch, sizes), settings = CASES[case]
    folder = tiny_models(arch, **sizes)
    prompts = prompt_ids(len(LENGTHS), LENGTHS, seed=11)
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts))
    plan = write_plan(tmp_path, folder, settings)
    report = validate_plan_file(plan)
    assert report.valid, report.problems.errors
    stats_dir = tmp_path / "stats"
    records, stats = dcpctl_run(plan, prompts_file, tmp_path / "out.jsonl", stats_dir)

    for ids, record in zip(prompts, records, strict=True):
        tokens, logprobs = hf_greedy(folder, ids, NEW_TOKENS)
        assert record["token_ids"] == tokens, f"{case}: prompt of {len(ids)} tokens diverged"
        ours = [lp["logprob"] for lp in record["logprobs"]]
        assert max(abs(a - b) for a, b in zip(ours, logprobs, strict=True)) < LOGPROB_TOL

    # every rank allocated exactly what `dcpctl plan show` reports, and the layout has the planned ranks
    res = report.resolved
    assert len(stats) == res.world_size
    assert {s["kv_cache_bytes"] for s in stats} == {res.kv.bytes_per_rank}
    assert sorted({s["dcp_rank"] for s in stats}) == list(range(res.plan.parallel.dcp))
    assert [s["weight_bytes"] for s in stats] == [weight_bytes(res.placement, s["rank"], 4) for s in stats]
    if "fallback" in case:
        assert res.placement.fallbacks and res.placement.fallbacks[0] in report.problems.notes
    if "preempt" in case:
        assert any(r["num_preemptions"] for r in records)


def test_dcp_doubles_token_capacity_at_the_same_budget(tmp_path, tiny_models):
    folder = tiny_models(MLA[0], **MLA[1])
    one = validate_plan_file(write_plan(tmp_path, folder, {"parallel.tp": 2}, "a.yaml")).resolved
    two = validate_plan_file(write_plan(tmp_path, folder, {"parallel.tp": 2, "parallel.dcp": 2}, "b.yaml")).resolved
    assert one.kv.bytes_per_rank == two.kv.bytes_per_rank
    assert two.kv.token_capacity == 2 * one.kv.token_capacity

"""`dcpctl plan suggest --pd`: every suggested prefill -> decode pair is two plan files `plan validate` accepts, the
hand-off is what the engine's planner counts (one descriptor per block at interleave = block size: the KV cache is
block-major across layers),
and a rejected pair names the rule."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from dcpctl.cli import app
from engine import devices
from engine.kv_transfer import summary, transport
from engine.plan.checks import validate_plan_file
from engine.plan.disagg import handoff_side
from engine.suggest.figures import Cluster
from engine.suggest.models import planned_model
from engine.suggest.pd import prefill_path, suggest_pd, write_pair
from engine.suggest.suggest import Request
from tests.conftest import write_config
from tests.test_plan_suggest import TEST_CPU

runner = CliRunner()
MiB = 2**20


@pytest.fixture
def gqa_request(tmp_path):
    """A config-only Llama (8 heads / 2 KV heads, 2 layers) on a 4-core CPU node, block size 16, 512 tokens."""
    folder = write_config(tmp_path / "m", num_attention_heads=8, num_key_value_heads=2)
    cluster = Cluster(TEST_CPU, 4, 1)
    return Request(planned_model(str(folder)), cluster, 512, 2, block_size=16, kv_memory=MiB)


def _pair(result, prefill, decode):
    """The accepted pair of prefill and decode (tp, dcp, interleave) whose decode side keeps its dense layers whole
    per replica and combines with ag_rs."""
    for p in result.accepted:
        a, b = p.prefill.plan.parallel, p.decode.plan.parallel
        layouts = ((a.tp, a.dcp, a.interleave), (b.tp, b.dcp, b.interleave), p.decode.placement.sharded)
        if layouts == (prefill, decode, False) and b.dcp_comm_backend == "ag_rs":
            return p
    raise AssertionError(f"no pair {prefill} -> {decode}")


def test_every_suggested_pair_validates_as_two_files(gqa_request, tmp_path):
    result = suggest_pd(gqa_request)
    assert len(result.accepted) > 10
    for i, pair in enumerate(result.accepted):
        assert pair.ranks <= 4
        decode_file, prefill_file = write_pair(pair, tmp_path / f"pair{i}.yaml")
        assert prefill_file == prefill_path(decode_file) == tmp_path / f"pair{i}_prefill.yaml"
        prefill = validate_plan_file(prefill_file)
        assert prefill.valid, (pair.name, prefill.problems.errors)
        check = validate_plan_file(decode_file)
        assert check.valid, (pair.name, check.problems.errors)
        res = check.resolved
        assert res.disagg.prefill_name == pair.prefill.name
        assert res.kv.token_capacity == pair.decode.check.resolved.kv.token_capacity
        assert res.plan.parallel == pair.decode.plan.parallel
    # the decode side's choices that only change the decode step are enumerated; the prefill side's are not
    assert {p.decode.plan.parallel.dcp_comm_backend for p in result.accepted} == {"ag_rs", "a2a"}
    assert {p.prefill.plan.parallel.dcp_comm_backend for p in result.accepted} == {"ag_rs"}
    # capacity first: the best pair's decode side holds the most tokens
    best = result.accepted[0].decode.check.resolved.kv.token_capacity
    assert best == max(p.decode.check.resolved.kv.token_capacity for p in result.accepted)


def test_handoff_descriptors_are_the_planners(gqa_request):
    result = suggest_pd(gqa_request)
    whole = _pair(result, (1, 1, 1), (1, 2, 16))
    one = _pair(result, (1, 1, 1), (1, 2, 1))
    blocks_per_rank = 512 // (16 * 2)
    # interleave = block size from a dcp-1 prefill: each decode block is one whole prefill block, one descriptor per
    # block (its two KV heads, every layer and K/V are contiguous on both sides)
    assert [p.descriptors for p in whole.handoff.per_rank] == [blocks_per_rank] * 2
    # interleave 1: the same bytes in one-token runs, per KV head
    assert [p.nbytes for p in one.handoff.per_rank] == [p.nbytes for p in whole.handoff.per_rank]
    assert min(p.descriptors for p in one.handoff.per_rank) > 16 * whole.handoff.max_descriptors
    # both are exactly what the planner gives for the whole prompt (no period shortcut)
    for pair in (whole, one):
        pre, dec = handoff_side(pair.prefill.check.resolved), handoff_side(pair.decode.check.resolved)
        for rank, got in enumerate(pair.handoff.per_rank):
            pulls = summary._pull(pre, dec, rank, 0, 511)
            assert got.descriptors == sum(len(d) for d in pulls.values())
            assert got.nbytes == sum(d.nbytes for d in pulls.values())
            assert got.sent == {r: d.nbytes for r, d in pulls.items()}


@pytest.mark.parametrize("prefill, decode", [((1, 2, 1), (1, 2, 16)), ((1, 1, 1), (1, 2, 1)), ((1, 2, 16), (2, 1, 1))])
def test_long_prompts_count_one_period_and_the_rest(gqa_request, prefill, decode):
    """`rank_pulls` counts whole periods of both layouts' virtual blocks once: the same as the planner over the
    whole prompt, for prompts of several periods and a partial one."""
    result = suggest_pd(gqa_request)
    pair = _pair(result, prefill, decode)
    pre, dec = handoff_side(pair.prefill.check.resolved), handoff_side(pair.decode.check.resolved)
    for n in (200, 777):
        for rank, got in enumerate(summary.rank_pulls(pre, dec, n)):
            pulls = summary._pull(pre, dec, rank, 0, n - 1)
            assert (got.descriptors, got.nbytes) == (
                sum(len(d) for d in pulls.values()),
                sum(d.nbytes for d in pulls.values()),
            )


def test_rejected_pair_names_its_rule(gqa_request, monkeypatch):
    result = suggest_pd(gqa_request)
    # a layout the checks reject on its own is listed once, not once per pair
    reasons = {c.name: " ".join(c.rejected) for c in result.rejected_layouts}
    assert any("parallel.tp=3" in r for r in reasons.values()), reasons
    assert not result.rejected
    monkeypatch.setattr(transport, "unavailable_reason", lambda: "the NIXL transport cannot be imported (test)")
    without = suggest_pd(gqa_request)
    assert not without.accepted and len(without.rejected) == len(result.accepted)
    for pair in without.rejected:
        assert pair.rejected == ["disagg.connector=nixl: the NIXL transport cannot be imported (test)"]


def test_cli_pd_table_json_and_write(tmp_path, monkeypatch):
    monkeypatch.setenv("DCPCTL_CACHE", str(tmp_path / "models"))
    args = ["plan", "suggest", "deepseek-v2-lite", "--device", "h200", "--devices", "4", "--context", "32768", "--pd"]
    out = tmp_path / "v2lite.yaml"
    shown = runner.invoke(app, [*args, "--write", str(out), "--all"], env={"COLUMNS": "220"})
    assert shown.exit_code == 0, shown.output
    assert "P/D pairs" in shown.output and re.search(r"interleave, decode tp\d dcp\d from prefill", shown.output)
    assert "#1 hand-off" in shown.output and "Layouts rejected on their own" in shown.output
    monkeypatch.setattr(devices, "cuda_device_count", lambda: 8)
    check = validate_plan_file(out)
    assert check.valid, check.problems.errors
    assert check.resolved.disagg.prefill_name == validate_plan_file(tmp_path / "v2lite_prefill.yaml").name

    data = json.loads(runner.invoke(app, [*args, "--json"]).output)
    first = data["pairs"][0]
    assert first["ranks"] <= 4 and first["decode"]["token_capacity"] == max(
        p["decode"]["token_capacity"] for p in data["pairs"]
    )
    # MLA from a dcp-1 prefill at interleave = block size: one descriptor per block (one latent "head", all layers)
    for pair in data["pairs"]:
        d = pair["decode"]
        if pair["prefill"]["dcp"] == 1 and d["interleave"] == 64 and d["dcp"] > 1:
            blocks = -(-32767 // (64 * d["dcp"]))
            assert max(pair["handoff"]["descriptors_per_rank"]) == blocks
    assert data["rejected_pairs"] == [] and data["pairs_beyond_devices"] > 0

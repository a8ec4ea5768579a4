"""`dcpctl plan suggest`: every suggestion is a plan `plan validate` accepts, capacity is what the engine allocates,
and the ranking follows the facts that decide it."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from dataclasses import replace
from functools import partial

import pytest
from typer.testing import CliRunner

from dcpctl.cli import app
from engine import devices
from engine.attention.cpu_backend import CpuBackend
from engine.checkpoints.aliases import KNOWN_ALIASES
from engine.checkpoints.model_info import read_model_info
from engine.checkpoints.shipped_configs import SHIPPED
from engine.errors import UserError
from engine.kernels.cpu_gemm import PackableLinear
from engine.plan.checks import validate_plan_file
from engine.runtime.model_runner import ModelRunner
from engine.suggest import decode_timing, hardware, host_timing, kernel_timing, measure
from engine.suggest.decode_shapes import DecodeShapes, decode_shapes
from engine.suggest.figures import Cluster, expert_fraction
from engine.suggest.hardware import DeviceSpec, parse_figure, preset
from engine.suggest.models import planned_model
from engine.suggest.suggest import Request, plan_yaml, suggest, write_plan
from tests.conftest import write_config

runner = CliRunner()
GiB = 2**30
CONTEXT_128K = 131072

# A CPU node as `cpu` measures one, with fixed figures (tests must not depend on this machine's load).
TEST_CPU = DeviceSpec(
    name="cpu",
    kind="cpu",
    memory_bytes=8 * GiB,
    bandwidth=20e9,
    flops16=50e9,
    flops32=50e9,
    link_bandwidth=10e9,
    network_bandwidth=50e9,
    link_latency_s=200e-6,
    network_latency_s=200e-6,
    source="test figures",
    layer_overhead_s=0.3e-3,
    dcp_layer_overhead_s=0.6e-3,
    shared=True,
    devices_per_node=2,
)


@pytest.fixture
def no_pulled_models(tmp_path, monkeypatch):
    """Shipped names resolve to their shipped facts, not to a folder pulled on this machine."""
    monkeypatch.setenv("DCPCTL_CACHE", str(tmp_path / "models"))


def _by_layout(result, tp, dcp, interleave=None, sharded=False, comm="ag_rs"):
    """The accepted tp / dcp / interleave whose dense layers are (`sharded`) or are not split over replica ranks."""
    for c in result.accepted:
        p = c.plan.parallel
        same = (p.tp, p.dcp, c.placement.sharded, p.dcp_comm_backend) == (tp, dcp, sharded, comm)
        if same and interleave in (None, p.interleave):
            return c
    raise AssertionError(f"tp{tp} dcp{dcp} not accepted")


def _validate_written(candidate, tmp_path):
    path = write_plan(candidate, tmp_path / f"{candidate.name}.yaml")
    return validate_plan_file(path)


def test_deepseek_v2_lite_on_8_h200_at_128k(tmp_path, monkeypatch, no_pulled_models):
    model = planned_model("deepseek-v2-lite")
    cluster = Cluster(preset("h200"), 8, 1)
    capacity = suggest(Request(model, cluster, CONTEXT_128K, 16, objective="capacity"))

    # tp8 dcp8 holds the most: the weights per rank of tp8 dcp1, and 1/8 of the latent cache per rank
    best = capacity.accepted[0]
    assert (best.plan.parallel.tp, best.plan.parallel.dcp) == (8, 8)
    no_dcp = _by_layout(capacity, 8, 1)
    assert best.weight_bytes_per_rank == no_dcp.weight_bytes_per_rank
    assert best.kv_bytes_per_token_per_rank * 8 == no_dcp.kv_bytes_per_token_per_rank
    assert best.check.resolved.kv.token_capacity == 8 * no_dcp.check.resolved.kv.token_capacity
    # the replica layouts hold less in the same memory: each of their ranks keeps more of the weights
    replica = _by_layout(capacity, 1, 8)
    assert replica.check.resolved.layout.kind == "replica"
    assert replica.weight_bytes_per_rank > best.weight_bytes_per_rank
    assert replica.check.resolved.kv.token_capacity < best.check.resolved.kv.token_capacity
    assert not capacity.rejected  # MLA: every tp / dcp of 8 devices is a valid layout
    assert all(c.step.serve_s == 0 and c.step.overhead_s == 0 for c in capacity.accepted)  # data-sheet roofline

    # latency among the 8-rank engines: tp8 dcp8 reads the fewest bytes per step (weights / 8 and KV / 8), but the
    # Helix placement (dense layers sharded over 8 replica ranks) wins: it repeats only the small QKV projections
    # and needs no query all-gather, so it spends less time in collectives
    latency = suggest(Request(model, cluster, CONTEXT_128K, 16, objective="latency"))
    eight = [c for c in latency.accepted if c.check.resolved.world_size == 8]
    tp8 = _by_layout(latency, 8, 8)
    assert tp8.step.bytes_read == min(c.step.bytes_read for c in eight)
    assert eight[0].placement.sharded and eight[0].plan.parallel.dcp == 8
    assert eight[0].step.comm_s < tp8.step.comm_s
    assert not any(c.where == "attention: query gather" for c in eight[0].step.collectives)
    assert eight[0].step.bound == tp8.step.bound == "memory"
    replicated = [c for c in eight if not c.placement.sharded]
    assert (replicated[0].plan.parallel.tp, replicated[0].plan.parallel.dcp) == (8, 8)
    assert [c.step.seconds for c in latency.accepted] == sorted(c.step.seconds for c in latency.accepted)

    # every suggestion is a plan `plan validate` accepts unchanged, on a machine with the 8 GPUs it names
    monkeypatch.setattr(devices, "cuda_device_count", lambda: 8)
    for candidate in capacity.accepted:
        check = _validate_written(candidate, tmp_path)
        assert check.valid, (candidate.name, check.problems.errors)


def test_gqa_rejections_name_the_rule(no_pulled_models):
    result = suggest(Request(planned_model("qwen2.5-7b-instruct"), Cluster(preset("h100"), 8, 1), 32768, 8))
    reasons = {c.name: " ".join(c.rejected) for c in result.rejected}
    assert "does not divide the model's 28 attention heads" in reasons["qwen2_5-7b-instruct_tp8_dcp1"]
    assert "world size 16 does not divide the 8 devices" in reasons["qwen2_5-7b-instruct_tp4_dcp4_i1"]
    # tp4 holds one of the 4 KV heads per rank (R = 1), so DCP needs replica ranks
    assert _by_layout(result, 4, 2).check.resolved.layout.kind == "replica"


def test_smollm2_on_cpu_orders_by_shared_memory(no_pulled_models):
    model = planned_model("smollm2-135m-instruct")
    cluster = Cluster(TEST_CPU, 2, 1)
    latency = suggest(Request(model, cluster, 2048, 8, objective="latency"))
    one, two = _by_layout(latency, 1, 1), _by_layout(latency, 1, 2, 1)
    assert latency.accepted[0] is one
    # dcp 2 runs replica ranks on the same memory and cores: both read all the weights, and each layer adds the
    # DCP combine (an LSE all-gather and a reduce-scatter)
    assert two.weight_bytes_per_rank == one.weight_bytes_per_rank
    assert two.step.bytes_read > one.step.bytes_read
    assert sum(c.count for c in two.step.collectives) == 2 * model.info.num_layers
    assert not one.step.collectives
    # the all-to-all combine is one collective per layer instead of an all-gather and a reduce-scatter
    a2a = _by_layout(latency, 1, 2, 1, comm="a2a")
    assert [c.op for c in a2a.step.collectives if c.where.startswith("attention")] == ["all_to_all"]
    assert sum(c.count for c in a2a.step.collectives) == model.info.num_layers
    assert a2a.step.comm_s < two.step.comm_s and a2a.step.bytes_read == two.step.bytes_read
    # the Helix placement splits the dense layers over both ranks: each reads about half the weights
    sharded = _by_layout(latency, 1, 2, 1, sharded=True)
    assert sharded.weight_bytes_per_rank < 0.6 * one.weight_bytes_per_rank
    assert sharded.step.bytes_read < two.step.bytes_read

    # capacity: on a shared memory the replica's second copy of the weights costs KV room ...
    capacity = suggest(Request(model, cluster, 2048, 8, objective="capacity"))
    assert capacity.accepted[0] is not None
    cap = {
        c.plan.parallel.dcp: c.check.resolved.kv.token_capacity for c in capacity.accepted if not c.placement.sharded
    }
    assert cap[1] > cap[2]
    # ... while at a fixed KV budget per rank (the shipped CPU plans' 1GiB) dcp 2 holds exactly twice the tokens
    fixed = suggest(Request(model, cluster, 2048, 8, kv_memory=GiB, objective="capacity"))
    assert fixed.accepted[0].plan.parallel.dcp == 2
    assert (
        fixed.accepted[0].check.resolved.kv.token_capacity
        == 2 * _by_layout(fixed, 1, 1).check.resolved.kv.token_capacity
    )
    # tp 2 or 3 cannot split 3 KV heads over 2 cores' ranks
    assert any("parallel.tp=2" in " ".join(c.rejected) for c in latency.rejected)


def test_multi_node_collectives_and_throughput(no_pulled_models):
    model = planned_model("deepseek-v3")
    result = suggest(Request(model, Cluster(preset("h200"), 8, 2), 65536, 32, objective="throughput"))
    # bf16 DeepSeek-V3 (~1.3 TB) fits only when every rank of the 16 holds 1/16 of it
    assert {c.check.resolved.world_size for c in result.accepted} == {16}
    assert all("leave no KV memory" in " ".join(c.rejected) for c in result.rejected if c.plan.parallel.tp < 16)
    best = result.accepted[0]
    assert best.plan.launch.nnodes == 2 and best.plan.launch.master_port
    assert all(x.crosses_nodes for x in best.step.collectives if x.group in ("tp", "world"))
    rates = [c.tokens_per_s for c in result.accepted if c.serves_concurrency]
    assert rates == sorted(rates, reverse=True)


def test_bare_config_json(tmp_path):
    folder = write_config(tmp_path / "m", num_attention_heads=8, num_key_value_heads=2)
    planned = planned_model(str(folder / "config.json"))
    assert planned.plan_path == str(folder.resolve()) and planned.info.num_kv_heads == 2
    result = suggest(Request(planned, Cluster(TEST_CPU, 4, 1), 512, 1, kv_memory=2**20))
    # tp4 over 2 KV heads replicates each twice (R = 2): dcp 2 runs inside the TP group, dcp 4 adds replicas
    assert _by_layout(result, 4, 2, 1).check.resolved.layout.kind == "tp"
    assert _by_layout(result, 2, 2, 1).check.resolved.layout.kind == "replica"


def test_written_plan_keeps_only_changed_fields(no_pulled_models):
    model = planned_model("smollm2-135m-instruct")
    result = suggest(Request(model, Cluster(TEST_CPU, 2, 1), 1024, 4, kv_memory=GiB))
    text = plan_yaml(result.accepted[0])
    assert "path: smollm2-135m-instruct" in text
    assert f"memory: {GiB}B" in text and "max_model_len: 1024" in text
    assert "serve:" not in text  # defaults are left out


def test_moe_expert_fraction():
    info = planned_model("deepseek-v2-lite").info
    assert expert_fraction(info, 1) == pytest.approx(6 / 64)
    assert expert_fraction(info, 10**6) == pytest.approx(1.0)
    assert expert_fraction(planned_model("llama-3.1-8b-instruct").info, 4) == 1.0


def test_shipped_models_parse(no_pulled_models):
    for name, shipped in SHIPPED.items():
        planned = planned_model(name)
        assert planned.plan_path in (name, shipped.repo_id)
        assert planned.info.num_layers > 0
    v3 = planned_model("deepseek-ai/DeepSeek-V3")
    assert v3.info.is_mla and not v3.runnable
    assert v3.info.kv_bytes_per_token(1, 2) == 61 * (512 + 64) * 2


def test_figures_parse():
    assert parse_figure("--bandwidth", "4.8TB/s") == pytest.approx(4.8e12)
    assert parse_figure("--memory", "80GiB") == 80 * GiB
    assert parse_figure("--flops", "989T") == pytest.approx(989e12)
    with pytest.raises(UserError, match="--memory 'lots'"):
        parse_figure("--memory", "lots")


CACHED_MACHINE = {"bandwidth": 1.5e10, "collective_latency_s": 1e-4}
CACHED_DECODE = {
    "linear_flops_per_core": 2e10,
    "attention_bytes_per_core": 5e9,
    "linear_flops_one_rank": 3e10,
    "attention_bytes_one_rank": 8e9,
    "layer_host_s": 3e-4,
    "dcp_layer_host_s": 6e-4,
    "step_collective_s": 1e-4,
    "serve_token_s": 5e-4,
}


def _figures_cache(cache, shapes: DecodeShapes, decode: dict) -> dict:
    """Write this machine's `cpu` figures cache with `decode` as the figures of `shapes`; return the entry."""
    entry = {"machine": measure.machine_key(), "version": measure.CACHE_VERSION, "figures": CACHED_MACHINE}
    entry["decode"] = {shapes.key: decode}
    cache.write_text(json.dumps(entry))
    return entry


def test_cpu_dcp_step_charges_the_two_rank_collective_latency(tmp_path, monkeypatch, no_pulled_models):
    """Inside a CPU node a collective costs what it added to the measured two-rank step (`step_collective_s`), once
    per collective of the layout; a one-rank layout has none to pay."""
    monkeypatch.setenv("DCPCTL_CPU_FIGURES", str(tmp_path / "cpu.json"))
    model = planned_model("smollm2-135m-instruct")
    steps = {}
    for latency in (0.0, 1e-3):
        decode = {**CACHED_DECODE, "step_collective_s": latency}
        _figures_cache(tmp_path / "cpu.json", decode_shapes(model.info), decode)
        spec = replace(hardware.cpu(model.info), devices_per_node=2)
        assert spec.link_latency_s == latency and spec.network_latency_s == CACHED_MACHINE["collective_latency_s"]
        result = suggest(Request(model, Cluster(spec, 2, 1), 576, 6, kv_memory=GiB, dtype="float32"))
        steps[latency] = (_by_layout(result, 1, 1).step, _by_layout(result, 1, 2, sharded=True, comm="a2a").step)
    (one_free, two_free), (one, two) = steps[0.0], steps[1e-3]
    # the server's work for the 6 streamed tokens of a step, whole, on every layout
    assert one.serve_s == two.serve_s == pytest.approx(6 * CACHED_DECODE["serve_token_s"])
    assert one.seconds == one_free.seconds
    count = sum(c.count for c in two.collectives)
    assert count == 92  # 30 all-to-alls of the combine, 62 all-reduces of the sharded dense layers
    assert two.comm_s - two_free.comm_s == pytest.approx(count * 1e-3)
    assert two.seconds - two_free.seconds == pytest.approx(count * 1e-3)


def test_cpu_figures_come_from_the_cache(tmp_path, monkeypatch, no_pulled_models):
    cache = tmp_path / "cpu.json"
    monkeypatch.setenv("DCPCTL_CPU_FIGURES", str(cache))
    smol, llama = (decode_shapes(planned_model(m).info) for m in ("smollm2-135m-instruct", "llama-3.1-8b-instruct"))
    machine, decode = CACHED_MACHINE, CACHED_DECODE
    entry = _figures_cache(cache, smol, decode)
    assert measure.cpu_figures(smol) == {**machine, **decode}
    # another model's shapes: only its decode figures are measured, and filed beside the first model's
    runs = []

    def measured(cmd, **kwargs):
        runs.append(cmd)
        out = {"decode": {**decode, "layer_host_s": 1e-4}}
        return subprocess.CompletedProcess(cmd, 0, json.dumps(out) + "\n", "")

    monkeypatch.setattr(measure.subprocess, "run", measured)
    assert measure.cpu_figures(llama)["layer_host_s"] == 1e-4
    sent = json.loads(runs[0][runs[0].index("--shapes") + 1])
    assert "--machine" not in runs[0] and DecodeShapes.from_dict(sent) == llama
    assert set(json.loads(cache.read_text())["decode"]) == {smol.key, llama.key}
    assert measure.cpu_figures(llama)["layer_host_s"] == 1e-4 and len(runs) == 1  # cached now
    # another machine's figures are not reused, nor figures from before a figure was measured or measured otherwise
    monkeypatch.setattr(measure.subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("measured")))
    older = {k: v for k, v in decode.items() if k != "step_collective_s"}
    for changed in (
        {"figures": {k: v for k, v in machine.items() if k != "collective_latency_s"}},
        {"decode": {smol.key: older}},
        {"machine": {**measure.machine_key(), "cpu": "other"}},
        {"version": measure.CACHE_VERSION - 1},
    ):
        cache.write_text(json.dumps({**entry, **changed}))
        with pytest.raises(RuntimeError, match="measured"):
            measure.cpu_figures(smol)


def test_decode_shapes_are_the_models(no_pulled_models):
    """The linear layers the `cpu` figures time are the model's: per decode token they hold exactly the matmul
    elements the roofline charges (biases and an MoE router aside), and the attention has the model's heads."""
    smol = planned_model("smollm2-135m-instruct").info
    shapes = decode_shapes(smol)
    assert [(s.out_features, s.in_features, s.count) for s in shapes.linears] == [
        (960, 576, 30),  # q, k, v: (9 + 2 x 3) heads x 64
        (576, 576, 30),  # o_proj
        (3072, 576, 30),  # gate and up: 2 x 1536
        (576, 1536, 30),  # down_proj
        (49152, 576, 1),  # the LM head (tied to the embedding)
    ]
    assert (shapes.heads, shapes.kv_heads, shapes.key_dim, shapes.value_dim) == (9, 3, 64, 64)
    assert (shapes.tiny_arch, shapes.tiny_sizes["num_layers"], shapes.tiny_sizes["num_kv_heads"]) == ("llama", 30, 3)
    for name, tolerance in (("smollm2-135m-instruct", 0), ("llama-3.1-8b-instruct", 0), ("deepseek-v2-lite", 2e-3)):
        model = planned_model(name)
        result = suggest(Request(model, Cluster(TEST_CPU, 1, 1), 1024, 1, kv_memory=GiB, dtype="float32"))
        one = _by_layout(result, 1, 1)
        charged = one.step.compute_s * TEST_CPU.flops32 / (2 * one.batch)  # matmul elements per token
        timed = sum(s.elements * s.count for s in decode_shapes(model.info).linears)
        assert timed == pytest.approx(charged, rel=tolerance, abs=0), name
    mla = decode_shapes(planned_model("deepseek-v2-lite").info)
    assert (mla.kv_heads, mla.key_dim, mla.value_dim, mla.value_in_key) == (1, 576, 512, True)
    assert DecodeShapes.from_dict(json.loads(json.dumps(mla.to_dict()))) == mla


def test_cpu_step_uses_the_figures_of_how_ranks_share_the_cores(no_pulled_models):
    """A lone rank on a CPU node runs at the node's single-rank figures (its threads wait for each other at every
    layer); ranks that share the node at the per-core ones; a DCP rank pays the DCP host time per layer."""
    model = planned_model("smollm2-135m-instruct")
    request = partial(Request, model, context=2048, concurrency=8, kv_memory=GiB, objective="latency")
    lone = replace(TEST_CPU, single_rank_flops=TEST_CPU.flops32 / 2, single_rank_attention_bandwidth=1e9)
    base, slow = suggest(request(Cluster(TEST_CPU, 2, 1))), suggest(request(Cluster(lone, 2, 1)))
    one, one_slow = _by_layout(base, 1, 1), _by_layout(slow, 1, 1)
    assert one_slow.step.compute_s == pytest.approx(2 * one.step.compute_s)
    assert one_slow.step.kv_s == pytest.approx(one.step.kv_s * TEST_CPU.bandwidth / 1e9)
    assert one.step.overhead_s == pytest.approx(model.info.num_layers * TEST_CPU.layer_overhead_s)
    two, two_slow = _by_layout(base, 1, 2, 1, sharded=True, comm="a2a"), _by_layout(slow, 1, 2, 1, True, "a2a")
    assert two_slow.step == two.step
    assert two.step.overhead_s == pytest.approx(model.info.num_layers * TEST_CPU.dcp_layer_overhead_s)
    # the attention is a phase of its own: its KV read is not hidden under the matmuls
    step = one.step
    assert step.seconds == pytest.approx(
        max(step.memory_s, step.compute_s) + max(step.kv_s, step.attention_compute_s) + step.overhead_s
    )


def test_cpu_step_grows_with_the_batch_by_its_flops_and_kv(no_pulled_models):
    """At 8 and 16 rows SmolLM2's matmuls on the test node are compute-bound (2 x 134.5M FLOPs per row at 50
    GFLOP/s: 43 and 86 ms, against 27 ms to read its 513 MiB of weights once): the step grows with the batch by the
    FLOPs over the throughput and the KV over the attention bandwidth; the weights' read and the host time do not."""
    model = planned_model("smollm2-135m-instruct")
    steps = {}
    for batch in (8, 16):
        result = suggest(Request(model, Cluster(TEST_CPU, 1, 1), 576, batch, kv_memory=GiB, dtype="float32"))
        steps[batch] = _by_layout(result, 1, 1).step
    small, large = steps[8], steps[16]
    elements = sum(s.elements * s.count for s in decode_shapes(model.info).linears)
    assert small.compute_s > small.memory_s and large.memory_s == small.memory_s
    assert large.compute_s - small.compute_s == pytest.approx(2 * 8 * elements / TEST_CPU.flops32)
    kv_bytes = 8 * 576 * model.info.kv_bytes_per_token(1, 4)
    assert large.kv_s - small.kv_s == pytest.approx(kv_bytes / TEST_CPU.bandwidth)
    assert large.overhead_s == small.overhead_s
    assert large.seconds - small.seconds == pytest.approx(
        (large.compute_s - small.compute_s) + (large.attention_s - small.attention_s)
    )


@pytest.mark.slow
@pytest.mark.multiproc
def test_decode_timing_runs_the_engines_code(tiny_models, monkeypatch):
    """Every `cpu` figure of a model is measured through the engine's own layers and step, at its shapes; the DCP
    step also as two real ranks (in processes of their own, so their `execute` calls are not counted here)."""
    monkeypatch.setattr(kernel_timing, "COLD_BYTES", 2**20)
    monkeypatch.setattr(decode_timing, "TWO_RANK_RUNS", 1)
    info = read_model_info(tiny_models("llama", num_kv_heads=1))
    shapes = decode_shapes(info)
    calls = collections.Counter()
    for owner, name in ((PackableLinear, "project"), (CpuBackend, "paged"), (ModelRunner, "execute")):
        original = getattr(owner, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)
    figures = decode_timing.decode_figures(shapes)
    assert set(figures) == set(measure.DECODE_FIGURES)
    # what serving and the collectives add is a difference of two timings, floored at 0 (a busy machine can make it 0)
    added = {"serve_token_s", "step_collective_s"}
    assert all(0 < v < float("inf") for k, v in figures.items() if k not in added), figures
    assert all(0 <= figures[k] < float("inf") for k in added), figures
    assert calls["project"] and calls["paged"] and calls["execute"] == 2 * (host_timing.HOST_REPEATS + 2)


def test_cli_table_json_and_write(tmp_path, monkeypatch, no_pulled_models):
    out = tmp_path / "best.yaml"
    args = ["plan", "suggest", "deepseek-v2-lite", "--device", "h200", "--context", "131072", "--concurrency", "16"]
    shown = runner.invoke(app, [*args, "--write", str(out), "--all"], env={"COLUMNS": "200"})
    assert shown.exit_code == 0, shown.output
    assert "tp8 dcp8" in shown.output and "no combination was rejected" in shown.output
    monkeypatch.setattr(devices, "cuda_device_count", lambda: 8)
    check = validate_plan_file(out)
    assert check.valid and (check.resolved.plan.parallel.tp, check.resolved.plan.parallel.dcp) == (8, 8)
    data = json.loads(runner.invoke(app, [*args, "--json"]).output)
    first = data["accepted"][0]
    assert (first["tp"], first["dcp"], first["world_size"]) == (8, 8, 8)
    assert {c["where"] for c in first["collectives"]} >= {"attention: combine", "o_proj"}


def test_bad_input_one_line_errors(tmp_path, no_pulled_models):
    plan_file = tmp_path / "p.yaml"
    plan_file.write_text("model: {path: deepseek-v2-lite}\n")
    cases = {
        ("no-such-model",): "is not a checkpoint folder, a config.json or a known model",
        ("deepseek-v2-lite", "--device", "h20"): "did you mean 'h200'",
        ("deepseek-v2-lite", "--device", "custom", "--memory", "80GB"): "--device custom needs --bandwidth",
        ("deepseek-v2-lite", "--device", "h200", "--context", "0"): "--context 0 must be >= 1",
        ("deepseek-v2-lite", "--device", "h200", "--kv-memory", "0.5"): "must be a size",
        ("deepseek-v2-lite", "--device", "h200", "--write", str(tmp_path)): "is a folder",
        ("deepseek-v2-lite", "--device", "h200", "--write", str(tmp_path / "x.yaml"), "--pick", "99"): "--pick 99",
        ("deepseek-v3", "--device", "h200", "--context", "999999"): "exceeds the model's max_position_embeddings",
        ("deepseek-v2-lite", "--device", "h200", "--devices", "100000"): "over the 1024 a suggestion enumerates",
        (str(plan_file), "--device", "h200"): "looks like a plan; MODEL is a checkpoint folder",
        ("deepseek-v2-lite", "--device", "h200", "--write", str(tmp_path / "f" / "x")): "is a file, not a folder",
    }
    (tmp_path / "f").write_text("a file where --write wants a folder")
    for top in ("0", "-3"):
        result = runner.invoke(app, ["plan", "suggest", "deepseek-v2-lite", "--device", "h200", "--top", top])
        assert result.exit_code == 2 and "--top must be at least 1 row" in result.output
    for args, message in cases.items():
        result = runner.invoke(app, ["plan", "suggest", *args])
        if "999999" in args:  # every layout rejected: the table says why, exit 1
            assert result.exit_code == 1 and "no layout" in result.output, result.output
            continue
        assert isinstance(result.exception, UserError), (args, result.output)
        assert message in str(result.exception) and "\n" not in str(result.exception), args
    # through the console entry point: one line on stderr, exit 1, no traceback
    env = dict(os.environ, DCPCTL_CACHE=str(tmp_path / "models"))
    proc = subprocess.run(
        [sys.executable, "-m", "dcpctl.cli", "plan", "suggest", "no-such-model"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().count("\n") == 0 and proc.stderr.startswith("error: model 'no-such-model'")


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("dcp", [1, 2])
def test_suggested_capacity_is_what_the_engine_allocates(tmp_path, tiny_models, dcp):
    """The plan a suggestion writes (its KV budget derived from the device's memory) makes the engine allocate
    exactly the blocks and bytes the suggestion shows."""
    folder = tiny_models("llama", num_kv_heads=1)
    spec = replace(TEST_CPU, memory_bytes=96 * 2**20)
    result = suggest(Request(planned_model(str(folder)), Cluster(spec, 2, 1), 256, 2, block_size=16))
    candidate = _by_layout(result, 1, dcp, 16 if dcp > 1 else None)
    check = _validate_written(candidate, tmp_path)
    assert check.valid, check.problems.errors
    stats_dir = tmp_path / "stats"
    env = dict(os.environ, DCPCTL_RANK_STATS_DIR=str(stats_dir))
    plan = tmp_path / f"{candidate.name}.yaml"
    cmd = [sys.executable, "-m", "dcpctl.cli", "run", str(plan), "--prompt", "hello", "--max-tokens", "2"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    stats = [json.loads(p.read_text()) for p in sorted(stats_dir.glob("rank*.json"))]
    kv = candidate.check.resolved.kv
    assert len(stats) == candidate.check.resolved.world_size
    assert {s["num_blocks"] for s in stats} == {kv.num_blocks}
    assert {s["kv_cache_bytes"] for s in stats} == {kv.bytes_per_rank}
    assert kv.num_blocks * 16 * dcp == kv.token_capacity


def test_known_aliases_are_shipped():
    assert set(KNOWN_ALIASES) <= set(SHIPPED)


def test_fp8_kv_cache_doubles_bfloat16s_tokens_per_rank(no_pulled_models):
    """--kv-cache-dtype goes into every suggested plan's cache.dtype: at a fixed KV budget fp8 holds twice bfloat16's
    tokens and sequences, and the roofline reads half the KV bytes."""
    model = planned_model("smollm2-135m-instruct")

    def best(kv_dtype: str):
        result = suggest(
            Request(model, Cluster(TEST_CPU, 2, 1), 2048, 8, "bfloat16", kv_memory=GiB, kv_cache_dtype=kv_dtype)
        )
        return _by_layout(result, 1, 2, 1)

    half, fp8 = best("auto"), best("fp8")
    assert fp8.plan.cache.dtype == "fp8" and fp8.check.resolved.cache_dtype == "fp8_e4m3"
    assert fp8.check.resolved.kv.token_capacity == 2 * half.check.resolved.kv.token_capacity
    assert fp8.seqs_at_context in (2 * half.seqs_at_context, 2 * half.seqs_at_context + 1)  # whole sequences
    assert fp8.step.kv_s == pytest.approx(half.step.kv_s / 2)
    assert "dtype: fp8" in plan_yaml(fp8)
    with pytest.raises(UserError, match="--kv-cache-dtype 'int8' is not one of auto, float32, bfloat16, float16, fp8"):
        Request(model, Cluster(TEST_CPU, 2, 1), 2048, 8, kv_cache_dtype="int8")

"""`dcpctl bench`: the workload generator, metrics from known timestamps, the roofline math, and end-to-end runs
of real `dcpctl run` servers (and HF generate) on a tiny checkpoint. Performance is measured, never asserted."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from dcpctl import bench_cmd
from engine.checkpoints.model_info import weight_elements
from engine.errors import UserError
from engine.plan.checks import validate_plan_file
from evals.bench.client import RequestRecord, arrival_times, run_requests
from evals.bench.metrics import compute_metrics, tpot_of
from evals.bench.options import HF_LABEL
from evals.bench.roofline import copy_bandwidth, decode_roofline
from evals.bench.workload import build_workload, load_tokenizer, random_prompts, sampleable_ids
from evals.launch import PlanServer
from tests.oracle import write_plan

RUNNER = CliRunner()
APP = typer.Typer()
APP.command()(bench_cmd.bench)
REPORT_FILES = ("bench.json", "bench.md", "throughput.png", "tpot.png")


def invoke(*args: str) -> tuple[int, str]:
    """Run the bench command in-process; a UserError counts as exit 1 with its message (as cli.main does)."""
    result = RUNNER.invoke(APP, list(args))
    out = result.output
    if isinstance(result.exception, UserError):
        return 1, out + f"\nerror: {result.exception}"
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, out


@pytest.fixture
def tiny_llama(tiny_models) -> Path:
    # 2 KV heads: tp1/dcp2 is the replica layout, like SmolLM2 on CPU.
    return tiny_models("llama", num_layers=1)


# --- workload -----------------------------------------------------------------------------------------------


def test_random_workload_is_deterministic_for_a_seed_with_exact_lengths(tiny_llama):
    tok = load_tokenizer(tiny_llama)
    kw = {"num_prompts": 5, "input_len": 37, "output_len": 9, "num_warmup": 2}
    a = build_workload(tok, seed=3, **kw)
    b = build_workload(load_tokenizer(tiny_llama), seed=3, **kw)
    c = build_workload(tok, seed=4, **kw)
    assert a.prompts == b.prompts and a.warmup == b.warmup
    assert a.prompts != c.prompts
    assert a.input_lens == [37] * 5 and [len(p) for p in a.warmup] == [37, 37]
    assert not {tuple(p) for p in a.warmup} & {tuple(p) for p in a.prompts}  # warm-up never primes the cache
    special = set(tok.all_special_ids)
    assert not special & {t for p in a.prompts for t in p}
    assert len({t for p in a.prompts for t in p}) > 50  # drawn over the vocabulary, not a constant
    assert a.max_total_len == 46


def test_random_prompts_cover_only_the_given_ids():
    vocab = np.array([7, 11, 13])
    prompts = random_prompts(vocab, 4, 50, seed=0)
    assert {t for p in prompts for t in p} == {7, 11, 13}
    assert random_prompts(vocab, 4, 50, seed=0, stream=1) != prompts


def test_prompts_file_is_tokenized_cut_and_cycled(tmp_path, tiny_llama):
    tok = load_tokenizer(tiny_llama)
    path = tmp_path / "prompts.txt"
    path.write_text("the quick brown fox jumps over the lazy dog\n\nhello\n")
    full = [tok("the quick brown fox jumps over the lazy dog").input_ids, tok("hello").input_ids]
    wl = build_workload(tok, num_prompts=5, input_len=None, output_len=4, seed=0, num_warmup=1, prompts_file=path)
    assert wl.prompts == [full[0], full[1], full[0], full[1], full[0]]
    assert wl.source == str(path)
    cut = build_workload(tok, num_prompts=2, input_len=3, output_len=4, seed=0, num_warmup=0, prompts_file=path)
    assert cut.prompts == [full[0][:3], full[1][:3]]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(json.dumps({"prompt_token_ids": [5, 6, 7]}) + "\n")
    assert build_workload(tok, num_prompts=1, input_len=None, output_len=1, seed=0, num_warmup=0, prompts_file=jsonl)
    assert sampleable_ids(tok).size == len(tok) - len(set(tok.all_special_ids) | set(tok.get_added_vocab().values()))


# --- metrics ------------------------------------------------------------------------------------------------


def _records() -> list[RequestRecord]:
    r0 = RequestRecord(0, 10, 0.0, 0.5, [0.5, 0.6, 0.8, 1.0], 1.0, 4)
    r1 = RequestRecord(1, 10, 0.2, 0.4, [0.4, 0.5, 0.6], 0.7, 3)
    r2 = RequestRecord(2, 10, 0.3, 1.3, [1.3], 1.3, 1)
    r3 = RequestRecord(3, 10, 0.4, error="HTTP 400: too long")
    return [r0, r1, r2, r3]


def test_metrics_from_known_timestamps():
    m = compute_metrics(_records(), duration_s=2.0, output_len=4)
    assert (m.completed, m.failed, m.short_requests) == (3, 1, 2)
    assert m.output_tokens == 8 and m.input_tokens == 30
    assert m.output_throughput == pytest.approx(4.0)
    assert m.request_throughput == pytest.approx(1.5)
    assert m.total_token_throughput == pytest.approx(19.0)
    # TTFT 0.5, 0.2, 1.0 -> sorted 0.2, 0.5, 1.0; p99 at rank 0.99 * 2 = 1.98: 0.5 + 0.98 * 0.5
    assert m.ttft.mean == pytest.approx(1.7 / 3)
    assert m.ttft.p50 == pytest.approx(0.5)
    assert m.ttft.p99 == pytest.approx(0.99)
    # TPOT: (1.0 - 0.5) / 3 and (0.6 - 0.4) / 2; one-token requests have none
    assert m.tpot.n == 2
    assert m.tpot.mean == pytest.approx((0.5 / 3 + 0.1) / 2)
    assert m.tpot.p99 == pytest.approx(0.1 + 0.99 * (0.5 / 3 - 0.1))
    # ITL: 0.1, 0.2, 0.2 and 0.1, 0.1
    assert m.itl.n == 5
    assert m.itl.mean == pytest.approx(0.14)
    assert m.itl.p50 == pytest.approx(0.1)
    assert m.itl.p99 == pytest.approx(0.2)
    # the decode batch of each gap's end: r0's 0.6 / 0.8 / 1.0 see 2 / 1 / 1 decoding, r1's 0.5 / 0.6 see 2 / 2
    assert m.decode_batch == pytest.approx(8 / 5)
    assert m.e2e.mean == pytest.approx((1.0 + 0.5 + 1.0) / 3)
    assert tpot_of(_records()[3]) is None


def test_handoff_metrics_per_decode_rank_and_the_ttft_split():
    def hand_off(transfer, raw, prefill, first_decode, error=None):
        ranks = [
            {"rank": r, "descriptors": 240, "bytes": 11 * 2**20, "transfer_s": t, "raw_transfer_s": w}
            for r, (t, w) in enumerate(zip(transfer, raw, strict=True))
        ]
        split = {"prefill_s": prefill, "claim_s": 0.01, "queue_s": 0.02, "transfer_s": max(transfer)}
        return {**split, "first_decode_s": first_decode, "per_rank": ranks} | ({"error": error} if error else {})

    records = [
        RequestRecord(0, 512, 0.0, 1.0, [1.0], 1.0, 1, kv_transfer=hand_off([0.04, 0.06], [0.02, 0.02], 4.0, 0.2)),
        RequestRecord(1, 512, 0.0, 1.0, [1.0], 1.0, 1, kv_transfer=hand_off([0.08, 0.02], [0.04, 0.01], 2.0, 0.4)),
        RequestRecord(2, 512, 0.0, 1.0, [1.0], 1.0, 1, kv_transfer=hand_off([9.0], [0.01], 9.0, 9.0, "failed")),
        RequestRecord(3, 512, 0.0, 1.0, [1.0], 1.0, 1),  # not a P/D request
    ]
    h = compute_metrics(records, duration_s=1.0).handoff
    assert h.requests == 2 and h.descriptors_per_rank == 240 and h.bytes_per_rank == 11 * 2**20
    assert (h.transfer.min, h.transfer.mean) == (pytest.approx(0.02), pytest.approx(0.05))
    assert (h.ratio.min, h.ratio.mean) == (pytest.approx(2.0), pytest.approx(2.25))  # 2, 3, 2, 2
    assert h.prefill.mean == pytest.approx(3.0) and h.claim_queue.mean == pytest.approx(0.03)
    assert h.transfer_ttft.mean == pytest.approx(0.07) and h.first_decode.mean == pytest.approx(0.3)
    assert compute_metrics(records[3:], duration_s=1.0).handoff is None


def test_decode_batch_is_the_batch_of_the_steps_the_gaps_are():
    """Eight requests in lockstep for 100 steps, then one alone for 20: the gaps are 8 x 99 steps at batch 8 and 20
    at batch 1, whatever a sampler of the running count saw (the batch-1 tail is a sixth of the wall time)."""
    lockstep = [RequestRecord(i, 10, 0.0, 1.0, [1.0 + 0.05 * k for k in range(100)], 5.95, 100) for i in range(7)]
    tail = RequestRecord(7, 10, 0.0, 1.0, [1.0 + 0.05 * k for k in range(120)], 6.95, 120)
    m = compute_metrics([*lockstep, tail], duration_s=7.0)
    assert m.decode_batch == pytest.approx((8 * 8 * 99 + 20) / (8 * 99 + 20))
    assert compute_metrics([RequestRecord(0, 10, 0.0, 1.0, [1.0], 1.0, 1)], 1.0).decode_batch is None


def test_metrics_of_all_failed_requests_are_empty():
    m = compute_metrics([RequestRecord(0, 5, error="boom")], duration_s=1.0)
    assert m.completed == 0 and m.failed == 1 and m.output_throughput == 0
    assert m.ttft.mean is None and m.tpot.p99 is None and m.itl.n == 0


def test_poisson_arrivals_are_seeded_with_the_right_rate():
    assert arrival_times(3, None, seed=0) == [0.0, 0.0, 0.0]
    a = arrival_times(4000, 20.0, seed=1)
    assert a == arrival_times(4000, 20.0, seed=1) and a != arrival_times(4000, 20.0, seed=2)
    gaps = np.diff(a)
    assert a[0] == 0.0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(1 / 20.0, rel=0.1)
    assert gaps.std() == pytest.approx(1 / 20.0, rel=0.1)  # exponential: std = mean


# --- roofline -----------------------------------------------------------------------------------------------


def test_roofline_math_on_known_numbers():
    r = decode_roofline(
        weight_bytes_per_rank=1e8,
        kv_bytes_per_token=1000,
        dcp=2,
        ranks_per_memory=2,
        batch=8,
        context_len=500,
        bandwidth_bytes_s=2e10,
        measured_step_s=0.0204,
    )
    assert r.kv_bytes_per_rank == pytest.approx(8 * 500 * 1000 / 2)
    assert r.bytes_per_step == pytest.approx(2 * (1e8 + 2e6))
    assert r.limit_s == pytest.approx(0.0102)
    assert r.fraction == pytest.approx(0.5)
    tp2 = decode_roofline(
        weight_bytes_per_rank=5e7,
        kv_bytes_per_token=1000,
        dcp=1,
        ranks_per_memory=1,
        batch=1,
        context_len=100,
        bandwidth_bytes_s=1e9,
        measured_step_s=0.1,
    )
    assert tp2.weight_bytes_per_rank == pytest.approx(5e7)
    assert tp2.limit_s == pytest.approx((5e7 + 1e5) / 1e9)


def test_copy_bandwidth_and_weight_count(tiny_llama):
    from transformers import AutoModelForCausalLM

    bw = copy_bandwidth("cpu", size_bytes=8 * 2**20, repeats=2)
    assert np.isfinite(bw) and bw > 1e8  # at least 0.1 GB/s on any machine this runs on
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama))
    assert weight_elements(tiny_llama) == sum(p.numel() for p in model.parameters())


# --- the command --------------------------------------------------------------------------------------------


def test_bad_options_and_targets_fail_before_launch(tmp_path, tiny_llama):
    plan = str(write_plan(tmp_path, tiny_llama))  # max_model_len 512
    out = tmp_path / "out"
    code, text = invoke(plan, "--num-prompts", "0", "--output", str(out))
    assert code == 1 and "--num-prompts must be at least 1" in text
    code, text = invoke(plan, "--input-len", "500", "--output-len", "20", "--output", str(out))
    assert code == 1 and "exceed model.max_model_len=512" in text and "nothing was launched" in text
    code, text = invoke("http://127.0.0.1:9", "--output", str(out))
    assert code == 1 and "cannot reach the server" in text
    other = write_plan(tmp_path, tmp_path / "elsewhere", name="other.yaml")
    code, text = invoke(plan, str(other), "--output", str(out))
    assert code == 1 and "elsewhere" in text and "dcpctl model pull" in text
    code, text = invoke(plan, "--seed", "-5", "--output", str(out))
    assert code == 1 and "--seed must be 0 or more (got -5)" in text
    code, text = invoke(plan, "--tokenizer", str(tmp_path / "nowhere"), "--output", str(out))
    assert code == 1 and "is not a model folder" in text
    code, text = invoke(plan, "--prompts-file", str(tmp_path), "--output", str(out))
    assert code == 1 and "is a folder: give the file of prompts" in text
    afile = tmp_path / "afile"
    afile.write_text("x")
    code, text = invoke(plan, "--output", str(afile))
    assert code == 1 and "is a file, not a folder" in text
    assert not out.exists()


def test_bench_tp1_plan_and_hf_end_to_end(tmp_path, tiny_llama):
    plan = write_plan(tmp_path, tiny_llama, name="tp1.yaml")
    out = tmp_path / "out"
    code, text = invoke(
        str(plan),
        "--input-len", "24",
        "--output-len", "12",
        "--num-prompts", "4",
        "--concurrency", "2",
        "--warmup", "1",
        "--hf",
        "--output", str(out),
    )  # fmt: skip
    assert code == 0, text
    for name in REPORT_FILES:
        assert (out / name).stat().st_size > 0
    assert (out / "throughput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "output tok/s" in text and "tp1" in text and HF_LABEL in text
    data = json.loads((out / "bench.json").read_text())
    assert [t["label"] for t in data["targets"]] == ["tp1", HF_LABEL]
    report = validate_plan_file(str(plan), []).resolved
    for target in data["targets"]:
        assert target["error"] is None
        reqs = target["requests"]
        assert len(reqs) == 4 and all(r["error"] is None for r in reqs)
        assert all(r["output_tokens"] == 12 and r["prompt_len"] == 24 for r in reqs)  # ignore_eos: exactly 12
        assert all(0 < len(r["token_times"]) <= 12 for r in reqs)
        assert all(r["send_time"] <= r["first_token_time"] <= r["token_times"][-1] <= r["end_time"] for r in reqs)
        m = target["metrics"]
        assert m["completed"] == 4 and m["output_tokens"] == 48
        assert m["output_throughput"] == pytest.approx(48 / m["duration_s"])
        assert target["roofline"]["fraction"] > 0
    tp1 = data["targets"][0]
    assert tp1["kv_bytes_per_rank"] == report.kv.bytes_per_rank
    assert tp1["token_capacity"] == report.kv.token_capacity
    assert 0 < tp1["peak_kv_blocks"] <= tp1["num_blocks"]
    # the server saw exactly the measured and warm-up prompts at their exact lengths
    assert tp1["stats"]["prompt_tokens"] == (4 + 1) * 24
    assert tp1["stats"]["generated_tokens"] == 4 * 12 + 1 * 12  # warm-up: min(16, output_len) tokens
    hf = data["targets"][1]
    assert hf["kv_bytes_per_rank"] is None and hf["launch"]["batch_size"] == 2
    md = (out / "bench.md").read_text()
    assert "| output tok/s ↑ |" in md and "(×" in md and "## Decode roofline" in md


def test_bench_url_target_and_request_errors(tmp_path, tiny_llama):
    plan = write_plan(tmp_path, tiny_llama)
    with PlanServer(plan, log_path=tmp_path / "server.log") as server:
        bad = run_requests(server.base_url, None, [[5] * 600, [5, 6, 7]], 4, concurrency=2)
        assert bad.records[0].error is not None and "HTTP 400" in bad.records[0].error
        assert bad.records[1].ok and bad.records[1].output_tokens == 4
        out = tmp_path / "out"
        code, text = invoke(
            server.base_url,
            "--tokenizer", str(tiny_llama),
            "--input-len", "16",
            "--output-len", "6",
            "--num-prompts", "5",
            "--request-rate", "50",
            "--warmup", "0",
            "--output", str(out),
        )  # fmt: skip
        assert code == 0, text
        assert "ignore_eos" in text
    data = json.loads((out / "bench.json").read_text())
    (target,) = data["targets"]
    assert target["kind"] == "url" and target["kv_bytes_per_rank"] is None and target["token_capacity"] is None
    assert target["metrics"]["completed"] == 5 and target["metrics"]["output_tokens"] == 30
    assert data["settings"]["request_rate"] == 50 and data["settings"]["concurrency"] is None


@pytest.mark.multiproc
def test_bench_tp1_and_dcp2_in_one_table(tmp_path, tiny_llama):
    tp1 = write_plan(tmp_path, tiny_llama, name="tp1.yaml")
    dcp2 = write_plan(tmp_path, tiny_llama, {"parallel.dcp": 2, "parallel.interleave": 4}, name="dcp2.yaml")
    out = tmp_path / "out"
    code, text = invoke(
        str(tp1), str(dcp2), "--input-len", "40", "--output-len", "8", "--num-prompts", "4", "--concurrency", "4",
        "--warmup", "0", "--output", str(out),
    )  # fmt: skip
    assert code == 0, text
    data = json.loads((out / "bench.json").read_text())
    a, b = data["targets"]
    assert (a["label"], b["label"]) == ("tp1", "dcp2")
    assert (a["world_size"], b["world_size"]) == (1, 2)
    assert b["token_capacity"] == 2 * a["token_capacity"]  # same bytes per rank, half the tokens each
    assert b["roofline"]["ranks_per_memory"] == 2
    for t in (a, b):
        assert t["metrics"]["completed"] == 4 and t["metrics"]["output_tokens"] == 32
        assert t["stats"]["prompt_tokens"] == 4 * 40
    assert "(×2.00)" in text  # dcp2's token capacity against tp1

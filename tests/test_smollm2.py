"""SmolLM2-135M-Instruct (the real offline checkpoint) against HF transformers, single rank and DCP replicas."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.placement.weights import weight_bytes
from engine.plan.checks import validate_plan_file
from tests.oracle import LOGPROB_TOL, hf_greedy, read_jsonl, write_plan
from tests.test_dcp_equivalence import dcpctl_run

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?\nAnswer:",
    "def fibonacci(n):",
    "Write a short poem about the sea. " * 12,  # ~100 tokens: several blocks of 16
    "Hi",
]
NEW_TOKENS = 32
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def smollm2():
    from engine.checkpoints.pull import pull_model

    return pull_model("smollm2-135m-instruct")


def assert_matches_hf(folder, prompt_ids, token_ids, logprobs):
    tokens, ref = hf_greedy(folder, prompt_ids, NEW_TOKENS)
    assert token_ids == tokens
    assert max(abs(a - b) for a, b in zip(logprobs, ref, strict=True)) < LOGPROB_TOL


@pytest.mark.parametrize(("block_size", "backend"), [(16, "torch"), (64, "torch"), (16, "cpu")])
def test_single_rank_matches_hf(tmp_path, smollm2, block_size, backend):
    settings = {"cache.block_size": block_size, "cache.memory": "64MiB", "attention.backend": backend}
    plan = write_plan(tmp_path, smollm2, settings)
    with LLM(plan) as llm:
        outputs = llm.generate(
            PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=1)
        )
    for out in outputs:
        assert_matches_hf(smollm2, out.prompt_token_ids, out.token_ids, [lp.logprob for lp in out.logprobs])


def test_a_prefill_sized_step_matches_hf(tmp_path, smollm2, monkeypatch):
    """Prompts whose prefill is one step of more than PREFILL_MIN_ROWS rows: the linear layers take their prefill
    GEMM there (oneDNN's for fp32 with AVX-512), and the tokens stay HF's."""
    from engine.kernels import cpu_gemm
    from engine.kernels.cpu_paths import PREFILL_MIN_ROWS

    taken = set()
    run = cpu_gemm._run

    def recording_run(gemm, x, *args):
        if x.shape[0] >= PREFILL_MIN_ROWS:
            taken.add(gemm)
        return run(gemm, x, *args)

    monkeypatch.setattr(cpu_gemm, "_run", recording_run)
    prompts = [f"Story {i}: " + "Write a short poem about the sea. " * 18 for i in range(5)]
    settings = {"cache.memory": "64MiB", "scheduler.max_num_batched_tokens": 2048}
    with LLM(write_plan(tmp_path, smollm2, settings)) as llm:
        outputs = llm.generate(
            prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=1)
        )
        layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, cpu_gemm.PackableLinear)]
    assert taken == {layer.prefill_gemm for layer in layers}
    for out in outputs:
        assert_matches_hf(smollm2, out.prompt_token_ids, out.token_ids, [lp.logprob for lp in out.logprobs])


@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("interleave", "dense", "comm"),
    [(64, "replicated", "ag_rs"), (1, "sharded", "a2a")],  # the other pairs: test_dcp_equivalence, tiny models
)
def test_tp1_dcp2_replicas_match_hf(tmp_path, smollm2, interleave, dense, comm):
    settings = {"parallel.dcp": 2, "parallel.interleave": interleave, "cache.block_size": 64, "cache.memory": "64MiB"}
    plan = write_plan(tmp_path, smollm2, {**settings, "parallel.dense": dense, "parallel.dcp_comm_backend": comm})
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    records, stats = dcpctl_run(plan, prompts_file, tmp_path / "out.jsonl", tmp_path / "stats", new_tokens=NEW_TOKENS)
    assert len(stats) == 2 and {s["dcp_rank"] for s in stats} == {0, 1}
    placement = validate_plan_file(plan).require_valid().placement
    assert [s["weight_bytes"] for s in stats] == [weight_bytes(placement, s["rank"], 4) for s in stats]
    if dense == "sharded":  # o_proj, MLP and the tied embedding halved; q/k/v whole: 288.3 MiB of 513.1 MiB
        assert all(287 * 2**20 < s["weight_bytes"] < 290 * 2**20 for s in stats)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    for prompt, record in zip(PROMPTS, records, strict=True):
        assert_matches_hf(
            smollm2, tokenizer(prompt).input_ids, record["token_ids"], [lp["logprob"] for lp in record["logprobs"]]
        )


@pytest.mark.multiproc
@pytest.mark.parametrize("interleave", [1])  # the other shipped pairs: test_pd (tiny models), plan validation
def test_shipped_pd_plans_through_the_router_match_hf(tmp_path, smollm2, interleave):
    """`dcpctl run plans/cpu/smollm2_pd_dcp2_iN.yaml --prompts-file`: prefill tp1/dcp1 -> decode tp1/dcp2 over NIXL,
    offline through the deployment's router, token for token HF's (and so the colocated plans')."""
    plan = REPO / f"plans/cpu/smollm2_pd_dcp2_i{interleave}.yaml"
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "dcpctl.cli", "run", str(plan), "cache.memory=128MiB", "prefill.cache.memory=128MiB"]
    cmd += ["--prompts-file", str(prompts_file), "--max-tokens", str(NEW_TOKENS), "--ignore-eos", "--logprobs", "1"]
    result = subprocess.run([*cmd, "--output", str(out)], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    for prompt, record in zip(PROMPTS, read_jsonl(out), strict=True):
        assert_matches_hf(
            smollm2, tokenizer(prompt).input_ids, record["token_ids"], [lp["logprob"] for lp in record["logprobs"]]
        )

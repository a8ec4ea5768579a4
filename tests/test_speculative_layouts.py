"""Speculative decoding (ngram) on layouts of several ranks under torchrun (gloo, CPU): greedy output equals HF's
and the same plan's without speculation, token for token, with proposals accepted and rejected.

The verification of [last token, k proposals] is a multi-token chunk with cached context, so its k + 1 positions
straddle interleave runs and virtual blocks and land on both DCP ranks; the rejected ones' KV stays in those ranks'
caches past the sequence's length, where no later step reads it.
"""

from __future__ import annotations

import json

import httpx
import pytest

from engine import LLM, SamplingParams
from engine.serving.plan_server import PlanServer
from tests.oracle import LOGPROB_TOL, hf_greedy, prompt_ids, write_plan
from tests.test_dcp_equivalence import dcpctl_run
from tests.test_pd import assert_hf, complete_all, pd_plan, settled
from tests.test_server import sse_events

pytestmark = pytest.mark.multiproc

LENGTHS = [1, 6, 17, 33, 50]
NEW_TOKENS = 32
NGRAM = {
    "speculative_config.method": "ngram",
    "speculative_config.num_speculative_tokens": 4,
    "speculative_config.prompt_lookup_min": 1,
    "speculative_config.prompt_lookup_max": 3,
}
MLA = ("deepseek_v2", {})
KV1 = ("llama", {"num_kv_heads": 1})  # tp 2 replicates its one KV head: dcp 2 inside TP
KV2 = ("llama", {"num_kv_heads": 2})  # tp 1: dcp 2 adds a replica rank

CASES = {
    "mla-tp1-dcp2-i1-replica": (MLA, {"parallel.dcp": 2}),
    "mla-tp1-dcp2-i16-replica-chunked": (
        MLA,
        {"parallel.dcp": 2, "parallel.interleave": 16, "scheduler.max_num_batched_tokens": 24},
    ),
    "mla-tp2-dcp2-i1-in-tp": (MLA, {"parallel.tp": 2, "parallel.dcp": 2}),
    "gqa-tp1-dcp2-i1-replica-replicated-ag_rs": (
        KV2,
        {"parallel.dcp": 2, "parallel.dense": "replicated", "parallel.dcp_comm_backend": "ag_rs"},
    ),
    # 2 layers x 2 x 2 KV heads x 16 dims x 4 B = 512 B/token/rank: 40 KiB = 5 blocks of 16 per rank, 160 tokens
    "gqa-tp1-dcp2-i16-replica-preempt": (
        KV2,
        {"parallel.dcp": 2, "parallel.interleave": 16, "cache.memory": "40KiB", "model.max_model_len": 120},
    ),
    "gqa-tp2-dcp2-i16-in-tp-cpu-backend": (
        KV1,
        {"parallel.tp": 2, "parallel.dcp": 2, "parallel.interleave": 16, "attention.backend": "cpu"},
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_layout_speculates_exactly(tmp_path, echo_models, case):
    (arch, sizes), settings = CASES[case]
    folder = echo_models(arch, **sizes)
    prompts = prompt_ids(len(LENGTHS), LENGTHS, seed=5)
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts))
    # HF's greedy tokens are the plain plan's on every layout (test_dcp_equivalence): the speculating run must give them
    plan = write_plan(tmp_path, folder, {**settings, **NGRAM}, "spec.yaml")
    records, _ = dcpctl_run(plan, prompts_file, tmp_path / "spec.jsonl", tmp_path / "spec", NEW_TOKENS)
    for ids, spec in zip(prompts, records, strict=True):
        tokens, logprobs = hf_greedy(folder, ids, NEW_TOKENS)
        assert spec["token_ids"] == tokens, f"{case}: prompt of {len(ids)} tokens diverged"
        ours = [lp["logprob"] for lp in spec["logprobs"]]
        assert max(abs(a - b) for a, b in zip(ours, logprobs, strict=True)) < LOGPROB_TOL
    proposed = sum(r["speculative"]["proposed"] for r in records)
    accepted = sum(r["speculative"]["accepted"] for r in records)
    assert proposed > accepted > 0, (proposed, accepted)
    if "preempt" in case:
        assert any(r["num_preemptions"] for r in records)


DRAFT_CASES = {
    "mla-tp1-dcp2-i4-replica": (MLA, {"parallel.dcp": 2, "parallel.interleave": 4}),
    "mla-tp2-dcp2-i1-in-tp": (MLA, {"parallel.tp": 2, "parallel.dcp": 2}),
    "gqa-tp2-dcp2-i16-in-tp": (KV1, {"parallel.tp": 2, "parallel.dcp": 2, "parallel.interleave": 16}),
}


@pytest.mark.parametrize("case", list(DRAFT_CASES))
def test_layout_speculates_with_a_draft_model_exactly(tmp_path, tiny_models, noisy_drafts, case):
    """method draft_model: the draft runs unsharded on rank 0 and its proposals travel in the step plan; with an
    often-wrong draft and with the target as its own draft (every proposal accepted), the output is the plain
    run's and HF's."""
    (arch, sizes), settings = DRAFT_CASES[case]
    folder = tiny_models(arch, **sizes)
    prompts = prompt_ids(len(LENGTHS), LENGTHS, seed=5)
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts))
    draft = {"speculative_config.method": "draft_model", "speculative_config.num_speculative_tokens": 3}
    runs = {}  # HF's greedy tokens are the plain plan's (test_dcp_equivalence)
    for name, extra in (
        ("noisy", {**draft, "speculative_config.model": str(noisy_drafts(arch, **sizes))}),
        ("self", {**draft, "speculative_config.model": str(folder)}),
    ):
        plan = write_plan(tmp_path, folder, {**settings, **extra}, f"{name}.yaml")
        runs[name], _ = dcpctl_run(plan, prompts_file, tmp_path / f"{name}.jsonl", tmp_path / name, NEW_TOKENS)
    for i, ids in enumerate(prompts):
        tokens, _ = hf_greedy(folder, ids, NEW_TOKENS)
        got = [runs[name][i]["token_ids"] for name in ("noisy", "self")]
        assert got == [tokens] * 2, f"{case}: prompt of {len(ids)} tokens diverged"
    noisy = [sum(r["speculative"][k] for r in runs["noisy"]) for k in ("proposed", "accepted")]
    assert noisy[0] > noisy[1] > 0, noisy
    own = [sum(r["speculative"][k] for r in runs["self"]) for k in ("proposed", "accepted")]
    assert own[0] == own[1] > 0, own


PD_CASES = {
    # a dcp-1 prefill side; the decode side adds a replica rank and holds whole blocks (interleave = block size)
    "gqa-tp1-dcp1-to-tp1-dcp2-i16": (KV2, {"cache.block_size": 16}, {"parallel.dcp": 2, "parallel.interleave": 16}),
    # MLA, decode side dcp 2 inside TP with interleave 1: every verified position alternates between the ranks
    "mla-tp1-dcp1-to-tp2-dcp2-i1": (MLA, {"cache.block_size": 8}, {"parallel.tp": 2, "parallel.dcp": 2}),
}


@pytest.mark.parametrize("case", list(PD_CASES))
def test_pd_pair_speculates_after_the_pull_exactly(tmp_path, echo_models, case):
    """A real P/D pair (prefill instance, decode instance under torchrun, router): the decode side pulls each
    prompt's KV and speculates with ngram on it. Greedy output equals the colocated tp1/dcp1 plan without
    speculation token for token (and HF's); the counters reach the client through the router, streamed (on the
    finishing chunk) or not; nothing is held after."""
    (arch, sizes), prefill, decode = PD_CASES[case]
    folder = echo_models(arch, **sizes)
    plan = pd_plan(tmp_path, folder, prefill, {"cache.block_size": 16, **decode, **NGRAM})
    prompts = prompt_ids(len(LENGTHS), LENGTHS, seed=5)
    with LLM(write_plan(tmp_path, folder, name="colocated.yaml")) as llm:
        colocated = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    stream = {"prompt": prompts[-1], "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}
    with PlanServer(plan, log_path=tmp_path / "pd.log", health_timeout_s=300) as server:
        bodies = complete_all(server.base_url, prompts, NEW_TOKENS)
        with (
            httpx.Client(base_url=server.base_url, timeout=300, trust_env=False) as http,
            http.stream("POST", "/v1/completions", json=stream) as response,
        ):
            events = sse_events(response.iter_lines())
        stats = settled(server.base_url)
    for ids, body, plain in zip(prompts, bodies, colocated, strict=True):
        assert body["choices"][0]["token_ids"] == plain.token_ids, f"prompt of {len(ids)} tokens diverged"
        assert body["kv_transfer"][0]["tokens"] == len(ids) - 1  # the prompt's KV came from the prefill side
    assert_hf(folder, prompts, bodies, NEW_TOKENS)
    counters = [body["speculative"][0] for body in bodies]
    assert sum(c["proposed"] for c in counters) > sum(c["accepted"] for c in counters) > 0
    assert events[-1] == "[DONE]"
    finishing = events[-2]
    assert finishing["choices"][0]["finish_reason"] == "length"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == colocated[-1].text
    assert finishing["speculative"] == bodies[-1]["speculative"]  # the same request, the same proposals
    assert 0 < finishing["kv_transfer"][0]["tokens"] < len(prompts[-1]) - 1  # the decode side's prefix cache
    assert stats["speculative"]["proposed"] == sum(c["proposed"] for c in counters) + counters[-1]["proposed"]
    assert stats["kv_transfer"]["pulls"] == len(prompts) + 1 and stats["kv_transfer"]["pulls_failed"] == 0

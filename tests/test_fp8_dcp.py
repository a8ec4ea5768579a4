"""An fp8 KV cache under DCP: sharding never changes what is quantized, so every layout gives tp1/dcp1's tokens.

Real `dcpctl run`s (torchrun, gloo) of tiny MLA and GQA checkpoints: tp1/dcp2 (replica ranks) and tp2/dcp2, at
interleave 1 and at interleave = block size, with chunked prefill and preemption (a recompute prefills what was
decoded: it must see the keys and values as the cache stored them), against the one-rank run with the same cache
dtype, on the torch backend and on the cpu backend (its C++ kernels store and read the fp8 cache). The one-rank GQA
run is itself checked against HF transformers with every key and value (after rotary) rounded as the cache stores
them (`oracle.hf_greedy_stored_kv`; MLA caches a latent HF never materializes). Per-layer scales, from the
checkpoint or calibrated from the first prefill (`cache.calculate_kv_scales`), are the same on every layout and HF
with the same scales agrees.

On these tiny models the layouts agree to float32's tolerance. On a real model they need not: fp8 rounding turns the
last-bit differences of float32 summation orders upstream (a DCP merge, a sharded o_proj) into a whole fp8 step of an
occasional key or value (docs/results/gsm8k.md measures it on SmolLM2).
"""

from __future__ import annotations

import json

import pytest

from engine.kv_quant import fp32
from engine.plan.schema import CACHE_DTYPE_ALIASES
from tests.oracle import LOGPROB_TOL, hf_calibrated_scales, hf_greedy, hf_greedy_stored_kv, prompt_ids, write_plan
from tests.test_dcp_equivalence import LENGTHS, NEW_TOKENS, dcpctl_run
from tests.test_kv_scales import GQA_SCALES

pytestmark = pytest.mark.multiproc

MLA = ("deepseek_v2", {})
KV1 = ("llama", {"num_kv_heads": 1})
# MLA: 2 layers x (32 + 8) x 1 byte = 80 B/token/rank: 10 KiB = 8 blocks of 16 per rank, so the 7 prompts preempt
PREEMPT = {"cache.memory": "10KiB", "model.max_model_len": 250, "scheduler.max_num_batched_tokens": 64}
CHUNKED = {"scheduler.max_num_batched_tokens": 24}

CASES = {
    # name: (model, cache dtype, attention backend, the layouts compared with tp1/dcp1)
    "mla-e4m3-torch": (
        MLA,
        "fp8",
        "torch",
        [
            {"parallel.dcp": 2, "parallel.interleave": 16, **CHUNKED},
            {"parallel.tp": 2, "parallel.dcp": 2, "parallel.interleave": 1, **PREEMPT},
        ],
    ),
    "gqa-e5m2-cpu": (
        KV1,
        "fp8_e5m2",
        "cpu",
        [
            {"parallel.dcp": 2, "parallel.interleave": 1, **CHUNKED},
            {"parallel.tp": 2, "parallel.dcp": 2, "parallel.interleave": 16},
        ],
    ),
}


def kv_dtype(spelling: str) -> str:
    return CACHE_DTYPE_ALIASES.get(spelling, spelling)


@pytest.mark.parametrize("case", list(CASES))
def test_fp8_layouts_give_the_one_rank_tokens(tmp_path, tiny_models, case):
    (arch, sizes), cache_dtype, backend, layouts = CASES[case]
    folder = tiny_models(arch, **sizes)
    compare_layouts(tmp_path, folder, arch, {"cache.dtype": cache_dtype, "attention.backend": backend}, layouts)


def test_checkpoint_scales_under_dcp_match_hf_with_the_same_scales(tmp_path, kv_scaled_models):
    """A checkpoint with per-layer k_scale / v_scale (tests/test_kv_scales.py: both of vLLM's naming schemes, one key
    scale that saturates): every layout stores and reads with them, HF with the same stored values agrees, and HF with
    scale 1.0 does not."""
    folder = kv_scaled_models(KV1[0], GQA_SCALES, **KV1[1])
    scales = ((fp32(0.03), fp32(0.05)), (fp32(0.015), fp32(0.1)))
    layouts = [
        {"parallel.dcp": 2, "parallel.interleave": 1, **CHUNKED},
        {"parallel.tp": 2, "parallel.dcp": 2, "parallel.interleave": 16},
    ]
    compare_layouts(tmp_path, folder, "llama", {"cache.dtype": "fp8", "attention.backend": "cpu"}, layouts, scales)


@pytest.mark.parametrize(("model", "backend"), [(KV1, "torch"), (MLA, "cpu")], ids=["gqa-torch", "mla-cpu"])
def test_calibrated_scales_are_the_same_on_every_layout(tmp_path, tiny_models, model, backend):
    """cache.calculate_kv_scales: the first step (all seven prompts) sets the scales, the largest over every rank's
    heads and tokens: tp2/dcp2 calibrates tp1/dcp1's scales and gives its tokens; for GQA those are HF's with the
    scales vLLM's rule gives on HF's keys and values (MLA: the latent's, HF never materializes it)."""
    arch, sizes = model
    folder = tiny_models(arch, **sizes)
    scales = None
    if arch == "llama":
        scales = hf_calibrated_scales(folder, prompt_ids(len(LENGTHS), LENGTHS, seed=11), "fp8_e4m3")
    common = {"cache.dtype": "fp8_e4m3", "cache.calculate_kv_scales": True, "attention.backend": backend}
    layouts = [{"parallel.tp": 2, "parallel.dcp": 2, "parallel.interleave": 1}]
    compare_layouts(tmp_path, folder, arch, common, layouts, scales)


def compare_layouts(
    tmp_path,
    folder,
    arch: str,
    common: dict,
    layouts: list[dict],
    scales: tuple[tuple[float, float], ...] | None = None,
) -> None:
    """tp1/dcp1 with `common` against HF in float32 (it must differ: the cache is narrower) and, for GQA, against HF
    with the stored keys and values (layer scales `scales`, None: 1.0); then every layout against tp1/dcp1."""
    prompts = prompt_ids(len(LENGTHS), LENGTHS, seed=11)
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts))
    cache_dtype = kv_dtype(common["cache.dtype"])

    def run(name: str, settings: dict) -> tuple[list[dict], list[dict]]:
        plan = write_plan(tmp_path, folder, {**common, **settings}, f"{name}.yaml")
        return dcpctl_run(plan, prompts_file, tmp_path / f"{name}.jsonl", tmp_path / f"stats-{name}")

    base, _ = run("base", {})
    # the cache really is narrower: the fp32 oracle's logprobs differ beyond the float32 tolerance somewhere
    assert max_logprob_gap(prompts, base, lambda ids: hf_greedy(folder, ids, NEW_TOKENS)) > LOGPROB_TOL
    if arch == "llama":  # and HF with the same stored keys and values gives its tokens and logprobs
        for ids, record in zip(prompts, base, strict=True):
            tokens, logprobs = hf_greedy_stored_kv(folder, ids, NEW_TOKENS, cache_dtype, scales)
            assert record["token_ids"] == tokens, f"prompt of {len(ids)} tokens"
            ours = [lp["logprob"] for lp in record["logprobs"]]
            assert max(abs(a - b) for a, b in zip(ours, logprobs, strict=True)) < LOGPROB_TOL
        if scales is not None:  # the scales matter: HF storing with 1.0 is another model
            unscaled = max_logprob_gap(
                prompts, base, lambda ids: hf_greedy_stored_kv(folder, ids, NEW_TOKENS, cache_dtype)
            )
            assert unscaled > LOGPROB_TOL
    for i, settings in enumerate(layouts):
        records, stats = run(f"layout{i}", settings)
        assert len(stats) == 2
        for ids, want, got in zip(prompts, base, records, strict=True):
            assert got["token_ids"] == want["token_ids"], f"{common} {settings}: prompt of {len(ids)} tokens"
            ours = [lp["logprob"] for lp in got["logprobs"]]
            theirs = [lp["logprob"] for lp in want["logprobs"]]
            assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < LOGPROB_TOL
        if "cache.memory" in settings:
            assert any(r["num_preemptions"] for r in records)


def max_logprob_gap(prompts: list[list[int]], records: list[dict], oracle) -> float:
    """The largest gap between a run's logprobs and an oracle's (tokens, logprobs) on the same prompts, up to the
    first token where they part (the oracle's logprob is of its own token)."""
    return max(
        abs(a["logprob"] - b)
        for ids, record in zip(prompts, records, strict=True)
        for a, b in zip(record["logprobs"], oracle(ids)[1], strict=True)
    )

"""An fp8 KV cache's per-layer scales: read from the checkpoint under vLLM's names, calibrated from the first prefill
by vLLM's rule (`cache.calculate_kv_scales`), a bad one refused with one line; the plan rules around them. One-rank
engines in this process on tiny checkpoints; tests/test_fp8_dcp.py runs them under DCP against HF."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from engine import LLM, SamplingParams
from engine.errors import UserError
from engine.kv_quant import fp32
from engine.plan.checks import validate_plan_file
from tests.oracle import hf_calibrated_scales, prompt_ids, write_plan
from tests.test_pd_plan import messages, pd_pair

# layer 0 under llm-compressor's (compressed-tensors) names, layer 1 under ModelOpt's; layer 1's key scale saturates
# a few of the tiny model's keys (up to ~8.3 / 0.015 > 448)
GQA_SCALES = {
    "model.layers.0.self_attn.k_scale": 0.03,
    "model.layers.0.self_attn.v_scale": 0.05,
    "model.layers.1.self_attn.k_proj.k_scale": 0.015,
    "model.layers.1.self_attn.v_proj.v_scale": 0.1,
}
# MLA's latent cache has one scale: the k_scale (vLLM's deprecated kv_scale too); a v_scale is not read
MLA_SCALES = {
    "model.layers.0.self_attn.k_scale": 0.02,
    "model.layers.0.self_attn.v_scale": 7.0,
    "model.layers.1.self_attn.kv_scale": 0.025,
}


def layer_scales(llm: LLM) -> list[tuple[float, float]]:
    return llm.engine.runner.kv_scales


def test_checkpoint_scales_are_vllms_names_and_the_latents_one(tmp_path, kv_scaled_models):
    gqa = kv_scaled_models("llama", GQA_SCALES, num_kv_heads=1)
    with LLM(write_plan(tmp_path, gqa, {"cache.dtype": "fp8"})) as llm:
        assert layer_scales(llm) == [(fp32(0.03), fp32(0.05)), (fp32(0.015), fp32(0.1))]
    mla = kv_scaled_models("deepseek_v2", MLA_SCALES)
    with LLM(write_plan(tmp_path, mla, {"cache.dtype": "fp8_e5m2"}, "mla.yaml")) as llm:
        assert layer_scales(llm) == [(fp32(0.02), fp32(0.02)), (fp32(0.025), fp32(0.025))]
    with LLM(write_plan(tmp_path, gqa, {"cache.dtype": "bfloat16"}, "bf16.yaml")) as llm:
        assert layer_scales(llm) == [(1.0, 1.0)] * 2  # a 16-bit cache stores the values themselves


def test_calibration_is_the_first_prefills_amax_over_200_and_100_and_overrides_the_checkpoint(
    tmp_path, kv_scaled_models
):
    """vLLM's rule on the first step with a prefill (all three prompts: within the token budget), checked against
    HF's keys and values; later steps (decodes, a fourth prompt) leave the scales alone."""
    folder = kv_scaled_models("llama", GQA_SCALES, num_kv_heads=1)
    prompts = prompt_ids(4, [5, 40, 17, 60], seed=3)
    settings = {"cache.dtype": "fp8_e4m3", "cache.calculate_kv_scales": True}
    with LLM(write_plan(tmp_path, folder, settings)) as llm:
        greedy = SamplingParams(max_tokens=3, temperature=0)
        llm.generate(prompts[:3], greedy)
        calibrated = layer_scales(llm)
        llm.generate(prompts[3:], greedy)
        assert layer_scales(llm) == calibrated
    want = hf_calibrated_scales(folder, prompts[:3], "fp8_e4m3")
    assert calibrated != [(fp32(0.03), fp32(0.05)), (fp32(0.015), fp32(0.1))]
    for got, expected in zip(calibrated, want, strict=True):
        assert got == pytest.approx(expected, rel=1e-5)  # float32 summation orders differ upstream
        assert got == tuple(fp32(s) for s in got)  # float32 values: what every backend stores and reads with


def test_an_mla_calibration_is_one_scale_for_the_latent(tmp_path, tiny_models):
    settings = {"cache.dtype": "fp8_e5m2", "cache.calculate_kv_scales": True}
    with LLM(write_plan(tmp_path, tiny_models("deepseek_v2"), settings)) as llm:
        llm.generate(prompt_ids(2, [9, 30], seed=4), SamplingParams(max_tokens=2, temperature=0))
        scales = layer_scales(llm)
    assert all(k == v and 0 < k < 1 for k, v in scales)  # the latent reaches about 7 here: not 1.0


@pytest.mark.parametrize("value", [0.0, -0.5, math.nan, [0.1, 0.2]], ids=["zero", "negative", "nan", "two"])
def test_a_bad_checkpoint_scale_is_a_one_line_error(tmp_path, kv_scaled_models, value):
    name = "model.layers.1.self_attn.v_scale"
    folder = kv_scaled_models("llama", {name: value}, num_kv_heads=1)
    if isinstance(value, list):
        want = (
            f"checkpoint tensor {name} has 2 values; dcpctl reads one KV cache scale per layer (per tensor): "
            "store a single value"
        )
    else:
        want = (
            f"checkpoint tensor {name} is {value}: a KV cache scale must be a positive finite number; fix it, or "
            "remove it for the default 1.0"
        )
    plan = write_plan(tmp_path, folder, {"cache.dtype": "fp8"})
    with pytest.raises(UserError) as raised:
        LLM(plan)
    assert str(raised.value) == want
    if value == 0.0:  # and the CLI prints it as one line, no traceback
        cmd = [sys.executable, "-m", "dcpctl.cli", "run", str(plan), "--prompt", "hi"]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert result.returncode == 1
        assert want in result.stderr and "Traceback" not in result.stderr, result.stderr[-2000:]


def test_calibration_needs_an_fp8_cache(tmp_path, tiny_models):
    plan = write_plan(tmp_path, tiny_models("llama"), {"cache.calculate_kv_scales": True})
    assert messages(validate_plan_file(plan)) == [
        "cache.calculate_kv_scales: cache.calculate_kv_scales calibrates an fp8 cache's scales, but cache.dtype is "
        "auto; set cache.dtype=fp8 (or fp8_e4m3, fp8_e5m2) or drop cache.calculate_kv_scales"
    ]


def test_a_pd_pair_refuses_calibration_on_either_side(make_plan, llama_folder):
    """Both sides of a hand-off must hold the same scales: the checkpoint's (or 1.0) on both, never calibrated."""
    fp8 = "cache: {dtype: fp8}\n"
    path = pd_pair(
        make_plan, llama_folder, llama_folder, prefill=fp8, decode="cache: {dtype: fp8, calculate_kv_scales: true}\n"
    )
    assert messages(validate_plan_file(path)) == [
        "cache.calculate_kv_scales: cache.calculate_kv_scales is set on the decode side: each instance would "
        "calibrate its own fp8 scales, and the decode side must read the prefill side's KV with the scales it was "
        "stored with; drop it on both (both then use the checkpoint's k_scale/v_scale, else 1.0)"
    ]

"""Single-rank engine vs HF transformers on tiny checkpoints: greedy tokens and logprobs (fp32, CPU)."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.kernels.cpu_kernels import cpu_kernels_available
from tests.oracle import LOGPROB_TOL, hf_greedy, prompt_ids, write_plan

LENGTHS = [1, 5, 17, 40, 100, 150]  # 150 spans 10 blocks of 16 and 3 of 64
NEW_TOKENS = 32
ARCHS = [
    ("llama", {}),
    ("qwen2", {}),
    ("deepseek_v2", {}),
    ("deepseek_v2", {"q_lora_rank": 24}),
    ("llama", {"tie_word_embeddings": True, "num_kv_heads": 1}),
]


def check_against_hf(folder, prompts, outputs, new_tokens=NEW_TOKENS):
    for ids, out in zip(prompts, outputs, strict=True):
        tokens, logprobs = hf_greedy(folder, ids, new_tokens)
        assert out.token_ids == tokens, f"prompt of {len(ids)} tokens diverged"
        ours = [lp.logprob for lp in out.logprobs]
        assert max(abs(a - b) for a, b in zip(ours, logprobs, strict=True)) < LOGPROB_TOL


def greedy(n=NEW_TOKENS, **kw):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=1, **kw)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize(("arch", "sizes"), ARCHS, ids=lambda v: v if isinstance(v, str) else "-".join(map(str, v)))
def test_greedy_matches_hf(tmp_path, tiny_models, arch, sizes, block_size, backend):
    folder = tiny_models(arch, **sizes)
    prompts = prompt_ids(len(LENGTHS), LENGTHS)
    with LLM(write_plan(tmp_path, folder, {"cache.block_size": block_size, "attention.backend": backend})) as llm:
        outputs = llm.generate(prompts, greedy())
    check_against_hf(folder, prompts, outputs)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_chunked_prefill_mixed_batches_and_preemption(tmp_path, tiny_models, backend, monkeypatch):
    """A small token budget chunks long prompts while others decode; a small cache forces preemption. The torch
    backend attends to a chunk's cached context and merges by LSE; the cpu backend's kernel attends to both in one
    pass (`prefill_in_context`), which must run here."""
    from engine.attention.cpu_backend import CpuBackend

    one_pass = []
    original = CpuBackend.prefill_in_context

    def spy(self, *args):
        out = original(self, *args)
        one_pass.append(out is not None)
        return out

    monkeypatch.setattr(CpuBackend, "prefill_in_context", spy)
    folder = tiny_models("llama")
    prompts = prompt_ids(len(LENGTHS), LENGTHS, seed=1)
    # 2 layers x 2 x 2 KV heads x 16 dims x 4 B = 512 B/token: 96 KiB = 48 blocks of 4 = 192 tokens
    plan = write_plan(
        tmp_path,
        folder,
        {
            "model.max_model_len": 190,
            "cache.block_size": 4,
            "cache.memory": "96KiB",
            "scheduler.max_num_batched_tokens": 24,
            "attention.backend": backend,
        },
    )
    with LLM(plan) as llm:
        outputs = llm.generate(prompts, greedy())
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.blocks.num_used_blocks == 0
    assert any(o.num_preemptions for o in outputs)
    assert (len(one_pass) > 0 and all(one_pass)) == (backend == "cpu" and cpu_kernels_available())
    check_against_hf(folder, prompts, outputs)


@pytest.mark.parametrize("arch", ["llama", "deepseek_v2"])
def test_last_layer_mlp_runs_only_on_the_rows_whose_logits_are_read(tmp_path, tiny_models, arch):
    """A prompt chunk's logits are read at its last token only (every token with prompt logprobs, none before the
    end of a chunked prompt): the last layer's MLP sees exactly those rows, and the tokens, logprobs and prompt
    logprobs still match HF."""
    from tests.oracle import hf_prompt_logprobs

    folder = tiny_models(arch)
    prompts = prompt_ids(5, [40, 5, 100, 30, 120], seed=5)
    plan = write_plan(tmp_path, folder, {"scheduler.max_num_batched_tokens": 48})
    with LLM(plan) as llm:
        runner = llm.engine.runner
        last, first = runner.model.layers[-1].mlp, runner.model.layers[0].mlp
        seen: dict[str, list[int]] = {"last": [], "first": []}
        for name, mlp in (("last", last), ("first", first)):
            mlp.forward = lambda x, run=mlp.forward, name=name: seen[name].append(x.shape[0]) or run(x)
        expected: list[int] = []
        tokens: list[int] = []

        def execute(step, run=runner.execute):
            expected.append(sum(c.num_logit_rows for c in step.chunks))
            tokens.append(step.num_tokens)
            return run(step)

        runner.execute = execute
        outputs = llm.generate(prompts[:4], greedy(8)) + llm.generate(prompts[4:], greedy(8))  # alone: 48 + 48 + 24
        (scored,) = llm.generate(prompts[3:4], SamplingParams(max_tokens=1, prompt_logprobs=1))
    steps_that_read = [n for n in expected if n]
    assert seen["last"] == steps_that_read and 0 in expected  # a step that only chunks a prompt skips the MLP
    assert seen["first"] == tokens  # the other layers' MLPs still run on every token
    check_against_hf(folder, prompts, outputs, new_tokens=8)
    ours = [lp.logprob for lp in scored.prompt_logprobs[1:]]
    assert max(abs(a - b) for a, b in zip(ours, hf_prompt_logprobs(folder, prompts[3]), strict=True)) < LOGPROB_TOL


def test_prefix_cache_reuse_gives_same_tokens(tmp_path, tiny_models):
    folder = tiny_models("deepseek_v2")
    shared = prompt_ids(1, [70], seed=2)[0]
    prompts = [shared + tail for tail in prompt_ids(3, [3, 9, 20], seed=3)]
    with LLM(write_plan(tmp_path, folder)) as llm:
        first = llm.generate(prompts[:1], greedy())
        rest = llm.generate(prompts[1:], greedy())
        assert llm.engine.blocks.prefix_hit_tokens >= 2 * 64  # 4 full blocks of 16 reused by each later prompt
    check_against_hf(folder, prompts, first + rest)


def test_prompt_logprobs_match_hf(tmp_path, tiny_models):
    from tests.oracle import hf_prompt_logprobs

    folder = tiny_models("qwen2")
    ids = prompt_ids(1, [45], seed=4)[0]
    with LLM(write_plan(tmp_path, folder, {"scheduler.max_num_batched_tokens": 16})) as llm:
        (out,) = llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=2))
    assert out.token_ids == [] and out.finish_reason == "length"
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    ours = [lp.logprob for lp in out.prompt_logprobs[1:]]
    theirs = hf_prompt_logprobs(folder, ids)
    assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < LOGPROB_TOL
    assert all(len(lp.top) == 2 for lp in out.prompt_logprobs[1:])


def test_stop_strings_max_tokens_and_stop_tokens(tmp_path, tiny_models):
    folder = tiny_models("llama")
    with LLM(write_plan(tmp_path, folder)) as llm:
        (free,) = llm.generate(["the quick brown fox"], greedy(24))
        text = free.text
        assert free.finish_reason == "length" and len(free.token_ids) == 24
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        assert stop.strip(), text
        (cut,) = llm.generate(["the quick brown fox"], greedy(24, stop=[stop]))
        assert cut.finish_reason == "stop" and cut.stop_reason == stop
        assert cut.text == text[: text.index(stop)]
        (tok,) = llm.generate(["the quick brown fox"], greedy(24, stop_token_ids=[free.token_ids[5]]))
        first = free.token_ids.index(free.token_ids[5])
        assert tok.finish_reason == "stop" and tok.token_ids == free.token_ids[: first + 1]


def test_eos_ends_generation_like_hf(tmp_path, tiny_models):
    """Make the 4th greedy token the checkpoint's EOS: we stop there and return it, as HF generate does."""
    import json
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    source = tiny_models("llama")
    ids = prompt_ids(1, [12], seed=5)[0]
    tokens, _ = hf_greedy(source, ids, 8)
    eos = tokens[3]
    folder = tmp_path / "eos-model"
    shutil.copytree(source, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    hf_out = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids) :].tolist()
    with LLM(write_plan(tmp_path, folder)) as llm:
        (out,) = llm.generate([ids], SamplingParams(max_tokens=8, temperature=0))
    assert out.finish_reason == "stop"
    assert out.token_ids == hf_out == tokens[: tokens.index(eos) + 1]


def test_seeded_sampling_is_reproducible(tmp_path, tiny_models):
    folder = tiny_models("llama")
    with LLM(write_plan(tmp_path, folder)) as llm:
        params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
        a, b = llm.generate(["hello", "hello"], [params, params])
        c = llm.generate(["hello"], SamplingParams(max_tokens=16, temperature=1.0, seed=8, ignore_eos=True))[0]
    assert a.token_ids == b.token_ids
    assert c.token_ids != a.token_ids


def test_too_long_prompt_is_rejected_others_finish(tmp_path, tiny_models):
    folder = tiny_models("llama")
    with LLM(write_plan(tmp_path, folder, {"model.max_model_len": 64})) as llm:
        long, short = llm.generate([list(range(3, 103)), [5, 6, 7]], greedy(4))
    assert long.finish_reason == "error"
    assert long.error == (
        "the prompt has 100 tokens but the plan's max_model_len is 64; shorten the prompt or raise model.max_model_len"
    )
    assert short.finish_reason == "length" and len(short.token_ids) == 4


def test_bad_model_folders(tmp_path, make_plan):
    from engine.errors import UserError
    from tests.conftest import write_config

    with pytest.raises(UserError, match=r"model folder .* not found"):
        LLM(make_plan(f"model: {{path: {tmp_path / 'absent'}}}\nlaunch: {{device: cpu}}\n"))
    folder = write_config(tmp_path / "gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(UserError, match=r"unsupported architecture 'GPT2LMHeadModel'; supported: LlamaForCausalLM"):
        LLM(make_plan(f"model: {{path: {folder}}}\nlaunch: {{device: cpu}}\n"))
    folder = write_config(tmp_path / "noweights", model_type="llama")
    with pytest.raises(UserError, match=r"has no \*\.safetensors weights"):
        LLM(make_plan(f"model: {{path: {folder}}}\nlaunch: {{device: cpu}}\n"))

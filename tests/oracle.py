"""HF transformers as the independent oracle: greedy tokens and logprobs from the same checkpoint folder."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import yaml

LOGPROB_TOL = 2e-4  # fp32 on CPU: summation order differs (paged gather, DCP merge), nothing else


@functools.lru_cache(maxsize=8)
def _hf_model(folder: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model.eval()


def hf_greedy(folder: str | Path, prompt_ids: list[int], new_tokens: int) -> tuple[list[int], list[float]]:
    """HF's greedy continuation (EOS does not stop it) and the logprob of each chosen token."""
    tokens, logprobs = _hf_greedy(str(folder), tuple(prompt_ids), new_tokens)
    return list(tokens), list(logprobs)


@functools.lru_cache(maxsize=256)
@torch.inference_mode()
def _hf_greedy(folder: str, prompt_ids: tuple[int, ...], new_tokens: int) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """Memoized: many tests check other layouts against the same prompts of the same checkpoint (a checkpoint folder
    is never rewritten within a session), and HF's own decode is most of such a test's time on SmolLM2."""
    model = _hf_model(folder)
    out = model(torch.tensor([prompt_ids]), use_cache=True)
    tokens, logprobs = [], []
    for _ in range(new_tokens):
        logp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
        token = int(logp.argmax())
        tokens.append(token)
        logprobs.append(float(logp[token]))
        out = model(torch.tensor([[token]]), cache=out.past_key_values, use_cache=True)
    return tuple(tokens), tuple(logprobs)


@functools.lru_cache(maxsize=2)
def _hf_model_stored_kv(folder: str, cache_dtype: str, scales: tuple[tuple[float, float], ...] | None):
    """HF's model with every key and value (after rotary) rounded as a `cache_dtype` KV cache stores it (with layer
    i's (k_scale, v_scale) = scales[i], None: 1.0), through transformers' attention interface (GQA models: MLA's cache
    holds the latent, which HF never materializes)."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from engine import kv_quant

    stored = kv_quant.FP8_DTYPES[cache_dtype]

    def attention(module, query, key, value, attention_mask, **kwargs):
        k_scale, v_scale = (1.0, 1.0) if scales is None else scales[module.layer_idx]
        key, value = kv_quant.as_stored(key, stored, k_scale), kv_quant.as_stored(value, stored, v_scale)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    name = f"dcpctl_stored_{cache_dtype}_{abs(hash(scales))}"
    AttentionInterface.register(name, attention)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation=name).eval()


@torch.inference_mode()
def hf_greedy_stored_kv(
    folder: str | Path,
    prompt_ids: list[int],
    new_tokens: int,
    cache_dtype: str,
    scales: tuple[tuple[float, float], ...] | None = None,
) -> tuple[list[int], list[float]]:
    """`hf_greedy` with the keys and values an fp8 cache (`cache.dtype`, per-layer `scales`) stores: the oracle of
    an fp8 KV cache."""
    model = _hf_model_stored_kv(str(folder), cache_dtype, scales)
    out = model(torch.tensor([prompt_ids]), use_cache=True)
    tokens, logprobs = [], []
    for _ in range(new_tokens):
        logp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
        tokens.append(int(logp.argmax()))
        logprobs.append(float(logp[tokens[-1]]))
        out = model(torch.tensor([[tokens[-1]]]), cache=out.past_key_values, use_cache=True)
    return tokens, logprobs


def hf_calibrated_scales(
    folder: str | Path, prompts: list[list[int]], cache_dtype: str
) -> tuple[tuple[float, float], ...]:
    """vLLM's rule computed with HF: per layer, the largest |key| (after rotary) / 200 and |value| / 100 over the
    prompts, each layer's input computed with the layers before it reading their keys and values as the cache stores
    them (with their calibrated scales): one pass over the prompts per layer."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from engine.kv_quant import FP8_DTYPES, as_stored, fp32

    stored = FP8_DTYPES[cache_dtype]
    scales: list[tuple[float, float]] = []
    amax: dict[int, list[float]] = {}

    def probe(module, query, key, value, attention_mask, **kwargs):
        layer = module.layer_idx
        if layer < len(scales):
            key, value = as_stored(key, stored, scales[layer][0]), as_stored(value, stored, scales[layer][1])
        else:
            seen = amax.setdefault(layer, [0.0, 0.0])
            seen[0], seen[1] = max(seen[0], key.abs().max().item()), max(seen[1], value.abs().max().item())
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("dcpctl_kv_calibration", probe)
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="dcpctl_kv_calibration"
    )
    with torch.inference_mode():
        for layer in range(model.config.num_hidden_layers):
            amax.clear()
            for ids in prompts:
                model(torch.tensor([ids]))
            k, v = amax[layer]
            scales.append((fp32(k / 200), fp32(v / 100)))
    return tuple(scales)


@functools.lru_cache(maxsize=2)
def _hf_model_bf16(folder: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()


@torch.inference_mode()
def hf_bf16_disagreements(
    folder: str | Path, prompt_ids: list[int], tokens: list[int]
) -> list[tuple[int, float, float]]:
    """The steps where greedy `tokens` (after `prompt_ids`) are not what HF bf16 would pick beyond its own noise.

    The comparison rule for bfloat16, where no two implementations agree bit for bit: both round to bf16 at the
    same points with fp32 accumulation inside each matmul, but sum in different orders, so logits move by a few
    bf16 steps. HF replays the tokens step by step with its cache (teacher forcing, as `generate` runs), which
    gives its logits at every step. Its own noise on this sequence is how far those logits move when HF computes
    the same steps another way (one forward pass over the whole sequence): the largest move over all steps, and at
    least one bf16 step of the top logit (logits are bf16 values: nothing finer is resolved). A token is accepted
    when it is HF's argmax, or within that noise of HF's top logit: a near-tie HF itself could break either way.
    Past such a tie the comparison continues on our tokens. Returns (step, gap to HF's top logit, tolerance) of
    each rejected step; empty means the tokens are what HF bf16 generates wherever its numerics decide.
    """
    model = _hf_model_bf16(str(folder))
    out = model(torch.tensor([prompt_ids]), use_cache=True)
    stepwise = [out.logits[0, -1].float()]
    for token in tokens[:-1]:
        out = model(torch.tensor([[token]]), cache=out.past_key_values, use_cache=True)
        stepwise.append(out.logits[0, -1].float())
    logits = torch.stack(stepwise)
    whole = model(torch.tensor([prompt_ids + tokens[:-1]])).logits[0, len(prompt_ids) - 1 :].float()
    noise = float((logits - whole).abs().max())
    top = logits.amax(dim=-1)
    bf16_step = torch.exp2(torch.floor(torch.log2(top.abs().clamp_min(1e-30))) - 7)
    tolerance = bf16_step.clamp_min(noise)
    gap = top - logits[torch.arange(len(tokens)), torch.tensor(tokens)]
    return [(t, float(gap[t]), float(tolerance[t])) for t in range(len(tokens)) if gap[t] > tolerance[t]]


@torch.inference_mode()
def hf_prompt_logprobs(folder: str | Path, prompt_ids: list[int]) -> list[float]:
    """Logprob of each prompt token after the first, under HF's forward pass."""
    logits = _hf_model(str(folder))(torch.tensor([prompt_ids])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return [float(logp[i, prompt_ids[i + 1]]) for i in range(len(prompt_ids) - 1)]


def prompt_ids(count: int, lengths: list[int], vocab: int = 500, seed: int = 0) -> list[list[int]]:
    """Deterministic random token-id prompts of the given lengths (ids 3.. avoid the special tokens)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths[:count]]


def write_plan(folder: Path, model: Path, settings: dict | None = None, name: str = "plan.yaml") -> Path:
    """A CPU plan for `model` with small, test-friendly defaults; `settings` maps dotted keys to values."""
    plan = {
        "model": {"path": str(model), "max_model_len": 512},
        "cache": {"block_size": 16, "memory": "4MiB"},
        "attention": {"backend": "torch"},
        "launch": {"device": "cpu"},
    }
    for key, value in (settings or {}).items():
        section, field = key.split(".")
        plan.setdefault(section, {})[field] = value
    path = folder / name
    path.write_text(yaml.safe_dump(plan))
    return path


def engine_bf16_tokens(
    tmp_path: Path, folder: Path, settings: dict | None = None
) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy bf16 tokens of a one-rank `cpu`-backend run of `folder` (in this process, with plan `settings`) for
    four prompts of 1-130 tokens, each asserted to be HF bf16's by `hf_bf16_disagreements`; returns the prompts and
    the tokens."""
    from engine import LLM, SamplingParams

    prompts = prompt_ids(4, [1, 9, 40, 130], seed=7)
    plan = write_plan(tmp_path, folder, {"model.dtype": "bfloat16", "attention.backend": "cpu", **(settings or {})})
    with LLM(plan) as llm:
        outputs = [
            out.token_ids
            for out in llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
        ]
    for ids, tokens in zip(prompts, outputs, strict=True):
        assert hf_bf16_disagreements(folder, ids, tokens) == [], f"prompt of {len(ids)} tokens"
    return prompts, outputs


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def record_shrinks(blocks) -> list[int]:
    """Wrap `blocks.shrink` (a BlockManager) so that each call's freed block count is appended to the list returned."""
    given_back: list[int] = []
    shrink = blocks.shrink

    def counting_shrink(seq, num_tokens):
        before = blocks.num_free_blocks
        shrink(seq, num_tokens)
        given_back.append(blocks.num_free_blocks - before)

    blocks.shrink = counting_shrink
    return given_back

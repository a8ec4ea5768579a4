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


@torch.inference_mode()
def hf_greedy(folder: str | Path, prompt_ids: list[int], new_tokens: int) -> tuple[list[int], list[float]]:
    """HF's greedy continuation (EOS does not stop it) and the logprob of each chosen token."""
    model = _hf_model(str(folder))
    out = model(torch.tensor([prompt_ids]), use_cache=True)
    tokens, logprobs = [], []
    for _ in range(new_tokens):
        logp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
        token = int(logp.argmax())
        tokens.append(token)
        logprobs.append(float(logp[token]))
        out = model(torch.tensor([[token]]), cache=out.past_key_values, use_cache=True)
    return tokens, logprobs


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


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

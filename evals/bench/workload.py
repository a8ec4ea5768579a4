"""The benchmark's prompts: seeded random token ids of an exact length, or prompts from a file, as token ids.

Prompts are sent as token ids so that every target (our server, vLLM, HF generate) sees exactly the same input
and its length is exact; text would be re-tokenized and could merge or split at the joins.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.errors import UserError


@dataclass(frozen=True)
class Workload:
    """What every target is measured with: the prompts (token ids) and the forced number of output tokens."""

    prompts: list[list[int]]
    output_len: int
    source: str  # "random (seed N)" or the prompts file
    warmup: list[list[int]]  # prompts for the warm-up requests (never the measured ones: no prefix-cache hits)

    @property
    def input_lens(self) -> list[int]:
        return [len(p) for p in self.prompts]

    @property
    def max_total_len(self) -> int:
        """The longest prompt plus the output: what must fit in max_model_len."""
        return max(self.input_lens, default=0) + self.output_len

    def to_dict(self) -> dict[str, Any]:
        lens = self.input_lens
        return {
            "source": self.source,
            "num_prompts": len(self.prompts),
            "input_len_mean": float(np.mean(lens)) if lens else 0.0,
            "input_len_min": min(lens, default=0),
            "input_len_max": max(lens, default=0),
            "output_len": self.output_len,
            "num_warmup": len(self.warmup),
        }


def load_tokenizer(model_path: str | Path) -> Any:
    """The model folder's HF tokenizer, offline."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise UserError(
            f"cannot load a tokenizer from {model_path} ({type(exc).__name__}: {str(exc)[:200]}); "
            "pass --tokenizer with a model folder that has tokenizer files"
        ) from None


def sampleable_ids(tokenizer: Any) -> np.ndarray:
    """Token ids a random prompt may use: the whole vocabulary except special and added tokens."""
    excluded = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
    ids = np.array([i for i in range(len(tokenizer)) if i not in excluded], dtype=np.int64)
    if ids.size == 0:
        raise UserError("the tokenizer has no ordinary tokens to build random prompts from; use --prompts-file")
    return ids


def random_prompts(vocab: np.ndarray, num_prompts: int, input_len: int, seed: int, stream: int = 0) -> list[list[int]]:
    """`num_prompts` prompts of exactly `input_len` ids drawn uniformly from `vocab`; the same for the same seed.

    `stream` selects an independent sequence for the same seed (0: measured prompts, 1: warm-up prompts).
    """
    rng = np.random.default_rng([seed, stream])
    return [[int(t) for t in vocab[rng.integers(0, vocab.size, size=input_len)]] for _ in range(num_prompts)]


def file_prompts(tokenizer: Any, path: Path, num_prompts: int, input_len: int | None) -> list[list[int]]:
    """Prompts read like `dcpctl run --prompts-file` (lines, or JSONL `prompt` / `prompt_token_ids`), tokenized,
    cut to `input_len` tokens if given, and cycled to `num_prompts`."""
    from engine.offline import read_prompts

    prompts = [p if isinstance(p, list) else tokenizer(p).input_ids for p in read_prompts(Path(path))]
    if input_len is not None:
        prompts = [p[:input_len] for p in prompts]
    if any(not p for p in prompts):
        raise UserError(f"prompts file {path} has a prompt that tokenizes to no tokens; remove it")
    return [list(prompts[i % len(prompts)]) for i in range(num_prompts)]


def build_workload(
    tokenizer: Any,
    *,
    num_prompts: int,
    input_len: int | None,
    output_len: int,
    seed: int,
    num_warmup: int,
    prompts_file: Path | None = None,
    default_input_len: int = 512,
) -> Workload:
    """Random prompts (seeded) of `input_len` tokens, or the file's prompts; plus distinct warm-up prompts."""
    if prompts_file is not None:
        prompts = file_prompts(tokenizer, prompts_file, num_prompts, input_len)
        source = str(prompts_file)
        warm_len = max(1, min(len(p) for p in prompts))
    else:
        warm_len = input_len or default_input_len
        prompts = random_prompts(sampleable_ids(tokenizer), num_prompts, warm_len, seed)
        source = f"random (seed {seed})"
    warmup = random_prompts(sampleable_ids(tokenizer), num_warmup, warm_len, seed, stream=1) if num_warmup else []
    return Workload(prompts=prompts, output_len=output_len, source=source, warmup=warmup)

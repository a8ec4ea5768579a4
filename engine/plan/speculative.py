"""The plan's `speculative_config` section (vLLM's `--speculative-config` names): its checks and what it resolves to.

`ngram` (prompt lookup) and `draft_model` (a small checkpoint of the target's tokenizer, run unsharded on rank 0)
run; the other methods of vLLM and SGLang are named in the error so that a config moved from them says what to
change. Defaults follow vLLM: `prompt_lookup_min` and `prompt_lookup_max` default to each other, and to 5 when
neither is set; a `model` without a method means draft_model.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path

from engine.checkpoints.aliases import resolve_model_path
from engine.checkpoints.model_info import read_model_info, weight_elements
from engine.errors import UserError
from engine.plan.resolved import DraftModel, ResolvedPlan, SpeculativeConfig
from engine.plan.schema import SpeculativeSection
from engine.plan.validation import PlanProblems

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 32  # each verified token is a query row of the step; beyond this proposals stop paying
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's, when neither prompt_lookup_min nor prompt_lookup_max is set

# Methods of vLLM and SGLang (lower-cased) that dcpctl does not run, and what each is.
FOREIGN_METHODS = {
    "eagle": "EAGLE draft heads",
    "eagle3": "EAGLE-3 draft heads",
    "medusa": "Medusa heads",
    "mlp_speculator": "MLP speculator heads",
    "mtp": "multi-token-prediction layers",
    "deepseek_mtp": "DeepSeek multi-token-prediction layers",
    "nextn": "SGLang's NEXTN (multi-token-prediction) layers",
    "ernie_mtp": "ERNIE multi-token-prediction layers",
    "qwen3_next_mtp": "Qwen3-Next multi-token-prediction layers",
    "glm4_moe_mtp": "GLM-4 MoE multi-token-prediction layers",
    "longcat_flash_mtp": "LongCat-Flash multi-token-prediction layers",
    "suffix": "suffix-tree decoding",
    "lookahead": "SGLang's lookahead decoding",
    "standalone": "SGLang's standalone draft model",
}
DRAFT_MODEL = "draft_model"
_SUPPORTED = "use method: ngram (prompt lookup) or draft_model (a small model with the target's tokenizer)"
KEY = "speculative_config"
SAME_TOKENIZER = "a draft must share the target's tokenizer (pick a smaller model of the same family)"


def check_speculative(problems: PlanProblems, s: SpeculativeSection, res: ResolvedPlan) -> SpeculativeConfig | None:
    """Every problem of the section (as errors on `problems`); the engine's config when it asks for speculation.

    `res`: the plan resolved so far (the target model and max_model_len, which a draft is checked against)."""
    key = KEY
    method = s.method
    if method is None:
        if s.model is not None:
            method = DRAFT_MODEL  # vLLM infers the method from the model
        elif s.num_speculative_tokens is not None or s.prompt_lookup_min is not None or s.prompt_lookup_max is not None:
            problems.error(f"{key}.method", f"{key} sets fields but no method; add {key}.method: ngram")
            return None
        else:
            return None
    lowered = method.lower()
    if lowered == "ngram" and s.model is not None:
        problems.error(
            f"{key}.model", f"{key}.model is for method draft_model; remove it or set {key}.method: draft_model"
        )
        return None
    if lowered in FOREIGN_METHODS:
        problems.error(
            f"{key}.method",
            f"{key}.method={method!r} ({FOREIGN_METHODS[lowered]}) is not supported; {_SUPPORTED}",
        )
        return None
    if method not in METHODS:
        close = difflib.get_close_matches(lowered, METHODS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        problems.error(f"{key}.method", f"{key}.method={method!r} is not one of {', '.join(METHODS)}{hint}")
        return None
    ok = _check_k(problems, s, method)
    if s.disable_by_batch_size is not None and s.disable_by_batch_size < 1:
        problems.error(
            f"{key}.disable_by_batch_size",
            f"{key}.disable_by_batch_size={s.disable_by_batch_size} must be >= 1 (or unset: speculate at any batch)",
        )
        ok = False
    if method == DRAFT_MODEL:
        draft = _check_draft(problems, s, res)
        if not ok or draft is None:
            return None
        return SpeculativeConfig(s.num_speculative_tokens, 0, 0, s.disable_by_batch_size, draft)
    if s.draft_tensor_parallel_size is not None:
        problems.error(
            f"{key}.draft_tensor_parallel_size",
            f"{key}.draft_tensor_parallel_size is for method draft_model; remove it",
        )
        ok = False
    low, high = s.prompt_lookup_min, s.prompt_lookup_max
    if low is None and high is None:
        low = high = DEFAULT_PROMPT_LOOKUP
    low = high if low is None else low
    high = low if high is None else high
    for name, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
        if value < 1:
            problems.error(f"{key}.{name}", f"{key}.{name}={value} must be >= 1 (the n-gram length to look up)")
            ok = False
    if ok and low > high:
        problems.error(
            f"{key}.prompt_lookup_min",
            f"{key}.prompt_lookup_min={low} is above prompt_lookup_max={high}; set min <= max",
        )
        ok = False
    return SpeculativeConfig(s.num_speculative_tokens, low, high, s.disable_by_batch_size) if ok else None


def _check_k(problems: PlanProblems, s: SpeculativeSection, method: str) -> bool:
    """Whether num_speculative_tokens is set and in range (an error on `problems` if not)."""
    key, k, ok = KEY, s.num_speculative_tokens, True
    if k is None:
        problems.error(
            f"{key}.num_speculative_tokens",
            f"{key}.num_speculative_tokens is required with method {method} (tokens proposed per step, e.g. 4)",
        )
        ok = False
    elif not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        problems.error(
            f"{key}.num_speculative_tokens",
            f"{key}.num_speculative_tokens={k} must be in 1..{MAX_SPECULATIVE_TOKENS} (2 to 8 is typical)",
        )
        ok = False
    return ok


def _check_draft(problems: PlanProblems, s: SpeculativeSection, res: ResolvedPlan) -> DraftModel | None:
    """The draft checkpoint, checked against the target: it loads, runs unsharded, shares the target's tokenizer,
    is not larger and covers max_model_len. None (with the errors) when it cannot serve as the target's draft."""
    key = f"{KEY}.model"
    if s.draft_tensor_parallel_size not in (None, 1):
        problems.error(
            f"{KEY}.draft_tensor_parallel_size",
            f"{KEY}.draft_tensor_parallel_size={s.draft_tensor_parallel_size} is not supported: the draft runs "
            "unsharded on rank 0; set it to 1 or remove it",
        )
        return None
    if s.model is None:
        problems.error(key, f"{key} is required with method draft_model (the draft checkpoint folder or alias)")
        return None
    try:
        path = resolve_model_path(s.model)
        found = (path / "config.json").is_file()
    except (OSError, ValueError) as exc:
        problems.error(key, f"{key}={s.model!r} is not a usable path ({exc}); fix {key}")
        return None
    target_here = res.model_path is not None and (res.model_path / "config.json").is_file()
    if not found and not path.exists() and not target_here:
        # neither checkpoint is here (a plan checked before `dcpctl model pull`): a note, as for the target
        problems.notes.append(f"{key}={s.model}: no draft checkpoint at {path}; draft checks skipped")
        return None
    if not found:
        problems.error(
            key,
            f"{key}={s.model}: no draft checkpoint at {path} (no config.json); point it at an HF checkpoint folder "
            "or run `dcpctl model pull NAME` for an alias",
        )
        return None
    try:
        info = read_model_info(path)
    except UserError as exc:
        problems.error(key, f"{key}: {exc}")
        return None
    draft_params = weight_elements(path)
    target = res.model
    if target is None:  # the target's folder is absent (a note): nothing to compare the draft with
        return DraftModel(path, info, draft_params)
    if info.vocab_size != target.vocab_size:
        problems.error(
            key,
            f"{key}: the draft's vocabulary has {info.vocab_size} tokens, the target's {target.vocab_size}; "
            f"{SAME_TOKENIZER}",
        )
        return None
    if path.resolve() != res.model_path.resolve() and _tokenizer_vocab(path) != _tokenizer_vocab(res.model_path):
        problems.error(key, f"{key}: the draft's tokenizer ({path}) differs from the target's; {SAME_TOKENIZER}")
        return None
    target_params = weight_elements(res.model_path)
    if draft_params > target_params:
        problems.error(
            key,
            f"{key}: the draft has {draft_params:,} parameters, more than the target's {target_params:,}; "
            "a draft must be smaller than the target",
        )
        return None
    if res.max_model_len is not None and info.max_position_embeddings < res.max_model_len:
        problems.error(
            key,
            f"{key}: the draft's max_position_embeddings={info.max_position_embeddings} is below "
            f"model.max_model_len={res.max_model_len}; lower model.max_model_len to "
            f"{info.max_position_embeddings}",
        )
        return None
    return DraftModel(path, info, draft_params)


def _tokenizer_vocab(folder: Path) -> object:
    """What decides token ids in a folder's tokenizer.json (the model's vocabulary and the added tokens); None
    without one (then only the vocabulary sizes are compared)."""
    file = folder / "tokenizer.json"
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    model = data.get("model") or {}
    added = sorted((t.get("id"), t.get("content")) for t in data.get("added_tokens") or [])
    return model.get("vocab"), added

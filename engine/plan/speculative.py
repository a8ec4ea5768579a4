"""The plan's `speculative_config` section (vLLM's `--speculative-config` names): its checks and what it resolves to.

Only `ngram` (prompt lookup) runs; the other methods of vLLM and SGLang are named in the error so that a config
moved from them says what to change. Defaults follow vLLM: `prompt_lookup_min` and `prompt_lookup_max` default to
each other, and to 5 when neither is set.
"""

from __future__ import annotations

import difflib

from engine.plan.resolved import SpeculativeConfig
from engine.plan.schema import SpeculativeSection
from engine.plan.validation import PlanProblems

METHODS = ("ngram",)
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
_SUPPORTED = "use method: ngram (prompt lookup, no second model)"


def check_speculative(problems: PlanProblems, s: SpeculativeSection) -> SpeculativeConfig | None:
    """Every problem of the section (as errors on `problems`); the engine's config when it asks for speculation."""
    key = "speculative_config"
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
    if lowered == DRAFT_MODEL or (lowered == "ngram" and s.model is not None):
        problems.error(
            f"{key}.model" if s.model is not None else f"{key}.method",
            f"{key}: a draft model is not supported yet; {_SUPPORTED}",
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
    ok = True
    k = s.num_speculative_tokens
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
    low, high = s.prompt_lookup_min, s.prompt_lookup_max
    if low is None and high is None:
        low = high = DEFAULT_PROMPT_LOOKUP
    low = high if low is None else low
    high = low if high is None else high
    for name, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
        if value < 1:
            problems.error(f"{key}.{name}", f"{key}.{name}={value} must be >= 1 (the n-gram length to look up)")
            ok = False
    if s.disable_by_batch_size is not None and s.disable_by_batch_size < 1:
        problems.error(
            f"{key}.disable_by_batch_size",
            f"{key}.disable_by_batch_size={s.disable_by_batch_size} must be >= 1 (or unset: speculate at any batch)",
        )
        ok = False
    if ok and low > high:
        problems.error(
            f"{key}.prompt_lookup_min",
            f"{key}.prompt_lookup_min={low} is above prompt_lookup_max={high}; set min <= max",
        )
        ok = False
    return SpeculativeConfig(k, low, high, s.disable_by_batch_size) if ok else None

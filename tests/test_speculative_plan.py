"""The plan's speculative_config section: vLLM's names and defaults, and a one-line error with a fix for bad input."""

import pytest

from engine.plan.checks import validate_plan_file
from engine.plan.resolved import SpeculativeConfig


def check(make_plan, folder, spec: str):
    return validate_plan_file(make_plan(f"model: {{path: {folder}}}\nlaunch: {{device: cpu}}\n{spec}"))


def messages(report):
    return [e.message for e in report.problems.errors]


def test_no_section_means_no_speculation(make_plan, llama_folder):
    report = check(make_plan, llama_folder, "")
    assert report.valid and report.resolved.speculative is None


@pytest.mark.parametrize(
    ("fields", "resolved"),
    [
        ("num_speculative_tokens: 4", SpeculativeConfig(4, 5, 5)),  # vLLM: neither set -> 5, 5
        ("num_speculative_tokens: 2, prompt_lookup_max: 3", SpeculativeConfig(2, 3, 3)),  # min defaults to max
        ("num_speculative_tokens: 2, prompt_lookup_min: 2", SpeculativeConfig(2, 2, 2)),  # max defaults to min
        ("num_speculative_tokens: 8, prompt_lookup_min: 1, prompt_lookup_max: 4", SpeculativeConfig(8, 1, 4)),
        ("num_speculative_tokens: 4, disable_by_batch_size: 4", SpeculativeConfig(4, 5, 5, 4)),
    ],
)
def test_ngram_resolves_like_vllm(make_plan, llama_folder, fields, resolved):
    report = check(make_plan, llama_folder, f"speculative_config: {{method: ngram, {fields}}}\n")
    assert report.valid, messages(report)
    assert report.resolved.speculative == resolved


@pytest.mark.parametrize(
    ("spec", "field", "message"),
    [
        (
            "{method: ngram}",
            "speculative_config.num_speculative_tokens",
            "speculative_config.num_speculative_tokens is required with method ngram "
            "(tokens proposed per step, e.g. 4)",
        ),
        (
            "{method: ngram, num_speculative_tokens: 0}",
            "speculative_config.num_speculative_tokens",
            "speculative_config.num_speculative_tokens=0 must be in 1..32 (2 to 8 is typical)",
        ),
        (
            "{method: ngram, num_speculative_tokens: 1000}",
            "speculative_config.num_speculative_tokens",
            "speculative_config.num_speculative_tokens=1000 must be in 1..32 (2 to 8 is typical)",
        ),
        (
            "{method: ngram, num_speculative_tokens: 2, prompt_lookup_min: 4, prompt_lookup_max: 2}",
            "speculative_config.prompt_lookup_min",
            "speculative_config.prompt_lookup_min=4 is above prompt_lookup_max=2; set min <= max",
        ),
        (
            "{method: ngram, num_speculative_tokens: 2, prompt_lookup_min: 0, prompt_lookup_max: 2}",
            "speculative_config.prompt_lookup_min",
            "speculative_config.prompt_lookup_min=0 must be >= 1 (the n-gram length to look up)",
        ),
        (
            "{method: eagle3, num_speculative_tokens: 2}",
            "speculative_config.method",
            "speculative_config.method='eagle3' (EAGLE-3 draft heads) is not supported; "
            "use method: ngram (prompt lookup, no second model)",
        ),
        (
            "{method: NEXTN, num_speculative_tokens: 2}",
            "speculative_config.method",
            "speculative_config.method='NEXTN' (SGLang's NEXTN (multi-token-prediction) layers) is not supported; "
            "use method: ngram (prompt lookup, no second model)",
        ),
        (
            "{method: ngarm, num_speculative_tokens: 2}",
            "speculative_config.method",
            "speculative_config.method='ngarm' is not one of ngram (did you mean 'ngram'?)",
        ),
        (
            "{method: draft_model, model: tiny-draft, num_speculative_tokens: 2}",
            "speculative_config.model",
            "speculative_config: a draft model is not supported yet; "
            "use method: ngram (prompt lookup, no second model)",
        ),
        (
            "{model: tiny-draft, num_speculative_tokens: 2}",
            "speculative_config.model",
            "speculative_config: a draft model is not supported yet; "
            "use method: ngram (prompt lookup, no second model)",
        ),
        (
            "{method: ngram, num_speculative_tokens: 2, disable_by_batch_size: 0}",
            "speculative_config.disable_by_batch_size",
            "speculative_config.disable_by_batch_size=0 must be >= 1 (or unset: speculate at any batch)",
        ),
        (
            "{num_speculative_tokens: 2}",
            "speculative_config.method",
            "speculative_config sets fields but no method; add speculative_config.method: ngram",
        ),
    ],
)
def test_bad_section_is_one_error_with_a_fix(make_plan, llama_folder, spec, field, message):
    report = check(make_plan, llama_folder, f"speculative_config: {spec}\n")
    assert [(e.field, e.message) for e in report.problems.errors] == [(field, message)]
    set_in_file = field.rsplit(".", 1)[1] + ":" in spec
    assert report.problems.errors[0].line == (3 if set_in_file else None)  # where the field is set


def test_override_on_the_command_line(make_plan, llama_folder):
    plan = make_plan(f"model: {{path: {llama_folder}}}\nlaunch: {{device: cpu}}\n")
    overrides = ["speculative_config.method=ngram", "speculative_config.num_speculative_tokens=3"]
    report = validate_plan_file(plan, overrides)
    assert report.valid, messages(report)
    assert report.resolved.speculative == SpeculativeConfig(3, 5, 5)


def test_unknown_field_gets_a_suggestion(make_plan, llama_folder):
    report = check(make_plan, llama_folder, "speculative_config: {method: ngram, num_speculative_token: 2}\n")
    assert "num_speculative_tokens" in messages(report)[0]

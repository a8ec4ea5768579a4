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
            "use method: ngram (prompt lookup) or draft_model (a small model with the target's tokenizer)",
        ),
        (
            "{method: NEXTN, num_speculative_tokens: 2}",
            "speculative_config.method",
            "speculative_config.method='NEXTN' (SGLang's NEXTN (multi-token-prediction) layers) is not supported; "
            "use method: ngram (prompt lookup) or draft_model (a small model with the target's tokenizer)",
        ),
        (
            "{method: ngarm, num_speculative_tokens: 2}",
            "speculative_config.method",
            "speculative_config.method='ngarm' is not one of ngram, draft_model (did you mean 'ngram'?)",
        ),
        (
            "{method: ngram, model: tiny-draft, num_speculative_tokens: 2}",
            "speculative_config.model",
            "speculative_config.model is for method draft_model; remove it or set speculative_config.method: "
            "draft_model",
        ),
        (
            "{method: draft_model, num_speculative_tokens: 2}",
            "speculative_config.model",
            "speculative_config.model is required with method draft_model (the draft checkpoint folder or alias)",
        ),
        (
            "{model: /no/such/draft, num_speculative_tokens: 2}",
            "speculative_config.model",
            "speculative_config.model=/no/such/draft: no draft checkpoint at /no/such/draft (no config.json); point "
            "it at an HF checkpoint folder or run `dcpctl model pull NAME` for an alias",
        ),
        (
            "{method: ngram, num_speculative_tokens: 2, draft_tensor_parallel_size: 1}",
            "speculative_config.draft_tensor_parallel_size",
            "speculative_config.draft_tensor_parallel_size is for method draft_model; remove it",
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
    assert "\n" not in message
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


# ---- draft_model: the draft checked against the target ----


def draft_check(make_plan, target, draft, fields="num_speculative_tokens: 3", extra=""):
    text = f"speculative_config: {{method: draft_model, model: {draft}, {fields}}}\n{extra}"
    return check(make_plan, target, text)


def test_draft_model_resolves_and_takes_its_kv_from_the_budget(make_plan, tiny_models):
    """A smaller draft of the same tokenizer: resolved, and rank 0's budget pays for its KV (one virtual block of
    the draft's per target block), so the target gets fewer blocks than without it."""
    target, draft = tiny_models("llama"), tiny_models("llama", seed=1, num_layers=1)
    memory = "cache: {block_size: 16, memory: 1MiB}\nparallel: {dcp: 2}\n"
    report = draft_check(make_plan, target, draft, extra=memory)
    assert report.valid, messages(report)
    spec = report.resolved.speculative
    assert (spec.num_speculative_tokens, spec.draft.path, spec.draft.info.num_layers) == (3, draft, 1)
    kv = report.resolved.kv
    # target per rank (dcp 2 replica: 2 KV heads x 16 x 2 layers x 2 x 4 B = 512 B/token) x 16 tokens per block;
    # draft: 1 layer x 2 x 2 x 16 x 4 B = 256 B/token x 32 tokens (the virtual block)
    assert (kv.bytes_per_token, kv.draft_bytes_per_block) == (512, 256 * 32)
    assert kv.num_blocks == 2**20 // (512 * 16 + 256 * 32)
    assert kv.bytes_on_rank0 <= 2**20
    plain = check(make_plan, target, memory)
    assert plain.resolved.kv.num_blocks == 2**20 // (512 * 16)


def test_the_target_itself_is_a_legal_draft(make_plan, tiny_models):
    target = tiny_models("llama")
    report = draft_check(make_plan, target, target, "num_speculative_tokens: 3, draft_tensor_parallel_size: 1")
    assert report.valid, messages(report)
    assert report.resolved.speculative.draft.path == target


def _retokenized(src, dst):
    """A copy of a checkpoint whose tokenizer gives two tokens each other's ids (same vocabulary size)."""
    import json
    import shutil

    shutil.copytree(src, dst)
    data = json.loads((dst / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = "a", "b"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (dst / "tokenizer.json").write_text(json.dumps(data))
    return dst


@pytest.mark.parametrize(
    ("draft", "fields", "field", "message"),
    [
        (
            {"vocab_size": 640},
            "num_speculative_tokens: 3",
            "speculative_config.model",
            "speculative_config.model: the draft's vocabulary has 640 tokens, the target's 512; a draft must share "
            "the target's tokenizer (pick a smaller model of the same family)",
        ),
        (
            "retokenized",
            "num_speculative_tokens: 3",
            "speculative_config.model",
            "speculative_config.model: the draft's tokenizer (DRAFT) differs from the target's; a draft must share "
            "the target's tokenizer (pick a smaller model of the same family)",
        ),
        (
            {"hidden_size": 128},
            "num_speculative_tokens: 3",
            "speculative_config.model",
            "speculative_config.model: the draft has 279,168 parameters, more than the target's 139,584; a draft "
            "must be smaller than the target",
        ),
        (
            {"max_position_embeddings": 256},
            "num_speculative_tokens: 3",
            "speculative_config.model",
            "speculative_config.model: the draft's max_position_embeddings=256 is below model.max_model_len=2048; "
            "lower model.max_model_len to 256",
        ),
        (
            {"num_layers": 1},
            "num_speculative_tokens: 0",
            "speculative_config.num_speculative_tokens",
            "speculative_config.num_speculative_tokens=0 must be in 1..32 (2 to 8 is typical)",
        ),
        (
            {"num_layers": 1},
            "num_speculative_tokens: 64",
            "speculative_config.num_speculative_tokens",
            "speculative_config.num_speculative_tokens=64 must be in 1..32 (2 to 8 is typical)",
        ),
        (
            {"num_layers": 1},
            "num_speculative_tokens: 3, draft_tensor_parallel_size: 2",
            "speculative_config.draft_tensor_parallel_size",
            "speculative_config.draft_tensor_parallel_size=2 is not supported: the draft runs unsharded on rank 0; "
            "set it to 1 or remove it",
        ),
    ],
)
def test_bad_draft_is_one_error_with_a_fix(make_plan, tiny_models, tmp_path, draft, fields, field, message):
    target = tiny_models("llama")
    if draft == "retokenized":
        folder = _retokenized(tiny_models("llama", seed=1, num_layers=1), tmp_path / "retokenized")
    else:
        folder = tiny_models("llama", seed=1, **draft)
    report = draft_check(make_plan, target, folder, fields)
    assert [(e.field, e.message) for e in report.problems.errors] == [(field, message.replace("DRAFT", str(folder)))]


def test_plan_show_and_json_account_for_the_draft(make_plan, tiny_models):
    """`plan show` says where the draft runs and what its weights and KV cost rank 0, `plan validate`'s table adds
    them to rank 0's cells, and `--json` carries the bytes."""
    import json

    from typer.testing import CliRunner

    from dcpctl.cli import app

    target, draft = tiny_models("llama"), tiny_models("llama", seed=1, num_layers=1)
    plan = make_plan(
        f"model: {{path: {target}}}\nlaunch: {{device: cpu}}\ncache: {{block_size: 16, memory: 2MiB}}\n"
        f"speculative_config: {{model: {draft}, num_speculative_tokens: 2}}\n"
    )
    shown = CliRunner().invoke(app, ["plan", "show", str(plan)], env={"COLUMNS": "400"})
    assert shown.exit_code == 0, shown.output
    # draft: 102,592 parameters x 4 B; KV 256 B/token x 16 tokens per block x 170 blocks (2 MiB / (8 KiB + 4 KiB))
    blocks = 2**21 // (512 * 16 + 256 * 16)
    assert (
        f"draft model {draft} (1 layers): unsharded on rank 0, weights 400.8 KiB + KV 680.0 KiB = {blocks} blocks x "
        "16 tokens x 256 B/token (rank 0's KV budget holds both caches)"
    ) in " ".join(shown.output.split())
    table = CliRunner().invoke(app, ["plan", "validate", str(plan)], env={"COLUMNS": "400"}).output
    assert "+ draft 400.8 KiB on rank 0" in table and f"{blocks * 16} tok + draft 680.0 KiB on rank 0" in table
    listed = CliRunner().invoke(app, ["plan", "validate", "--json", str(plan)])
    data = json.loads(listed.output)[0]
    assert data["kv_cache"]["draft_bytes_rank0"] == blocks * 256 * 16
    assert data["speculative"] == {"num_speculative_tokens": 2, "draft_model": str(draft), "draft_params": 102592}

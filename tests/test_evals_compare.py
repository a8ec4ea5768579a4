"""evals.compare on constructed runs: deltas, agreement counts, failed plans, mismatched sample sets."""

from __future__ import annotations

import pytest

from evals.compare import compare_runs
from evals.results import EvalRun, Metric, SampleResult

FILTERS = ("strict-match", "flexible-extract")


def sample(doc_id: int, text: str, gold: str = "5") -> SampleResult:
    """A sample whose extracted answers mimic gsm8k's two filters on `text`."""
    strict = text.split("#### ")[1].strip() if "#### " in text else "[invalid]"
    nums = [w.strip(".") for w in text.replace("\n", " ").split() if w.strip(".").lstrip("-").isdigit()]
    flexible = nums[-1] if nums else "[invalid]"
    return SampleResult(
        doc_id=doc_id,
        question=f"question {doc_id}?",
        target=f"work\n#### {gold}",
        generated=text,
        extracted={"strict-match": strict, "flexible-extract": flexible},
        correct={"strict-match": strict == gold, "flexible-extract": flexible == gold},
    )


def run(label: str, samples: list[SampleResult], **kw) -> EvalRun:
    n = len(samples)
    metrics = {}
    for f in FILTERS:
        acc = sum(s.correct[f] for s in samples) / n
        metrics[f] = Metric("exact_match", acc, (acc * (1 - acc) / max(n - 1, 1)) ** 0.5)
    defaults = dict(task="gsm8k_local", dataset="gsm8k", version="3.0", n_shot=5, wall_s=10.0, dtype="float32")
    return EvalRun(label=label, metrics=metrics, samples=samples, **(defaults | kw))


def base_samples() -> list[SampleResult]:
    return [sample(i, f"so {t}\n#### {t}") for i, t in enumerate(["5", "5", "5", "7"])]


def test_identical_runs_agree_fully() -> None:
    cmp = compare_runs([run("tp1", base_samples()), run("tp2_dcp2", base_samples())])
    other = cmp.columns[1]
    assert cmp.common_doc_ids == [0, 1, 2, 3] and cmp.notes == []
    assert other.delta == {"strict-match": 0.0, "flexible-extract": 0.0}
    assert other.text_agreement.same == other.text_agreement.total == 4
    assert all(a.same == 4 for a in other.answer_agreement.values())
    assert other.disagreements == []
    assert cmp.baseline.common_accuracy["strict-match"] == pytest.approx(0.75)


def test_tie_flip_and_text_only_change() -> None:
    plan = base_samples()
    plan[1] = sample(1, "so 6\n#### 6")  # answer flips: correct -> wrong
    plan[3] = sample(3, "thus 7\n#### 7")  # text differs, same (wrong) answer
    plan[2] = sample(2, "The answer is 5.")  # strict-match loses it, flexible-extract keeps 5
    cmp = compare_runs([run("base", base_samples()), run("dcp", plan, generated_tokens=400, generate_s=8.0)])
    col = cmp.columns[1]
    assert col.common_accuracy == {"strict-match": 0.25, "flexible-extract": 0.5}
    assert col.delta["strict-match"] == pytest.approx(0.25 - 0.75)
    assert col.delta["flexible-extract"] == pytest.approx(0.5 - 0.75)
    assert col.text_agreement.same == 1 and col.text_agreement.total == 4
    assert col.answer_agreement["strict-match"].same == 2  # docs 1 and 2 differ
    assert col.answer_agreement["flexible-extract"].same == 3  # only doc 1 differs
    by_doc = {d.doc_id: d for d in col.disagreements}
    assert sorted(by_doc) == [1, 2, 3]
    assert by_doc[1].answers_differ == ["strict-match", "flexible-extract"]
    assert by_doc[1].baseline_text == "so 5\n#### 5" and by_doc[1].plan_text == "so 6\n#### 6"
    assert by_doc[2].answers_differ == ["strict-match"]
    assert by_doc[3].answers_differ == []  # a text-only change
    assert by_doc[1].gold == "5"
    assert col.tokens_per_s == pytest.approx(50.0)
    assert cmp.columns[0].delta == {"strict-match": 0.0, "flexible-extract": 0.0}


def test_failed_plan_is_a_column_without_numbers() -> None:
    runs = [
        run("base", base_samples()),
        EvalRun.failure("tp4", "server exited with code 1"),
        run("b2", base_samples()),
    ]
    cmp = compare_runs(runs)
    assert [c.label for c in cmp.columns] == ["base", "tp4", "b2"]
    failed = cmp.columns[1]
    assert failed.failed and failed.error == "server exited with code 1"
    assert failed.delta == {"strict-match": None, "flexible-extract": None}
    assert failed.text_agreement is None and failed.answer_agreement == {}
    assert cmp.common_doc_ids == [0, 1, 2, 3]  # a failed run does not shrink the common set
    assert cmp.columns[2].text_agreement.same == 4


def test_failed_baseline_gives_no_deltas() -> None:
    cmp = compare_runs([EvalRun.failure("base", "boom"), run("b", base_samples())])
    assert cmp.columns[1].delta == {"strict-match": None, "flexible-extract": None}
    assert any("baseline base failed" in n for n in cmp.notes)
    assert cmp.filters == list(FILTERS) and cmp.task == "gsm8k_local"


def test_mismatched_sample_sets_use_the_intersection() -> None:
    full = base_samples()
    shifted = [*base_samples()[1:], sample(9, "so 5\n#### 5")]  # docs 1, 2, 3, 9
    cmp = compare_runs([run("base", full), run("other", shifted), run("short", base_samples()[:3])])
    assert cmp.common_doc_ids == [1, 2]
    assert any("use the 2 doc ids they share" in n for n in cmp.notes)
    col = cmp.columns[1]
    assert col.n_samples == 4 and col.text_agreement.total == 2
    assert col.delta["strict-match"] == 0.0  # both right on docs 1 and 2
    assert cmp.columns[0].common_accuracy["strict-match"] == 1.0


def test_differing_setups_are_noted() -> None:
    cmp = compare_runs([run("a", base_samples()), run("b", base_samples(), n_shot=0, mode="chat")])
    assert any("n-shot" in n for n in cmp.notes) and any("mode" in n for n in cmp.notes)


def test_roundtrip_of_eval_run() -> None:
    r = run("a", base_samples(), generated_tokens=12, generate_s=3.0)
    again = EvalRun.from_dict(r.to_dict())
    assert again == r and again.tokens_per_s == pytest.approx(4.0)


def test_differing_prompts_are_noted() -> None:
    other = base_samples()
    other[0].prompt_hash, other[1].prompt_hash = "x", "y"
    same = base_samples()
    same[0].prompt_hash, same[1].prompt_hash = "x", "z"
    cmp = compare_runs([run("a", same), run("b", other)])
    assert cmp.notes == ["b: 1 of 4 prompts differ from the baseline's"]

"""evals.synthetic: deterministic, GSM8K-format, and labelled as NOT GSM8K."""

from __future__ import annotations

import json
import re
from pathlib import Path

from evals.synthetic import SOURCE_LABEL, generate_problems, write_synthetic_gsm8k
from evals.tasks import is_synthetic, validate_data_dir

STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")  # lm-eval gsm8k.yaml strict-match
CALC = re.compile(r"<<([0-9+\-*/ ]+)=(-?\d+)>>")


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_same_seed_same_bytes_other_seed_differs(tmp_path: Path) -> None:
    a = _files(write_synthetic_gsm8k(tmp_path / "a", n_test=30, n_train=10, seed=3))
    b = _files(write_synthetic_gsm8k(tmp_path / "b", n_test=30, n_train=10, seed=3))
    c = _files(write_synthetic_gsm8k(tmp_path / "c", n_test=30, n_train=10, seed=4))
    assert a == b
    assert a["test.jsonl"] != c["test.jsonl"]
    assert generate_problems(5, seed=1) == generate_problems(5, seed=1)


def test_format_answers_and_no_overlap(tmp_path: Path) -> None:
    d = write_synthetic_gsm8k(tmp_path / "s", n_test=60, n_train=15, seed=0)
    validate_data_dir(d)
    test = [json.loads(line) for line in (d / "test.jsonl").read_text().splitlines()]
    train = [json.loads(line) for line in (d / "train.jsonl").read_text().splitlines()]
    assert (len(test), len(train)) == (60, 15)
    assert not {r["question"] for r in test} & {r["question"] for r in train}
    assert len({r["question"] for r in test}) == 60
    for row in test + train:
        assert row["source"] == SOURCE_LABEL and "NOT GSM8K" in row["source"]
        final = STRICT.search(row["answer"])
        assert final is not None and row["answer"].endswith(f"#### {final.group(1)}")
        steps = CALC.findall(row["answer"])
        assert steps, row["answer"]
        for expr, value in steps:
            assert eval(expr) == int(value), row["answer"]  # the worked steps are right
        assert int(steps[-1][1]) == int(final.group(1))  # the final answer is the last step's result


def test_labelled_not_gsm8k(tmp_path: Path) -> None:
    d = write_synthetic_gsm8k(tmp_path / "s", n_test=2, n_train=1)
    assert "NOT GSM8K" in (d / "README.md").read_text()
    info = json.loads((d / "dataset_info.json").read_text())
    assert info["synthetic"] is True and info["not_gsm8k"] is True
    assert is_synthetic(d)
    (d / "dataset_info.json").unlink()
    assert not is_synthetic(d)

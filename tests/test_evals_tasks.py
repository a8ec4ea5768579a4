"""evals.tasks: local gsm8k task YAMLs that lm-eval really loads, and clear errors for bad data dirs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from engine.errors import UserError
from evals.synthetic import write_synthetic_gsm8k
from evals.tasks import SUPPORTED_TASKS, gsm8k_task, lm_eval_tasks_dir, validate_data_dir


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _rows(n: int, offset: int = 0) -> list[dict]:
    return [
        {
            "question": f"Tom has {i} pens and buys 2 more. How many pens?",
            "answer": f"{i}+2={i + 2}\n#### {i + 2}",
        }
        for i in range(offset, offset + n)
    ]


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    d = tmp_path / "gsm8k"
    _write_jsonl(d / "test.jsonl", _rows(4))
    _write_jsonl(d / "train.jsonl", _rows(3, offset=100))
    return d


def test_local_yaml_loads_in_lm_eval_with_the_right_docs(data_dir: Path, tmp_path: Path) -> None:
    spec = gsm8k_task(data_dir, tmp_path / "work")
    assert spec.name == "gsm8k_local" and spec.data_dir == data_dir.resolve() and not spec.synthetic
    cfg = yaml.safe_load(spec.yaml_path.read_text())
    assert cfg["include"] == str(lm_eval_tasks_dir() / "gsm8k.yaml")
    assert cfg["dataset_path"] == "json" and cfg["dataset_name"] is None

    task = spec.task_manager().load([spec.name])["tasks"][spec.name]
    docs = list(task.test_docs())
    assert len(docs) == 4
    assert docs[2]["question"].startswith("Tom has 2 pens")
    assert len(list(task.fewshot_docs())) == 3  # few-shot examples come from our train.jsonl
    # Everything else is inherited from lm-eval's gsm8k.yaml.
    assert task.config.num_fewshot == 5
    assert "Question:" in task.config.generation_kwargs["until"]
    assert [f["name"] for f in task.config.filter_list] == ["strict-match", "flexible-extract"]
    assert task.doc_to_text(docs[0]) == f"Question: {docs[0]['question']}\nAnswer:"


def test_gsm8k_cot_local_loads(data_dir: Path, tmp_path: Path) -> None:
    spec = gsm8k_task(data_dir, tmp_path / "work", name="gsm8k_cot")
    assert spec.name == "gsm8k_cot_local"
    task = spec.task_manager().load([spec.name])["tasks"][spec.name]
    assert len(list(task.test_docs())) == 4
    assert task.doc_to_target(next(iter(task.test_docs()))) == "2"


def test_no_data_dir_uses_lm_eval_own_task(tmp_path: Path) -> None:
    spec = gsm8k_task(None, tmp_path)
    assert spec.name == "gsm8k" and spec.data_dir is None and spec.yaml_path is None
    assert spec.display_name == "gsm8k"
    assert "gsm8k" in spec.task_manager().all_tasks
    assert not list(tmp_path.iterdir())  # nothing written


def test_synthetic_dir_is_labelled(tmp_path: Path) -> None:
    d = write_synthetic_gsm8k(tmp_path / "syn", n_test=3, n_train=2)
    spec = gsm8k_task(d, tmp_path / "work")
    assert spec.synthetic and spec.name == "gsm8k_synthetic"
    assert "SYNTHETIC" in spec.display_name and "not GSM8K" in spec.display_name


def test_unknown_task_lists_supported(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="supported tasks: gsm8k, gsm8k_cot"):
        gsm8k_task(None, tmp_path, name="mmlu")
    assert SUPPORTED_TASKS == ("gsm8k", "gsm8k_cot")


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("nodir", "does not exist"),
        ("no_train", r"train\.jsonl is missing"),
        ("empty", "is empty"),
        ("not_json", "is not JSON"),
        ("no_fields", "lacks string fields 'question' and 'answer'"),
        ("no_hashes", "no final '#### N'"),
    ],
)
def test_bad_data_dir_errors(data_dir: Path, tmp_path: Path, setup: str, message: str) -> None:
    target = data_dir
    if setup == "nodir":
        target = tmp_path / "missing"
    elif setup == "no_train":
        (data_dir / "train.jsonl").unlink()
    elif setup == "empty":
        (data_dir / "test.jsonl").write_text("\n")
    elif setup == "not_json":
        (data_dir / "test.jsonl").write_text("question,answer\n")
    elif setup == "no_fields":
        (data_dir / "test.jsonl").write_text(json.dumps({"q": "x", "a": "y"}) + "\n")
    elif setup == "no_hashes":
        (data_dir / "train.jsonl").write_text(json.dumps({"question": "x", "answer": "42"}) + "\n")
    with pytest.raises(UserError, match=message):
        validate_data_dir(target)
    with pytest.raises(UserError, match=message):
        gsm8k_task(target, tmp_path / "work")
    assert not (tmp_path / "work").exists()  # no YAML written for a bad dir


def test_real_gsm8k_layout_validates() -> None:
    real = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"  # ../shared next to the repo
    if not real.is_dir():
        pytest.skip("shared GSM8K data not present")
    validate_data_dir(real)

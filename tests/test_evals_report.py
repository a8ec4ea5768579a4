"""evals.report: the rich table and the report files."""

from __future__ import annotations

import json
import re
from pathlib import Path

from rich.console import Console

from evals.compare import compare_runs
from evals.report import render_table, write_report
from evals.results import EvalRun, Metric, SampleResult
from evals.targets import plan_dir_names


def _run(label: str, texts: list[str], **kw) -> EvalRun:
    samples = [
        SampleResult(
            doc_id=i,
            question=f"q{i}?",
            target="w\n#### 5",
            generated=t,
            extracted={"strict-match": t[-1], "flexible-extract": t[-1]},
            correct={"strict-match": t.endswith("5"), "flexible-extract": t.endswith("5")},
        )
        for i, t in enumerate(texts)
    ]
    acc = sum(s.correct["strict-match"] for s in samples) / len(samples)
    metrics = {f: Metric("exact_match", acc, 0.1) for f in ("strict-match", "flexible-extract")}
    return EvalRun(
        label=label,
        task="gsm8k_local",
        dataset="gsm8k (local)",
        version="3.0",
        n_shot=5,
        metrics=metrics,
        samples=samples,
        wall_s=12.5,
        generate_s=10.0,
        generated_tokens=250,
        **kw,
    )


def _comparison():
    return compare_runs(
        [
            _run("plans/tp1.yaml", ["#### 5", "#### 5", "#### 4"]),
            _run("plans/tp2_dcp2.yaml", ["#### 5", "#### 3", "#### 4"]),
            EvalRun.failure("plans/tp4.yaml", "server did not start: port in use"),
        ]
    )


def test_table_has_lm_eval_columns_and_one_per_plan() -> None:
    cmp = _comparison()
    table = render_table(cmp)
    headers = [c.header for c in table.columns]
    assert headers[:5] == ["Dataset", "Version", "Filter", "n-shot", "Metric"]
    assert headers[5:] == ["plans/tp1.yaml", "plans/tp2_dcp2.yaml", "plans/tp4.yaml"]
    console = Console(record=True, width=250)
    console.print(table)
    text = console.export_text()
    assert "0.6667 ± 0.1000" in text and "0.3333 ± 0.1000" in text
    assert "-0.3333" in text and "baseline" in text
    assert "2/3 (66.7%)" in text  # text agreement of tp2_dcp2
    assert "FAILED" in text and "port in use" in text
    assert "25.0" in text  # tokens/s


def test_write_report_files(tmp_path: Path) -> None:
    cmp = _comparison()
    paths = write_report(cmp, tmp_path / "out")
    out = tmp_path / "out"
    data = json.loads((out / "comparison.json").read_text())
    assert [c["label"] for c in data["columns"]] == [
        "plans/tp1.yaml",
        "plans/tp2_dcp2.yaml",
        "plans/tp4.yaml",
    ]
    assert data["columns"][2]["failed"] is True and data["n_common"] == 3
    assert data["columns"][1]["text_agreement"] == {"same": 2, "total": 3, "fraction": 2 / 3}
    assert data["columns"][1]["disagreements"][0]["doc_id"] == 1

    png = (out / "accuracy.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 1000

    md = (out / "comparison.md").read_text()
    lines = md.splitlines()
    first = lines.index(next(line for line in lines if line.startswith("|")))
    table_lines = lines[first : lines.index("", first)]  # the comparison grid (disagreement tables follow)
    header_cells = [c.strip() for c in table_lines[0].strip("|").split("|")]
    assert header_cells == [
        "Dataset",
        "Version",
        "Filter",
        "n-shot",
        "Metric",
        *[c.label for c in cmp.columns],
    ]
    cells = [re.split(r"(?<!\\)\|", line)[1:-1] for line in table_lines]  # unescaped pipes
    assert all(len(row) == len(header_cells) for row in cells)
    assert len(table_lines) == 2 + 2 + 2 + 2 + 6  # header, rule, acc x2, delta x2, agreement x2, 6 more
    assert "## Failed plans" in md and "doc 1" in md

    samples = (out / "plans_tp2_dcp2.yaml" / "samples.jsonl").read_text().splitlines()
    assert [json.loads(s)["generated"] for s in samples] == ["#### 5", "#### 3", "#### 4"]
    assert json.loads((out / "plans_tp1.yaml" / "run.json").read_text())["label"] == "plans/tp1.yaml"
    assert (out / "plans_tp4.yaml" / "samples.jsonl").read_text() == ""
    assert set(paths) >= {"json", "md", "png"}
    assert not list(out.rglob("*.tmp"))


def test_plan_dir_names_are_safe_and_unique() -> None:
    assert plan_dir_names(["plans/a.yaml", "plans a.yaml", "../x", ""]) == [
        "plans_a.yaml",
        "plans_a.yaml_2",
        "x",
        "plan",
    ]


def test_every_target_failed_draws_without_a_matplotlib_warning() -> None:
    import warnings

    from evals.report import accuracy_png

    cmp = compare_runs([EvalRun.failure("plans/tp1.yaml", "the server refused the prompts")])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert accuracy_png(cmp)[:4] == b"\x89PNG"


def test_speculating_targets_show_their_acceptance_in_the_table_and_files(tmp_path: Path) -> None:
    """A target that speculated gets "proposals accepted" and "tokens per verification" in the table, the markdown,
    comparison.json and its run files (its saved run keeps the counters); a target that did not gets "—", and with
    no speculating target the rows are left out."""
    from engine.core.speculative import SpecCounters

    counters = SpecCounters(proposed=40, accepted=30, verifications=20)
    spec = _run("ngram4.yaml", ["#### 5", "#### 5", "#### 4"], speculation=counters)
    cmp = compare_runs([_run("plain.yaml", ["#### 5", "#### 5", "#### 4"]), spec])
    console = Console(record=True, width=250)
    console.print(render_table(cmp))
    lines = console.export_text().splitlines()
    rate = next(line for line in lines if "speculation: proposals accepted" in line)
    length = next(line for line in lines if "speculation: tokens per verification" in line)
    assert [c.strip() for c in rate.split("│")[-3:-1]] == ["—", "75%"]
    assert [c.strip() for c in length.split("│")[-3:-1]] == ["—", "2.50"]

    out = tmp_path / "out"
    write_report(cmp, out)
    data = json.loads((out / "comparison.json").read_text())
    assert data["columns"][0]["speculation"] is None
    assert data["columns"][1]["speculation"] == counters.as_dict()
    assert json.loads((out / "ngram4.yaml" / "run.json").read_text())["speculation"]["acceptance_rate"] == 0.75
    md = (out / "comparison.md").read_text()
    assert "| speculation: proposals accepted | — | 75% |" in md
    assert "| speculation: tokens per verification | — | 2.50 |" in md
    assert EvalRun.from_dict(spec.to_dict()) == spec

    plain = compare_runs([_run("a.yaml", ["#### 5"]), _run("b.yaml", ["#### 5"])])
    console = Console(record=True, width=250)
    console.print(render_table(plain))
    assert "speculation" not in console.export_text()

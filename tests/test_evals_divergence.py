"""Token traces from server responses, and the tie-flip / unexplained classification of disagreements, with how
the comparison and its reports carry them."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from rich.console import Console

from evals.compare import compare_runs
from evals.divergence import TIE_FLIP, TIE_MARGINS, UNEXPLAINED, explain, first_difference, measure_noise, tie_margin
from evals.report import comparison_markdown, render_table, write_report
from evals.results import EvalRun, Metric, SampleResult
from evals.traces import KEEP_WINDOW, TOP_LOGPROBS, TokenTrace, trace_from_chat, trace_from_completion


def tid(i: int) -> str:
    return f"token_id:{i}"


def trace(ids: list[int], rivals: list[list[tuple[int, float]]] | None = None, lps: list[float] | None = None):
    """A trace whose chosen tokens have logprob -0.1 (or `lps`) and the given rivals, bound 5 nats down."""
    lps = lps or [-0.1] * len(ids)
    rivals = rivals or [[] for _ in ids]
    return TokenTrace(
        ids=ids,
        pieces=[f"<{i}>" for i in ids],
        logprobs=lps,
        rivals=rivals,
        bounds=[lp - KEEP_WINDOW for lp in lps],
    )


# --- traces from responses ------------------------------------------------------------------------------------


def test_completion_trace_keeps_close_rivals_and_bounds_the_rest() -> None:
    top = {tid(7): -0.69, tid(8): -0.70, tid(9): -7.0}
    top |= {tid(100 + k): -8.0 - k for k in range(TOP_LOGPROBS - 3)}  # the server's top N
    choice = {
        "text": " 5 apples",
        "logprobs": {
            "tokens": [tid(7), tid(42)],
            "token_logprobs": [-0.69, -0.01],
            "top_logprobs": [top, {tid(42): -0.01, tid(43): -4.9}],
            "text_offset": [0, 2],
        },
    }
    t = trace_from_completion(choice)
    assert t is not None and t.ids == [7, 42] and t.pieces == [" 5", " apples"]
    assert t.rivals[0] == [(8, -0.70)]  # 9 is more than KEEP_WINDOW below the best
    assert t.bounds[0] == pytest.approx(-0.69 - KEEP_WINDOW)
    assert t.logprob(0, 8) == (-0.70, True) and t.logprob(0, 7) == (-0.69, True)
    assert t.logprob(0, 9) == (pytest.approx(-5.69), False)  # dropped: known only to lie below the bound
    # fewer rivals than the window: every unlisted token lies below the smallest listed one
    assert t.rivals[1] == [(43, -4.9)] and t.bounds[1] == pytest.approx(-4.9)
    assert TokenTrace.from_dict(json.loads(json.dumps(t.to_dict()))) == t


def test_completion_without_token_ids_or_logprobs_has_no_trace() -> None:
    assert trace_from_completion({"text": "x", "logprobs": None}) is None
    named = {"tokens": [" x"], "token_logprobs": [-0.1], "top_logprobs": [{" x": -0.1}], "text_offset": [0]}
    assert trace_from_completion({"text": " x", "logprobs": named}) is None  # names, not token ids
    short = {"tokens": [tid(1), tid(2)], "token_logprobs": [-0.1, -0.2], "top_logprobs": [{}], "text_offset": [0, 1]}
    assert trace_from_completion({"text": "ab", "logprobs": short}) is None  # one top list for two tokens


def test_chat_trace_reads_content_items() -> None:
    item = {"token": tid(5), "logprob": -0.2, "bytes": list(" é".encode())}
    item["top_logprobs"] = [{"token": tid(5), "logprob": -0.2}, {"token": tid(6), "logprob": -1.8}]
    t = trace_from_chat({"logprobs": {"content": [item]}})
    assert t is not None and t.ids == [5] and t.pieces == [" é"] and t.rivals == [[(6, -1.8)]]
    assert trace_from_chat({"logprobs": None}) is None


# --- classification -------------------------------------------------------------------------------------------


def test_first_difference() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_near_tie_within_the_margin_is_a_tie_flip() -> None:
    base = trace([1, 7, 3], [[], [(8, -0.72)], []], [-0.1, -0.70, -0.1])
    plan = trace([1, 8, 4], [[], [(7, -0.71)], []], [-0.1, -0.69, -0.1])
    d = explain(base, plan, margin=0.1)
    assert d.kind == TIE_FLIP and d.tie_flip and d.position == 1
    assert (d.baseline_token, d.plan_token, d.baseline_piece, d.plan_piece) == (7, 8, "<7>", "<8>")
    assert d.baseline_logprobs == (-0.70, -0.72) and d.plan_logprobs == (-0.71, -0.69)
    assert d.baseline_gap == pytest.approx(0.02) and d.plan_gap == pytest.approx(0.02)
    assert "near-tie" in d.reason and "margin 0.1" in d.reason


def test_gap_beyond_the_margin_is_unexplained() -> None:
    base = trace([7], [[(8, -2.0)]], [-0.2])
    plan = trace([8], [[(7, -0.75)]], [-0.65])
    d = explain(base, plan, margin=0.5)
    assert d.kind == UNEXPLAINED and d.baseline_gap == pytest.approx(1.8) and d.plan_gap == pytest.approx(0.1)
    assert "beyond numerical noise" in d.reason


def test_rival_outside_the_trace_is_unexplained_with_a_bound() -> None:
    base = trace([7], [[]], [-0.01])  # the plan's token is not among the baseline's close rivals
    plan = trace([8], [[(7, -0.8)]], [-0.6])
    d = explain(base, plan, margin=0.5)
    assert d.kind == UNEXPLAINED and d.baseline_exact == (True, False)
    assert d.baseline_gap == pytest.approx(KEEP_WINDOW) and "lower bounds" in d.reason


def test_missing_traces_and_early_stops_are_unexplained() -> None:
    assert "no token logprobs" in explain(None, trace([1]), 0.1).reason
    d = explain(trace([1, 2]), trace([1, 2, 3]), 0.1)
    assert d.kind == UNEXPLAINED and d.position == 2 and "the baseline stopped after 2 tokens" in d.reason
    assert "agree" in explain(trace([1]), trace([1]), 0.1).reason


def test_margins_per_dtype() -> None:
    assert TIE_MARGINS["float32"] < TIE_MARGINS["bfloat16"]
    assert tie_margin("float32", "float32") == TIE_MARGINS["float32"]
    assert tie_margin("float32", "bfloat16") == TIE_MARGINS["bfloat16"]
    assert tie_margin("float32", None) == TIE_MARGINS["bfloat16"]  # an endpoint counts as 16-bit


def test_noise_compares_shared_positions_only() -> None:
    base = trace([1, 2, 3], [[(9, -1.0)], [(9, -2.0)], [(9, -3.0)]], [-0.1, -0.2, -0.3])
    plan = trace([1, 2, 4], [[(9, -1.1)], [(9, -2.0)], [(9, -9.0)]], [-0.1, -0.25, -0.3])
    n = measure_noise([(base, plan)])
    assert n.positions == 2 and n.pairs == 2  # position 2 differs: not shared
    assert n.max_logprob_change == pytest.approx(0.05)
    assert n.max_gap_change == pytest.approx(0.1)  # position 0: gap 0.9 vs 1.0
    empty = measure_noise([])
    assert empty.positions == 0 and empty.max_gap_change is None


# --- in the comparison and its reports ------------------------------------------------------------------------


def _sample(doc_id: int, text: str, t: TokenTrace | None) -> SampleResult:
    answer = text.split("#### ")[-1]
    return SampleResult(
        doc_id=doc_id,
        question=f"q{doc_id}?",
        target="w\n#### 5",
        generated=text,
        extracted={"strict-match": answer},
        correct={"strict-match": answer == "5"},
        trace=t,
    )


def _run(label: str, samples: list[SampleResult], dtype: str | None = "bfloat16") -> EvalRun:
    acc = sum(s.correct["strict-match"] for s in samples) / len(samples)
    return EvalRun(
        label=label,
        task="gsm8k_local",
        dataset="gsm8k",
        n_shot=5,
        metrics={"strict-match": Metric("exact_match", acc, 0.1)},
        samples=samples,
        dtype=dtype,
    )


def _flip_and_bug():
    """Baseline; a plan with one tie flip (doc 1) and one real divergence (doc 2); doc 0 identical."""
    same = trace([5, 6], [[(9, -3.0)], []])
    base = [
        _sample(0, "#### 5", same),
        _sample(1, "#### 5", trace([4, 5], [[(3, -0.45)], []], [-0.4, -0.1])),
        _sample(2, "#### 5", trace([4, 5], [[(8, -3.0)], []], [-0.05, -0.1])),
    ]
    plan = [
        _sample(0, "#### 5", trace([5, 6], [[(9, -3.1)], []])),
        _sample(1, "#### 6", trace([3, 6], [[(4, -0.44)], []], [-0.42, -0.1])),
        _sample(2, "#### 7", trace([8, 7], [[(4, -2.5)], []], [-0.1, -0.1])),
    ]
    return compare_runs([_run("tp1", base), _run("dcp2", plan)])


def test_comparison_classifies_each_disagreement() -> None:
    cmp = _flip_and_bug()
    col = cmp.columns[1]
    assert col.tie_margin == TIE_MARGINS["bfloat16"]
    by_doc = {d.doc_id: d.divergence for d in col.disagreements}
    assert by_doc[1].kind == TIE_FLIP and (by_doc[1].baseline_token, by_doc[1].plan_token) == (4, 3)
    assert by_doc[2].kind == UNEXPLAINED and by_doc[2].baseline_gap == pytest.approx(2.95)
    assert col.tie_flips == 1 and [d.doc_id for d in col.unexplained] == [2]
    assert col.noise is not None and col.noise.max_gap_change == pytest.approx(0.1)  # doc 0, position 0
    assert cmp.columns[0].tie_margin is None and cmp.columns[0].tie_flips == 0


def test_reports_carry_flips_and_unexplained(tmp_path: Path) -> None:
    cmp = _flip_and_bug()
    console = Console(record=True, width=250)
    console.print(render_table(cmp))
    text = console.export_text()
    rows = {line.split("│")[5].strip(): line for line in text.splitlines() if line.count("│") > 6}
    assert [c.strip() for c in rows["tie flips"].split("│")[6:8]] == ["—", "1"]
    assert [c.strip() for c in rows["unexplained divergences"].split("│")[6:8]] == ["—", "1"]
    assert f"tie margin {TIE_MARGINS['bfloat16']:g} nats" in text

    md = comparison_markdown(cmp)
    assert "1 tie flip(s), 1 unexplained" in md
    flip_row = next(line for line in md.splitlines() if line.startswith("| 1 | 0 |"))
    assert '`"<4>"` (4)' in flip_row and '`"<3>"` (3)' in flip_row  # the token pair
    assert "-0.4000 / -0.4500" in flip_row and "0.0500" in flip_row and "| tie flip |" in flip_row
    bug_row = next(line for line in md.splitlines() if line.startswith("| 2 | 0 |"))
    assert "**unexplained**" in bug_row and "2.9500" in bug_row

    write_report(cmp, tmp_path)
    data = json.loads((tmp_path / "comparison.json").read_text())
    col = data["columns"][1]
    assert col["tie_flips"] == 1 and col["unexplained_divergences"] == 1
    assert col["tie_margin"] == TIE_MARGINS["bfloat16"]
    kinds = {d["doc_id"]: d["divergence"]["kind"] for d in col["disagreements"]}
    assert kinds == {1: TIE_FLIP, 2: UNEXPLAINED}
    assert col["noise"]["pairs"] == 1 and math.isclose(col["noise"]["max_gap_change"], 0.1)
    assert (tmp_path / "accuracy.png").read_bytes()[:4] == b"\x89PNG"


def test_endpoint_without_dtype_uses_the_16_bit_margin() -> None:
    base = [_sample(0, "#### 5", trace([5]))]
    cmp = compare_runs([_run("tp1", base, "float32"), _run("http://h:1", base, None)])
    assert cmp.columns[1].tie_margin == TIE_MARGINS["bfloat16"]
    assert any("dtype unknown for http://h:1" in n for n in cmp.notes)


def test_eval_run_with_traces_round_trips() -> None:
    run = _run("a", [_sample(0, "#### 5", trace([5, 6], [[(9, -3.0)], []]))])
    again = EvalRun.from_dict(json.loads(json.dumps(run.to_dict())))
    assert again == run and again.samples[0].trace.logprob(0, 9) == (-3.0, True)

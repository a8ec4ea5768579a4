"""Render a Comparison: one rich table in lm-eval's shape, and comparison.{json,md} + accuracy.png files; each
disagreement with the baseline shows its first differing token pair, both runs' logprobs and the tie margin."""

from __future__ import annotations

import io
import json
from pathlib import Path

from rich.table import Table
from rich.text import Text

from engine.io_utils import atomic_write_bytes, atomic_write_text
from evals.bench.report import SPECULATION_CELLS
from evals.compare import Agreement, Comparison, Disagreement, PlanColumn
from evals.divergence import Divergence
from evals.results import EvalRun
from evals.targets import plan_dir_names

FIXED_HEADER = ["Dataset", "Version", "Filter", "n-shot", "Metric"]
MAX_MD_DISAGREEMENTS = 20


def _acc(col: PlanColumn, filt: str) -> str:
    if col.failed:
        return "FAILED"
    m = col.metrics.get(filt)
    if m is None:
        return "—"
    return f"{m.value:.4f} ± {m.stderr:.4f}" if m.stderr is not None else f"{m.value:.4f} ± N/A"


def _agree(a: Agreement | None) -> str:
    if a is None:
        return "—"
    return f"{a.same}/{a.total} ({a.fraction:.1%})" if a.fraction is not None else f"{a.same}/{a.total}"


def _delta(col: PlanColumn, filt: str, is_base: bool) -> str:
    if is_base:
        return "baseline"
    d = col.delta.get(filt)
    return "—" if d is None else f"{d:+.4f}"


def _num(value: float | None, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def _count(col: PlanColumn, n: int, is_base: bool) -> str:
    return "—" if is_base or col.failed or col.text_agreement is None else str(n)


UNEXPLAINED_ROW = "unexplained divergences"


def noise_lines(cmp: Comparison) -> list[str]:
    """Per plan: the tie margin and how far logprobs moved from the baseline's on shared prefixes."""
    lines = []
    for col in cmp.columns[1:]:
        n = col.noise
        if col.tie_margin is None or n is None:
            continue
        moved = (
            f"chosen-vs-rival gap moved at most {n.max_gap_change:.4g} nats (p99 {n.p99_gap_change:.4g}) over "
            f"{n.pairs} token pairs, the chosen token's logprob at most {n.max_logprob_change:.4g} over "
            f"{n.positions} positions"
            if n.max_gap_change is not None and n.max_logprob_change is not None
            else f"no token pairs recorded in both runs ({n.positions} positions)"
        )
        lines.append(
            f"{col.label}: tie margin {col.tie_margin:g} nats; on prefixes shared with the baseline the {moved}"
        )
    return lines


def comparison_grid(cmp: Comparison) -> tuple[list[str], list[list[str]], int]:
    """Header, rows and the index of the first non-accuracy row; shared by the rich and markdown tables."""
    header = FIXED_HEADER + [c.label for c in cmp.columns]
    rows: list[list[str]] = []
    shot = f"{cmp.n_shot if cmp.n_shot is not None else '?'} ({cmp.mode})"
    for k, f in enumerate(cmp.filters):
        first = k == 0
        rows.append(
            [
                cmp.dataset if first else "",
                (cmp.version or "") if first else "",
                f,
                shot if first else "",
                "exact_match ↑",
            ]
            + [_acc(c, f) for c in cmp.columns]
        )
    n_acc = len(rows)
    n_common = len(cmp.common_doc_ids)
    for f in cmp.filters:
        rows.append(["", "", f, "", "Δ vs baseline"] + [_delta(c, f, i == 0) for i, c in enumerate(cmp.columns)])
    for f in cmp.filters:
        rows.append(["", "", f, "", "answer agreement"] + [_agree(c.answer_agreement.get(f)) for c in cmp.columns])
    rows.append(["", "", "", "", "text agreement"] + [_agree(c.text_agreement) for c in cmp.columns])
    rows.append(["", "", "", "", "tie flips"] + [_count(c, c.tie_flips, i == 0) for i, c in enumerate(cmp.columns)])
    rows.append(
        ["", "", "", "", UNEXPLAINED_ROW] + [_count(c, len(c.unexplained), i == 0) for i, c in enumerate(cmp.columns)]
    )
    rows.append(
        ["", "", "", "", f"samples ({n_common} common)"] + ["—" if c.failed else str(c.n_samples) for c in cmp.columns]
    )
    rows.append(["", "", "", "", "wall time (s)"] + [_num(c.wall_s, ".1f") for c in cmp.columns])
    rows.append(["", "", "", "", "generated tokens/s"] + [_num(c.tokens_per_s, ".1f") for c in cmp.columns])
    if any(c.speculation is not None for c in cmp.columns):
        counters = [None if c.speculation is None else c.speculation.as_dict() for c in cmp.columns]
        for name, value, fmt in SPECULATION_CELLS:
            cells = ["—" if s is None or value(s) is None else fmt(value(s)) for s in counters]
            rows.append(["", "", "", "", name, *cells])
    return header, rows, n_acc


def render_table(cmp: Comparison) -> Table:
    """The comparison as one rich Table: lm-eval's columns on the left, then one column per plan."""
    _, rows, n_acc = comparison_grid(cmp)
    caption = [f"{c.label}: FAILED — {c.error}" for c in cmp.columns if c.failed] + cmp.notes + noise_lines(cmp)
    table = Table(title=f"lm-eval {cmp.task}: {cmp.dataset}", caption="\n".join(caption) or None)
    for name in FIXED_HEADER:
        table.add_column(name, no_wrap=name != "Dataset")
    for col in cmp.columns:
        table.add_column(col.label, justify="right", style="red" if col.failed else None)
    for i, row in enumerate(rows):
        if i == n_acc:
            table.add_section()
        if row[len(FIXED_HEADER) - 1] == UNEXPLAINED_ROW:
            row = [*row[: len(FIXED_HEADER)], *(_alarm(c) for c in row[len(FIXED_HEADER) :])]
        table.add_row(*row)
    return table


def _alarm(cell: str) -> Text | str:
    return Text(cell, style="bold red") if cell not in ("0", "—") else cell


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def comparison_markdown(cmp: Comparison) -> str:
    """Markdown: the same grid as render_table, then failures, notes and the first disagreements."""
    header, rows, _ = comparison_grid(cmp)
    out = [f"# lm-eval {cmp.task}: {cmp.dataset}", ""]
    out.append("| " + " | ".join(_md_cell(h) for h in header) + " |")
    out.append("|" + "|".join("---" if i < len(FIXED_HEADER) else "---:" for i in range(len(header))) + "|")
    out += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows]
    out.append("")
    failed = [c for c in cmp.columns if c.failed]
    if failed:
        out += ["## Failed plans", ""] + [f"- **{c.label}**: {c.error}" for c in failed] + [""]
    if cmp.notes:
        out += ["## Notes", ""] + [f"- {n}" for n in cmp.notes] + [""]
    lines = noise_lines(cmp)
    if lines:
        out += ["## Tie margins and numerical noise", ""] + [f"- {line}" for line in lines] + [""]
    for col in cmp.columns[1:]:
        if col.disagreements:
            out += _disagreements_markdown(col, cmp.baseline.label)
    return "\n".join(out)


def _piece(text: str, token: int | None) -> str:
    return f"`{json.dumps(text, ensure_ascii=False)}` ({token})"


def _logprobs(values: tuple[float, float] | None, exact: tuple[bool, bool]) -> str:
    if values is None:
        return "—"
    return " / ".join(f"{v:.4f}" if ok else f"< {v:.3f}" for v, ok in zip(values, exact, strict=True))


def _gap(value: float | None, exact: bool) -> str:
    return "—" if value is None else f"{value:.4f}" if exact else f"≥ {value:.3f}"


def _divergence_row(d: Disagreement) -> str:
    v: Divergence = d.divergence
    if v.position is None or v.baseline_token is None:
        cells = [str(d.doc_id), "—" if v.position is None else str(v.position), "—", "—", "—", "—", "—", "—"]
    else:
        cells = [
            str(d.doc_id),
            str(v.position),
            _piece(v.baseline_piece, v.baseline_token),
            _piece(v.plan_piece, v.plan_token),
            _logprobs(v.baseline_logprobs, v.baseline_exact),
            _logprobs(v.plan_logprobs, v.plan_exact),
            _gap(v.baseline_gap, all(v.baseline_exact)),
            _gap(v.plan_gap, all(v.plan_exact)),
        ]
    kind = v.kind if v.tie_flip else f"**{v.kind}**: {v.reason}"
    return "| " + " | ".join(_md_cell(c) for c in [*cells, kind]) + " |"


def _disagreements_markdown(col: PlanColumn, base: str) -> list[str]:
    n, flips = len(col.disagreements), col.tie_flips
    out = [
        f"## {col.label} vs {base}: {n} question(s) with different text — {flips} tie flip(s), {n - flips} unexplained",
        "",
        f"At each question's first differing generated token (# counts from 0): the baseline's and the plan's "
        f"token (text and id), each run's logprobs of [baseline token / plan token], and each run's gap (its own "
        f"token's logprob minus the other's). Both gaps within the tie margin ({col.tie_margin:g} nats): a tie flip.",
        "",
        "| doc | token # | baseline token | plan token | baseline logprobs | plan logprobs | baseline gap | plan gap "
        "| kind |",
        "|---:|---:|---|---|---|---|---:|---:|---|",
    ]
    out += [_divergence_row(d) for d in col.disagreements]
    out.append("")
    shown = sorted(col.disagreements, key=lambda d: d.divergence.tie_flip)[:MAX_MD_DISAGREEMENTS]
    for d in shown:
        answers = ", ".join(f"{f}: {d.baseline_answers.get(f)} → {d.plan_answers.get(f)}" for f in d.answers_differ)
        out += [
            f"### doc {d.doc_id} (gold {d.gold}), {d.divergence.kind}"
            + (f" — answers differ: {answers}" if answers else ""),
            "",
            f"> {_md_cell(d.question)}",
            "",
            f"{base}:",
            "````text",
            d.baseline_text,
            "````",
            f"{col.label}:",
            "````text",
            d.plan_text,
            "````",
            "",
        ]
    if n > MAX_MD_DISAGREEMENTS:
        out += [f"... and {n - MAX_MD_DISAGREEMENTS} more texts in comparison.json", ""]
    return out


def accuracy_png(cmp: Comparison) -> bytes:
    """PNG bytes: accuracy per plan (grouped by filter) with stderr error bars and, beside it when plans were
    compared, each plan's questions against the baseline: same text, tie flips, unexplained divergences."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    n_plans, n_filters = len(cmp.columns), max(len(cmp.filters), 1)
    paired = [c for c in cmp.columns[1:] if c.text_agreement is not None]
    acc_w = max(5.0, 1.2 * n_plans * n_filters + 2)
    fig = Figure(figsize=(acc_w + (5.0 if paired else 0.0), 4), dpi=100)
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(1, 2, width_ratios=[acc_w, 5.0]) if paired else fig.add_gridspec(1, 1)
    ax = fig.add_subplot(grid[0, 0])
    width = 0.8 / max(n_plans, 1)
    for p, col in enumerate(cmp.columns):
        xs, ys, errs = [], [], []
        for k, f in enumerate(cmp.filters):
            x = k + (p - (n_plans - 1) / 2) * width
            m = col.metrics.get(f)
            if col.failed or m is None:
                ax.text(
                    x,
                    0.02,
                    f"{col.label}: failed" if col.failed else "n/a",
                    rotation=90,
                    ha="center",
                    va="bottom",
                    fontsize=8,
                    color="red",
                )
                continue
            xs.append(x)
            ys.append(m.value)
            errs.append(m.stderr or 0.0)
        if xs:  # a failed plan gets its "failed" marks but no legend entry or colour
            bars = ax.bar(xs, ys, width, yerr=errs, capsize=3, color=f"C{p % 10}", label=col.label)
            ax.bar_label(bars, labels=[f"{y:.3f}" for y in ys], label_type="center", fontsize=7, color="white")
    ax.set_xticks(range(len(cmp.filters)), cmp.filters)
    ax.set_xlim(-0.5, n_filters - 0.5)
    ax.set_ylim(0, 1)
    ax.set_ylabel("exact_match")
    ax.set_title(f"{cmp.task}: {cmp.dataset}", fontsize=9)
    if ax.get_legend_handles_labels()[0]:  # no bars (every target failed): no legend, no matplotlib warning
        ax.legend(fontsize=8)
    if paired:
        _agreement_panel(fig.add_subplot(grid[0, 1]), paired)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _agreement_panel(ax, columns: list[PlanColumn]) -> None:
    """Stacked bars per plan: questions with the baseline's text, tie flips, unexplained divergences."""
    ys = range(len(columns))
    parts = [
        ("same text", "tab:green", [c.text_agreement.same if c.text_agreement else 0 for c in columns]),
        ("tie flip", "tab:orange", [c.tie_flips for c in columns]),
        ("unexplained", "tab:red", [len(c.unexplained) for c in columns]),
    ]
    left = [0] * len(columns)
    for name, colour, counts in parts:
        bars = ax.barh(list(ys), counts, left=left, color=colour, label=name)
        ax.bar_label(bars, labels=[str(n) if n else "" for n in counts], label_type="center", fontsize=7)
        left = [a + b for a, b in zip(left, counts, strict=True)]
    ax.set_yticks(list(ys), [c.label for c in columns], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("questions")
    ax.set_title("generations vs the baseline", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=3, frameon=False)


def write_samples(run: EvalRun, plan_dir: Path) -> Path:
    """Write one plan's samples (samples.jsonl) and its run summary (run.json) under `plan_dir`."""
    lines = "".join(
        json.dumps(
            {
                "doc_id": s.doc_id,
                "question": s.question,
                "target": s.target,
                "gold": s.gold,
                "generated": s.generated,
                "extracted": s.extracted,
                "correct": s.correct,
                "prompt_hash": s.prompt_hash,
            },
            ensure_ascii=False,
        )
        + "\n"
        for s in run.samples
    )
    atomic_write_text(plan_dir / "run.json", json.dumps(run.to_dict(with_samples=False), indent=2) + "\n")
    return atomic_write_text(plan_dir / "samples.jsonl", lines)


def write_report(cmp: Comparison, out_dir: Path) -> dict[str, Path]:
    """Write comparison.json, comparison.md, accuracy.png and <plan>/samples.jsonl; return the paths."""
    out_dir = Path(out_dir)
    paths: dict[str, Path] = {}
    data = cmp.to_dict()
    names = plan_dir_names([c.label for c in cmp.columns])
    runs = cmp.runs if len(cmp.runs) == len(cmp.columns) else [None] * len(cmp.columns)
    for col_data, name, run in zip(data["columns"], names, runs, strict=True):
        if run is not None:
            paths[f"samples:{run.label}"] = write_samples(run, out_dir / name)
            col_data["samples_file"] = f"{name}/samples.jsonl"
    paths["json"] = atomic_write_text(out_dir / "comparison.json", json.dumps(data, indent=2) + "\n")
    paths["md"] = atomic_write_text(out_dir / "comparison.md", comparison_markdown(cmp))
    paths["png"] = atomic_write_bytes(out_dir / "accuracy.png", accuracy_png(cmp))
    return paths

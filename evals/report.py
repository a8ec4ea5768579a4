"""Render a Comparison: one rich table in lm-eval's shape, and comparison.{json,md} + accuracy.png files."""

from __future__ import annotations

import io
import json
from pathlib import Path

from rich.table import Table

from engine.io_utils import atomic_write_bytes, atomic_write_text
from evals.compare import Agreement, Comparison, PlanColumn
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
    rows.append(
        ["", "", "", "", f"samples ({n_common} common)"] + ["—" if c.failed else str(c.n_samples) for c in cmp.columns]
    )
    rows.append(["", "", "", "", "wall time (s)"] + [_num(c.wall_s, ".1f") for c in cmp.columns])
    rows.append(["", "", "", "", "generated tokens/s"] + [_num(c.tokens_per_s, ".1f") for c in cmp.columns])
    return header, rows, n_acc


def render_table(cmp: Comparison) -> Table:
    """The comparison as one rich Table: lm-eval's columns on the left, then one column per plan."""
    _, rows, n_acc = comparison_grid(cmp)
    caption = [f"{c.label}: FAILED — {c.error}" for c in cmp.columns if c.failed] + cmp.notes
    table = Table(title=f"lm-eval {cmp.task}: {cmp.dataset}", caption="\n".join(caption) or None)
    for name in FIXED_HEADER:
        table.add_column(name, no_wrap=name != "Dataset")
    for col in cmp.columns:
        table.add_column(col.label, justify="right", style="red" if col.failed else None)
    for i, row in enumerate(rows):
        if i == n_acc:
            table.add_section()
        table.add_row(*row)
    return table


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
    base = cmp.baseline.label
    for col in cmp.columns[1:]:
        if not col.disagreements:
            continue
        n = len(col.disagreements)
        out += [f"## {col.label} vs {base}: {n} question(s) with different text", ""]
        for d in col.disagreements[:MAX_MD_DISAGREEMENTS]:
            answers = ", ".join(f"{f}: {d.baseline_answers.get(f)} → {d.plan_answers.get(f)}" for f in d.answers_differ)
            out += [
                f"### doc {d.doc_id} (gold {d.gold}){' — answers differ: ' + answers if answers else ''}",
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
            out += [f"... and {n - MAX_MD_DISAGREEMENTS} more in comparison.json", ""]
    return "\n".join(out)


def accuracy_png(cmp: Comparison) -> bytes:
    """A bar chart of accuracy per plan (grouped by filter) with stderr error bars, as PNG bytes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    n_plans, n_filters = len(cmp.columns), max(len(cmp.filters), 1)
    fig = Figure(figsize=(max(5.0, 1.2 * n_plans * n_filters + 2), 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
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
    ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


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

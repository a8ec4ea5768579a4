"""Render a benchmark: one rich table (a column per target, ratios against the first), bench.{json,md} and PNG
plots of throughput and TPOT per target, all written atomically."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.table import Table

from engine.core.speculative import SpecCounters
from engine.io_utils import atomic_write_bytes, atomic_write_text
from engine.plan.kv_sizing import format_bytes
from evals.bench.client import RequestRecord
from evals.bench.metrics import BenchMetrics, HandoffMetrics, Stat
from evals.bench.roofline import Roofline

NONE = "-"


@dataclass
class TargetBench:
    """One column: a plan, a URL or the HF reference, with what was measured (or why it failed)."""

    label: str
    kind: str  # "plan", "url" or "hf"
    spec: str
    metrics: BenchMetrics | None = None
    error: str | None = None
    world_size: int | None = None
    kv_bytes_per_rank: int | None = None
    token_capacity: int | None = None
    num_blocks: int | None = None
    peak_kv_blocks: int | None = None
    preemptions: int | None = None
    speculation: SpecCounters | None = None  # speculative decoding during the measured run (None: the plan has none)
    roofline: Roofline | None = None
    records: list[RequestRecord] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)  # the server's /v1/engine/stats after the run
    launch: dict[str, Any] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return self.error is not None

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "kind": self.kind,
            "spec": self.spec,
            "error": self.error,
            "metrics": self.metrics.to_dict() if self.metrics else None,
            "world_size": self.world_size,
            "kv_bytes_per_rank": self.kv_bytes_per_rank,
            "token_capacity": self.token_capacity,
            "num_blocks": self.num_blocks,
            "peak_kv_blocks": self.peak_kv_blocks,
            "preemptions": self.preemptions,
            "speculation": self.speculation.as_dict() if self.speculation else None,
            "roofline": self.roofline.to_dict() if self.roofline else None,
            "stats": self.stats,
            "launch": self.launch,
            "requests": [r.to_dict() for r in self.records],
        }


@dataclass
class BenchReport:
    """The whole run: settings, workload, measured bandwidth per device, the columns and notes."""

    settings: dict[str, Any]
    workload: dict[str, Any]
    targets: list[TargetBench]
    bandwidth_bytes_s: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "settings": self.settings,
            "workload": self.workload,
            "bandwidth_bytes_s": self.bandwidth_bytes_s,
            "notes": self.notes,
            "targets": [t.to_dict() for t in self.targets],
        }


# --- the grid -----------------------------------------------------------------------------------------------

Getter = Callable[[TargetBench], float | None]


def _metric(fn: Callable[[BenchMetrics], float | None]) -> Getter:
    return lambda t: None if t.metrics is None else fn(t.metrics)


def _ms(stat: Callable[[BenchMetrics], Stat], part: str) -> Getter:
    def get(t: TargetBench) -> float | None:
        if t.metrics is None:
            return None
        value = getattr(stat(t.metrics), part)
        return None if value is None else value * 1e3

    return get


def _roof(fn: Callable[[Roofline], float]) -> Getter:
    return lambda t: None if t.roofline is None else fn(t.roofline)


# (row label, value getter, format, show the ratio to the first column)
ROWS: list[tuple[str, Getter, Callable[[float], str], bool]] = [
    ("output tok/s ↑", _metric(lambda m: m.output_throughput), lambda v: f"{v:.1f}", True),
    ("requests/s ↑", _metric(lambda m: m.request_throughput), lambda v: f"{v:.3f}", True),
    ("TTFT mean (ms) ↓", _ms(lambda m: m.ttft, "mean"), lambda v: f"{v:.0f}", True),
    ("TTFT p50 (ms) ↓", _ms(lambda m: m.ttft, "p50"), lambda v: f"{v:.0f}", True),
    ("TTFT p99 (ms) ↓", _ms(lambda m: m.ttft, "p99"), lambda v: f"{v:.0f}", True),
    ("TPOT mean (ms) ↓", _ms(lambda m: m.tpot, "mean"), lambda v: f"{v:.1f}", True),
    ("TPOT p50 (ms) ↓", _ms(lambda m: m.tpot, "p50"), lambda v: f"{v:.1f}", True),
    ("TPOT p99 (ms) ↓", _ms(lambda m: m.tpot, "p99"), lambda v: f"{v:.1f}", True),
    ("ITL p50 (ms)", _ms(lambda m: m.itl, "p50"), lambda v: f"{v:.1f}", False),
    ("ITL p99 (ms)", _ms(lambda m: m.itl, "p99"), lambda v: f"{v:.1f}", False),
    ("wall time (s)", _metric(lambda m: m.duration_s), lambda v: f"{v:.1f}", False),
    ("world size", lambda t: t.world_size, lambda v: f"{v:.0f}", False),
    ("weights per rank", _roof(lambda r: r.weight_bytes_per_rank), lambda v: format_bytes(v), True),
    ("KV bytes per rank", lambda t: t.kv_bytes_per_rank, lambda v: format_bytes(v), True),
    ("KV token capacity ↑", lambda t: t.token_capacity, lambda v: f"{v:,.0f}", True),
    ("preemptions", lambda t: t.preemptions, lambda v: f"{v:.0f}", False),
    ("decode step (ms, ITL p50)", _roof(lambda r: r.measured_step_s * 1e3), lambda v: f"{v:.3g}", False),
    ("read weights+KV once (ms)", _roof(lambda r: r.limit_s * 1e3), lambda v: f"{v:.3g}", False),
    ("fraction of roofline ↑", _roof(lambda r: r.fraction), lambda v: f"{v:.3f}", False),
]


def _handoff(fn: Callable[[HandoffMetrics], float | None]) -> Getter:
    return lambda t: None if t.metrics is None or t.metrics.handoff is None else fn(t.metrics.handoff)


def _ms_or_none(value: float | None) -> float | None:
    return None if value is None else value * 1e3


# P/D deployments: rows shown when a target reports hand-offs
HANDOFF_ROWS: list[tuple[str, Getter, Callable[[float], str], bool]] = [
    ("hand-off: descriptors per decode rank", _handoff(lambda h: h.descriptors_per_rank), lambda v: f"{v:,.0f}", True),
    ("hand-off: MiB per decode rank", _handoff(lambda h: h.bytes_per_rank / 2**20), lambda v: f"{v:.2f}", False),
    ("hand-off: READ ms per rank, p50", _handoff(lambda h: _ms_or_none(h.transfer.p50)), lambda v: f"{v:.2f}", True),
    ("hand-off: READ ms per rank, min", _handoff(lambda h: _ms_or_none(h.transfer.min)), lambda v: f"{v:.2f}", True),
    ("hand-off: raw 1-region READ ms, min", _handoff(lambda h: _ms_or_none(h.raw.min)), lambda v: f"{v:.2f}", False),
    ("hand-off: READ / raw, p50", _handoff(lambda h: h.ratio.p50), lambda v: f"{v:.2f}", False),
    ("TTFT split: prefill ms, mean", _handoff(lambda h: _ms_or_none(h.prefill.mean)), lambda v: f"{v:.0f}", True),
    (
        "TTFT split: claim+queue ms, mean",
        _handoff(lambda h: _ms_or_none(h.claim_queue.mean)),
        lambda v: f"{v:.1f}",
        True,
    ),
    (
        "TTFT split: transfer ms, mean",
        _handoff(lambda h: _ms_or_none(h.transfer_ttft.mean)),
        lambda v: f"{v:.1f}",
        True,
    ),
    (
        "TTFT split: first decode ms, mean",
        _handoff(lambda h: _ms_or_none(h.first_decode.mean)),
        lambda v: f"{v:.0f}",
        True,
    ),
]


def _speculation(fn: Callable[[dict], float | None]) -> Getter:
    return lambda t: None if t.speculation is None else fn(t.speculation.as_dict())


# plans with speculative_config: (row name, value from SpecCounters.as_dict, format); `dcpctl eval` shows them too
SPECULATION_CELLS: list[tuple[str, Callable[[dict], float | None], Callable[[float], str]]] = [
    ("speculation: proposals accepted", lambda s: s["acceptance_rate"], "{:.0%}".format),
    ("speculation: tokens per verification", lambda s: s["mean_accepted_length"], "{:.2f}".format),
]
# rows shown when a target speculates
SPECULATION_ROWS: list[tuple[str, Getter, Callable[[float], str], bool]] = [
    (name, _speculation(value), fmt, False) for name, value, fmt in SPECULATION_CELLS
]


def _ratio(value: float | None, base: float | None) -> str:
    if value is None or base is None or base == 0:
        return ""
    return f" (×{value / base:.2f})"


def _requests_cell(t: TargetBench) -> str:
    if t.failed and t.metrics is None:
        return "FAILED"
    m = t.metrics
    assert m is not None
    return f"{m.completed} ok" + (f", {m.failed} failed" if m.failed else "")


def _blocks_cell(t: TargetBench) -> str:
    if t.peak_kv_blocks is None:
        return NONE
    return f"{t.peak_kv_blocks} / {t.num_blocks}" if t.num_blocks else str(t.peak_kv_blocks)


def bench_grid(report: BenchReport) -> tuple[list[str], list[list[str]]]:
    """Header and rows shared by the rich and Markdown tables; every cell is text."""
    cols = report.targets
    header = ["metric"] + [t.label for t in cols]
    rows = [["requests"] + [_requests_cell(t) for t in cols]]
    base = cols[0] if cols else None
    handoffs = any(t.metrics is not None and t.metrics.handoff is not None for t in cols)
    speculates = any(t.speculation is not None for t in cols)
    extra = (HANDOFF_ROWS if handoffs else []) + (SPECULATION_ROWS if speculates else [])
    for name, get, fmt, with_ratio in ROWS + extra:
        base_value = get(base) if base is not None and not base.failed else None
        cells = []
        for i, t in enumerate(cols):
            value = get(t)
            if value is None:
                cells.append(NONE)
                continue
            ratio = _ratio(value, base_value) if with_ratio and i > 0 else ""
            cells.append(fmt(value) + ratio)
        rows.append([name, *cells])
        if name == "world size":
            rows.append(["peak KV blocks used", *(_blocks_cell(t) for t in cols)])
    return header, rows


def caption_lines(report: BenchReport) -> list[str]:
    """Why targets failed, then the notes."""
    return [f"{t.label}: FAILED — {t.error}" for t in report.targets if t.failed] + report.notes


def _title(report: BenchReport) -> str:
    w, s = report.workload, report.settings
    load = f"request rate {s['request_rate']}/s" if s.get("request_rate") else f"concurrency {s.get('concurrency')}"
    inputs = (
        f"input {w['input_len_min']}"
        if w["input_len_min"] == w["input_len_max"]
        else f"input {w['input_len_mean']:.0f}"
    )
    return f"bench: {w['num_prompts']} prompts, {inputs} / output {w['output_len']} tokens, {load}"


def render_table(report: BenchReport) -> Table:
    """The benchmark as one rich Table: a row per metric, a column per target (ratios against the first).
    Failures and notes are `caption_lines` (printed under it: a caption would wrap at the table's width)."""
    header, rows = bench_grid(report)
    title = _title(report)
    table = Table(title=title, min_width=len(title) + 4)
    table.add_column(header[0], no_wrap=True)
    for t in report.targets:
        table.add_column(t.label, justify="right", style="red" if t.failed else None)
    for row in rows:
        table.add_row(*row)
    return table


def roofline_lines(report: BenchReport) -> list[str]:
    """Per target: the decode step against the time to read its bytes once at the measured bandwidth."""
    lines = []
    for t in report.targets:
        r = t.roofline
        if r is None:
            continue
        ranks = f" x {r.ranks_per_memory} ranks sharing memory" if r.ranks_per_memory > 1 else ""
        lines.append(
            f"{t.label}: decode step {r.measured_step_s * 1e3:.3g} ms vs {r.limit_s * 1e3:.3g} ms to read "
            f"({format_bytes(r.weight_bytes_per_rank)} weights + {format_bytes(r.kv_bytes_per_rank)} KV of "
            f"{r.batch:.1f} seqs x {r.context_len:.0f} tokens){ranks} at {r.bandwidth_bytes_s / 1e9:.1f} GB/s "
            f"= {r.fraction:.3f} of the memory-bandwidth limit"
        )
    return lines


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def bench_markdown(report: BenchReport) -> str:
    """Markdown: the same grid as the rich table, then bandwidth, failures and notes."""
    header, rows = bench_grid(report)
    out = [f"# {_title(report)}", ""]
    out.append("| " + " | ".join(_md(h) for h in header) + " |")
    out.append("|---|" + "|".join("---:" for _ in header[1:]) + "|")
    out += ["| " + " | ".join(_md(c) for c in row) + " |" for row in rows]
    out += ["", f"Workload: {report.workload['source']}; ratios are against the first column ({header[1]}).", ""]
    if report.bandwidth_bytes_s:
        bw = ", ".join(f"{dev} {v / 1e9:.1f} GB/s" for dev, v in report.bandwidth_bytes_s.items())
        out += [f"Memory bandwidth (copy benchmark, read + write): {bw}.", ""]
    roof = roofline_lines(report)
    if roof:
        out += ["## Decode roofline", ""] + [f"- {_md(line)}" for line in roof] + [""]
    caption = caption_lines(report)
    if caption:
        out += ["## Notes", ""] + [f"- {_md(c)}" for c in caption] + [""]
    return "\n".join(out)


# --- plots --------------------------------------------------------------------------------------------------


def _figure(n: int) -> tuple[Any, Any]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(5.0, 1.4 * n + 2), 4), dpi=100)
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _png(fig: Any) -> bytes:
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _mark_failed(ax: Any, x: float, t: TargetBench) -> None:
    ax.text(x, 0, f"{t.label}: failed", rotation=90, ha="center", va="bottom", fontsize=8, color="red")


def throughput_png(report: BenchReport) -> bytes:
    """Output tokens/s per target, as PNG bytes."""
    fig, ax = _figure(len(report.targets))
    for i, t in enumerate(report.targets):
        if t.metrics is None:
            _mark_failed(ax, i, t)
            continue
        bars = ax.bar([i], [t.metrics.output_throughput], 0.6, color=f"C{i % 10}")
        ax.bar_label(bars, labels=[f"{t.metrics.output_throughput:.1f}"], fontsize=8)
    ax.set_xticks(range(len(report.targets)), [t.label for t in report.targets], rotation=15, fontsize=8)
    ax.set_ylabel("output tokens/s")
    ax.set_title(_title(report), fontsize=9)
    return _png(fig)


def tpot_png(report: BenchReport) -> bytes:
    """TPOT mean / p50 / p99 (ms) per target, as PNG bytes."""
    fig, ax = _figure(len(report.targets))
    parts = ("mean", "p50", "p99")
    width = 0.8 / len(parts)
    for k, part in enumerate(parts):
        xs, ys = [], []
        for i, t in enumerate(report.targets):
            value = getattr(t.metrics.tpot, part) if t.metrics is not None else None
            if value is not None:
                xs.append(i + (k - 1) * width)
                ys.append(value * 1e3)
        if xs:
            bars = ax.bar(xs, ys, width, color=f"C{k}", label=part)
            ax.bar_label(bars, labels=[f"{y:.1f}" for y in ys], fontsize=7)
    for i, t in enumerate(report.targets):
        if t.metrics is None:
            _mark_failed(ax, i, t)
    ax.set_xticks(range(len(report.targets)), [t.label for t in report.targets], rotation=15, fontsize=8)
    ax.set_ylabel("TPOT (ms per output token)")
    ax.set_title(_title(report), fontsize=9)
    ax.legend(fontsize=8)
    return _png(fig)


def write_report(report: BenchReport, out_dir: Path) -> dict[str, Path]:
    """Write bench.json (with every request's timestamps), bench.md, throughput.png and tpot.png."""
    out_dir = Path(out_dir)
    return {
        "json": atomic_write_text(out_dir / "bench.json", json.dumps(report.to_dict(), indent=2) + "\n"),
        "md": atomic_write_text(out_dir / "bench.md", bench_markdown(report)),
        "throughput_png": atomic_write_bytes(out_dir / "throughput.png", throughput_png(report)),
        "tpot_png": atomic_write_bytes(out_dir / "tpot.png", tpot_png(report)),
    }

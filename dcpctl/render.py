"""Rich rendering the commands share: the console, the plan validation table, the targets' problems, and the
progress lines of a run over targets (evals' Feed, drawn)."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from rich.text import Text

from engine.errors import UserError
from engine.plan.kv_sizing import format_bytes
from engine.plan.report import PlanReport
from evals.targets import Target, resolve_targets


def make_console() -> Console:
    """A console for comparison output; wide when not a terminal (rich would squeeze the table to 80 columns)."""
    console = Console()
    return console if console.is_terminal else Console(width=200)


def _kv_cell(report: PlanReport) -> str:
    if report.kv is None:
        return "-"
    return f"{format_bytes(report.kv.bytes_per_rank)} / {report.kv.tokens_per_rank} tok"


def render_validation(console: Console, reports: list[PlanReport]) -> None:
    """The validation table, then every error, warning and note under it."""
    table = Table(title="Plan validation", header_style="bold")
    for column in ("plan", "world", "tp", "dcp", "interleave", "block", "KV per rank", "status"):
        table.add_column(column, justify="left" if column in ("plan", "status", "KV per rank") else "right")
    for r in reports:
        p = r.loaded.plan.parallel if r.loaded else None
        status = Text("valid", style="green") if r.valid else Text(f"invalid ({len(r.errors)})", style="bold red")
        table.add_row(
            r.name,
            str(r.world_size or "?"),
            str(p.tp if p else "?"),
            str(p.dcp if p else "?"),
            str(p.interleave if p else "?"),
            str(r.loaded.plan.cache.block_size if r.loaded else "?"),
            _kv_cell(r),
            status,
        )
    console.print(table)
    for r in reports:
        for e in r.errors:
            console.print(Text.assemble(("error ", "bold red"), f"{r.name}: ", str(e)), soft_wrap=True)
        for w in r.warnings:
            console.print(Text.assemble(("warning ", "yellow"), f"{r.name}: {w}"), soft_wrap=True)
        for n in r.notes:
            console.print(Text.assemble(("note ", "dim"), f"{r.name}: {n}"), soft_wrap=True)
        if r.cpu_paths is not None:
            console.print(Text.assemble(("cpu ", "dim"), f"{r.name}: {r.cpu_paths.describe()}"), soft_wrap=True)


def checked_targets(specs: list[str], overrides: list[str], console: Console) -> list[Target]:
    """The targets, after showing the plans' validation table; every problem printed and a UserError if any."""
    check = resolve_targets(specs, overrides)
    if check.reports:
        render_validation(console, check.reports)
    if check.problems:
        for p in check.problems:
            console.print(Text.assemble(("error ", "bold red"), p), soft_wrap=True)
        raise UserError(
            f"{len(check.problems)} problem(s) in the targets above; fix them (nothing was launched, no eval was run)"
        )
    return check.targets


class ProgressFeed:
    """evals' Feed as rich progress lines, one per target: 'LABEL: what it does now', then its summary or
    'FAILED — reason'. With `bars`, a bar counts the target's requests (and stays where a failure stopped it)."""

    def __init__(self, console: Console, *, bars: bool = False) -> None:
        columns = [SpinnerColumn(), TextColumn("{task.description}")]
        if bars:
            columns += [BarColumn(), MofNCompleteColumn()]
        self.progress = Progress(*columns, TimeElapsedColumn(), console=console, transient=False)
        self.bars = bars

    def __enter__(self) -> ProgressFeed:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.__exit__(*exc)

    def target(self, label: str, total: int) -> _ProgressLine:
        task = self.progress.add_task(escape(f"{label}: waiting"), total=total)
        return _ProgressLine(self, task, label, total)


class _ProgressLine:
    """One target's line of a ProgressFeed."""

    def __init__(self, feed: ProgressFeed, task: TaskID, label: str, total: int) -> None:
        self.feed, self.task, self.label, self.total = feed, task, label, total

    def status(self, message: str) -> None:
        self.feed.progress.update(self.task, description=escape(f"{self.label}: {message}"))

    def advance(self) -> None:
        self.feed.progress.advance(self.task)

    def finish(self, message: str, *, failed: bool = False) -> None:
        if failed:
            text = f"[red]{escape(self.label)}: FAILED[/] — {escape(message)}"
            done = None if self.feed.bars else self.total
        else:
            text, done = escape(f"{self.label}: {message}"), self.total
        self.feed.progress.update(self.task, completed=done, description=text)

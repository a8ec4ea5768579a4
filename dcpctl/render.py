"""Rich rendering the commands share: the console, the plan validation table, the targets' problems, and the
progress lines of a run over targets (evals' Feed, drawn)."""

from __future__ import annotations

import time

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


PLAIN_PROGRESS_EVERY_S = 15.0  # a non-terminal output gets a progress line at most this often


class ProgressFeed:
    """evals' Feed, drawn: one line per target ('LABEL: what it does now', a bar of its work done / total,
    generated tokens/s, elapsed), then its summary or 'FAILED — reason' (the bar stays where the failure stopped it).
    A console that is not a terminal (a log, a pipe) gets plain lines instead: each status, progress every
    PLAIN_PROGRESS_EVERY_S seconds, the end. `redirect`: rich shows what others print to stdout/stderr above the
    lines (off while that output goes to a run log instead)."""

    def __init__(self, console: Console, *, redirect: bool = True) -> None:
        self.console = console
        self.live = console.is_terminal
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(),
            console=console,
            transient=False,
            redirect_stdout=redirect,
            redirect_stderr=redirect,
        )

    def __enter__(self) -> ProgressFeed:
        if self.live:
            self.progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live:
            self.progress.__exit__(*exc)

    def target(self, label: str, total: int) -> _ProgressLine:
        task = self.progress.add_task(escape(f"{label}: waiting"), total=total or None, rate="")
        return _ProgressLine(self, task, label, total or None)


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}"


class _ProgressLine:
    """One target's line of a ProgressFeed."""

    def __init__(self, feed: ProgressFeed, task: TaskID, label: str, total: int | None) -> None:
        self.feed, self.task, self.label, self.total = feed, task, label, total
        self.t0 = time.monotonic()
        self.done, self.rate, self.said = 0, None, ""
        self.printed_at = self.t0

    def _say(self, text: str) -> None:
        self.feed.console.print(f"{self.label}: {text}", highlight=False, markup=False)

    def status(self, message: str) -> None:
        if self.feed.live:
            self.feed.progress.update(self.task, description=escape(f"{self.label}: {message}"))
        elif message != self.said:
            self._say(message)
        self.said = message

    def expect(self, total: int) -> None:
        self.total = total
        self.feed.progress.update(self.task, total=total)

    def advance(self) -> None:
        self.done += 1
        self.feed.progress.advance(self.task)
        now = time.monotonic()
        if not self.feed.live and (self.done == self.total or now - self.printed_at >= PLAIN_PROGRESS_EVERY_S):
            self.printed_at = now
            rate = f", {self.rate:.1f} tok/s" if self.rate is not None else ""
            self._say(f"{self.done}/{self.total or '?'} done{rate}, {_clock(now - self.t0)}")

    def throughput(self, tokens_per_s: float) -> None:
        self.rate = tokens_per_s
        self.feed.progress.update(self.task, rate=f"{tokens_per_s:.1f} tok/s")

    def finish(self, message: str, *, failed: bool = False) -> None:
        if not self.feed.live:
            self._say(f"FAILED — {message}" if failed else f"{message} ({_clock(time.monotonic() - self.t0)})")
            return
        if failed:
            text, done = f"[red]{escape(self.label)}: FAILED[/] — {escape(message)}", None
        else:
            text, done = escape(f"{self.label}: {message}"), self.total or 1
        self.feed.progress.update(self.task, completed=done, total=self.total or 1, description=text)

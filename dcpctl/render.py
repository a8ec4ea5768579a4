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

from dcpctl.placement_view import resolved_placement, weights_cell
from engine.errors import UserError
from engine.plan.kv_sizing import format_bytes
from engine.plan.resolved import ResolvedPlan
from engine.plan.validation import PlanCheck
from evals.targets import Target, resolve_targets


def make_console() -> Console:
    """A console for comparison output; wide when not a terminal (rich would squeeze the table to 80 columns)."""
    console = Console()
    return console if console.is_terminal else Console(width=200)


def _kv_cell(resolved: ResolvedPlan | None) -> str:
    if resolved is None or resolved.kv is None:
        return "-"
    kv = resolved.kv
    draft = f" + draft {format_bytes(kv.draft_bytes)} on rank 0" if kv.draft_bytes else ""
    return f"{format_bytes(kv.bytes_per_rank)} / {kv.tokens_per_rank} tok{draft}"


def _weights_cell(resolved: ResolvedPlan | None) -> str:
    placed = resolved_placement(resolved)
    if placed is None:
        return "-"
    spec = resolved.speculative
    draft = f" + draft {format_bytes(spec.draft.num_params * placed[1])} on rank 0" if spec and spec.draft else ""
    return weights_cell(*placed) + draft


def _dense_cell(resolved: ResolvedPlan | None) -> str:
    """parallel.dense / the DCP combine it runs (auto resolved where the placement is known)."""
    if resolved is None:
        return "?"
    p = resolved.plan.parallel
    return f"{p.dense}/{resolved.placement.comm_backend if resolved.placement else p.dcp_comm_backend}"


def render_validation(console: Console, checks: list[PlanCheck]) -> None:
    """The validation table, then every error, warning and note under it."""
    table = Table(title="Plan validation", header_style="bold")
    columns = (
        "plan",
        "world",
        "tp",
        "dcp",
        "interleave",
        "block",
        "dense",
        "weights per rank",
        "KV per rank",
        "status",
    )
    for column in columns:
        table.add_column(column, justify="left" if column in ("plan", "status", "dense", "KV per rank") else "right")
    for c in checks:
        res = c.resolved
        p = res.plan.parallel if res else None
        errors = len(c.problems.errors)
        status = Text("valid", style="green") if c.valid else Text(f"invalid ({errors})", style="bold red")
        table.add_row(
            c.name,
            str((res.world_size if res else None) or "?"),
            str(p.tp if p else "?"),
            str(p.dcp if p else "?"),
            str(p.interleave if p else "?"),
            str(res.plan.cache.block_size if res else "?"),
            _dense_cell(res),
            _weights_cell(res),
            _kv_cell(res),
            status,
        )
    console.print(table)
    for c in checks:
        for e in c.problems.errors:
            console.print(Text.assemble(("error ", "bold red"), f"{c.name}: ", str(e)), soft_wrap=True)
        for w in c.problems.warnings:
            console.print(Text.assemble(("warning ", "yellow"), f"{c.name}: {w}"), soft_wrap=True)
        for n in c.problems.notes:
            console.print(Text.assemble(("note ", "dim"), f"{c.name}: {n}"), soft_wrap=True)
        if c.resolved is not None and c.resolved.cpu_paths is not None:
            paths = c.resolved.cpu_paths.describe()
            console.print(Text.assemble(("cpu ", "dim"), f"{c.name}: {paths}"), soft_wrap=True)
        if c.resolved is not None and (c.resolved.world_size or 1) > 1:
            transport = c.resolved.collectives_transport
            console.print(Text.assemble(("collectives ", "dim"), f"{c.name}: {transport}"), soft_wrap=True)


def checked_targets(specs: list[str], overrides: list[str], console: Console) -> list[Target]:
    """The targets, after showing the plans' validation table; every problem printed and a UserError if any."""
    check = resolve_targets(specs, overrides)
    if check.plan_checks:
        render_validation(console, check.plan_checks)
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
